"""Sentences of the production-like capacity workload (``bench/workload.py``): what a voice agent
says in customer service, bookings, weather, banking and deliveries, in English and Chinese.

Written here as templates whose slots a seeded RNG fills: amounts with thousands separators and
cents, dates, clock times, percentages, phone numbers, distances, temperatures, flight and order
numbers, and abbreviations (Dr., Mr., approx., incl., USD, km), so that the service's text
normalisation (wetext, ``cosyvoice_runtime/frontend/normalize.py``) rewrites most of them, as it
does for real answers; a share of plain sentences (greetings, confirmations) carries no digit.
The same seed gives the same corpus.

A sentence's expected duration is its normalised text at a speaking rate (:data:`SPEAKING_RATE`):
the length a trained model would speak, against which the served length is compared.
"""
from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

# The workload's expectation of speech length (not a measurement): conversational English at
# ~2.5 words per second (150 per minute), Mandarin at ~4.5 characters per second.
SPEAKING_RATE = {"en": 2.5, "zh": 4.5}
LANGUAGES = ("en", "zh")
SENTENCES_PER_TEMPLATE = 8  # variants drawn per template: a few hundred sentences in all

_NAMES = ("Smith", "Garcia", "Chen", "Patel", "Johnson", "Nguyen", "Miller", "Kim", "Lopez", "Brown")
_CITIES = ("Seattle", "Boston", "Denver", "Austin", "Chicago", "Toronto", "London", "Sydney")
_MONTHS = ("Jan.", "Feb.", "March", "April", "May", "June", "July", "Aug.", "Sept.", "Oct.", "Nov.", "Dec.")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_HOTELS = ("the Harbor Inn", "the Grand Plaza", "Maple Suites", "the Riverside Hotel")
_ZH_CITIES = ("北京", "上海", "广州", "深圳", "杭州", "成都", "武汉", "西安", "南京", "重庆")
_ZH_DEPTS = ("内科", "外科", "眼科", "口腔科", "皮肤科", "儿科")
_ZH_WEEKDAYS = "一二三四五六日"
_ZH_AIR = ("优", "良", "轻度污染")


def _amount(r: random.Random) -> str:
    """A money amount as people write it: thousands separators and cents, or whole."""
    whole = r.choice((r.randint(1, 99), r.randint(100, 999), r.randint(1000, 99999)))
    return f"{whole:,}.{r.randint(0, 99):02d}" if r.random() < 0.7 else f"{whole:,}"


def _time(r: random.Random) -> str:
    return f"{r.randint(1, 12)}:{r.choice((0, 15, 30, 45, r.randint(0, 59))):02d} {r.choice(('AM', 'PM'))}"


def _zh_time(r: random.Random) -> str:
    return f"{r.randint(7, 21)}:{r.choice((0, 15, 30, 45, r.randint(0, 59))):02d}"


def _date(r: random.Random) -> str:
    return f"{r.choice(_MONTHS)} {r.randint(1, 28)}"


def _numeric_date(r: random.Random) -> str:
    return f"{r.randint(1, 12)}/{r.randint(1, 28)}/{r.choice((2025, 2026, 2027))}"


def _phone(r: random.Random) -> str:
    return f"{r.randint(200, 989)}-{r.randint(200, 989)}-{r.randint(0, 9999):04d}"


def _zh_phone(r: random.Random) -> str:
    return r.choice(("400-", "95")) + "".join(str(r.randint(0, 9)) for _ in range(r.choice((6, 7))))


def _slots(r: random.Random) -> dict[str, str]:
    """Every slot a template may name, drawn afresh for each sentence."""
    return {
        "amount": _amount(r), "amount2": _amount(r), "small": f"{r.randint(1, 60)}.{r.randint(0, 99):02d}",
        "time": _time(r), "time2": _time(r), "date": _date(r), "date2": _date(r), "ndate": _numeric_date(r),
        "weekday": r.choice(_WEEKDAYS), "name": r.choice(_NAMES), "city": r.choice(_CITIES),
        "hotel": r.choice(_HOTELS), "phone": _phone(r), "pct": str(r.choice((r.randint(1, 99), r.randint(1, 9)))),
        "rate": f"{r.randint(1, 9)}.{r.randint(0, 99):02d}", "km": str(r.randint(2, 480)),
        "km1": f"{r.randint(1, 30)}.{r.randint(1, 9)}", "kg": f"{r.randint(1, 40)}.{r.randint(1, 9)}",
        "min": str(r.randint(2, 55)), "n": str(r.randint(2, 12)), "nights": str(r.randint(1, 14)),
        "temp": str(r.randint(-10, 98)), "temp2": str(r.randint(-20, 35)), "gate": f"{r.choice('ABCDE')}{r.randint(1, 40)}",
        "flight": f"{r.choice(('UA', 'DL', 'AA', 'BA', 'AC'))} {r.randint(10, 2999)}",
        "order": str(r.randint(100000, 9999999)), "last4": f"{r.randint(0, 9999):04d}", "year": str(r.choice((2026, 2027))),
        "month": str(r.randint(1, 12)), "day": str(r.randint(1, 28)), "zh_time": _zh_time(r), "zh_time2": _zh_time(r),
        "zh_city": r.choice(_ZH_CITIES), "zh_dept": r.choice(_ZH_DEPTS), "zh_wd": r.choice(_ZH_WEEKDAYS),
        "zh_phone": _zh_phone(r), "zh_flight": f"{r.choice(('CA', 'MU', 'CZ', 'HU'))}{r.randint(100, 9999)}",
        "aqi": str(r.randint(8, 180)), "zh_air": r.choice(_ZH_AIR), "code": str(r.randint(100000, 999999)),
        "days": str(r.randint(1, 7)),
    }


EN_TEMPLATES = (
    "Your current balance is ${amount}, and your available credit is ${amount2}.",
    "The transfer of {amount} USD was sent on {ndate} and should arrive within {n} business days.",
    "Your card ending in {last4} was charged ${small} at {time} on {date}.",
    "Your loan payment of ${amount} is due on {weekday}, {date}; the interest rate is {rate}% APR.",
    "The savings account earns {rate}% a year, paid monthly, with no minimum balance.",
    "Today's exchange rate is {rate} Canadian dollars per USD, incl. a {pct}% fee.",
    "Your appointment with Dr. {name} is on {weekday}, {date}, at {time}.",
    "Mr. {name}, your reservation number is {order}; please arrive {min} minutes early.",
    "We have a table for {n} at {time} on {date}, and it will be held for {min} minutes.",
    "Your room at {hotel} is booked from {date} to {date2}, {nights} nights in total.",
    "The total comes to ${amount}, incl. tax, and the deposit of ${small} is refundable.",
    "Flight {flight} to {city} departs at {time} from gate {gate}.",
    "Check-in closes {min} min before departure, and each bag may weigh up to {kg} kg.",
    "Tomorrow in {city} expect a high of {temp} degrees and a {pct}% chance of rain.",
    "Winds will reach {km} km per hour this evening, so please drive carefully.",
    "The nearest store is {km1} km away, approx. {min} minutes by car.",
    "Your order number {order} shipped on {ndate} and should arrive by {weekday}, {date}.",
    "The package weighs {kg} kg, and the delivery fee is ${small}.",
    "Please call us at {phone} between {time} and {time2}, Monday to Friday.",
    "You are number {n} in the queue; the wait is approx. {min} minutes.",
    "Your plan includes {n} GB of data, and you have used {pct}% of it this month.",
    "The return window ends on {date}, and refunds take {n} to {min} days.",
    "The train to {city} leaves at {time} and arrives {km} km later, at {time2}.",
    "Your prescription from Dr. {name} is ready for pickup after {time} today.",
    "Thank you for calling, my name is Alex, how can I help you today?",
    "Let me check that for you, it will only take a moment.",
    "I have updated your address, and a confirmation e-mail is on its way.",
    "Is there anything else I can help you with?",
    "I'm sorry for the trouble, I have escalated this to our support team.",
    "Your booking is confirmed, and you will receive a text message shortly.",
    "For security reasons, please do not share your PIN with anyone, incl. our staff.",
    "Sure, I can move your appointment to a later date, etc., whatever suits you best.",
)

ZH_TEMPLATES = (
    "您的账户余额为{amount}元，可用额度为{amount2}元。",
    "您的信用卡本期应还款{amount}元，最后还款日为{month}月{day}日。",
    "这笔{amount}美元的汇款已于{year}年{month}月{day}日发出，预计{days}个工作日内到账。",
    "该理财产品年化收益率为{rate}%，起购金额为{amount}元。",
    "今日美元兑人民币汇率为{rate}，手续费为{pct}%。",
    "本次消费共计{amount}元，其中优惠{small}元。",
    "您预约的{zh_dept}门诊时间是{month}月{day}日上午{zh_time}。",
    "已为您预订{n}位的座位，时间是{month}月{day}日晚上{zh_time}。",
    "您预订的酒店入住日期为{month}月{day}日，共{nights}晚。",
    "您乘坐的航班{zh_flight}将于{month}月{day}日{zh_time}起飞，请提前{min}分钟到达登机口。",
    "每位旅客可免费托运{kg}公斤行李，超出部分每公斤收费{small}元。",
    "明天{zh_city}最高气温{temp2}℃，降水概率为{pct}%。",
    "今天{zh_city}的PM2.5指数为{aqi}，空气质量{zh_air}。",
    "距离您最近的门店约{km1}公里，步行大约需要{min}分钟。",
    "您的订单{order}已于{month}月{day}日发货，预计{days}天内送达。",
    "您的快递重{kg}公斤，运费为{small}元。",
    "请拨打客服热线{zh_phone}，工作时间为{zh_time}至{zh_time2}。",
    "您的验证码是{code}，请在{min}分钟内使用，请勿告诉他人。",
    "您前面还有{n}位用户在排队，预计等待{min}分钟。",
    "您本月已使用流量的{pct}%，剩余{kg}GB。",
    "今天是{year}年{month}月{day}日，星期{zh_wd}。",
    "您好，很高兴为您服务，请问有什么可以帮您？",
    "好的，请稍等，我帮您查询一下。",
    "您的地址已经更新成功，确认短信稍后会发送到您的手机。",
    "非常抱歉给您带来不便，我已经将问题提交给技术部门处理。",
    "请问还有其他可以帮您的吗？",
    "为了您的账户安全，请不要向任何人透露您的密码。",
    "您的预约已确认，祝您生活愉快。",
)

TEMPLATES = {"en": EN_TEMPLATES, "zh": ZH_TEMPLATES}


@dataclass(frozen=True)
class Sentence:
    lang: str
    text: str  # as a client sends it
    spoken: str  # after the service's normalisation (numbers, dates, units as words)
    expected_s: float  # the spoken text at SPEAKING_RATE


_EN_WORD = re.compile(r"[A-Za-z0-9']+")
_HAN = re.compile(r"[\u3400-\u9fff]")


def expected_seconds(spoken: str, lang: str) -> float:
    """Speech length of normalised text at :data:`SPEAKING_RATE`: English words (a hyphenated
    number is its words), Chinese characters plus any Latin words among them at the English rate."""
    words = len(_EN_WORD.findall(spoken.replace("-", " ")))
    if lang == "en":
        return words / SPEAKING_RATE["en"]
    return len(_HAN.findall(spoken)) / SPEAKING_RATE["zh"] + words / SPEAKING_RATE["en"]


def default_normalizer() -> Callable[[str], str]:
    """The service's normaliser (wetext and the project's rules), as one string per text."""
    from cosyvoice_runtime.frontend.normalize import TextNormalizer

    norm = TextNormalizer()
    return lambda text: norm.normalize(text, split=False)


@functools.cache
def corpus(seed: int = 0, per_template: int = SENTENCES_PER_TEMPLATE) -> dict[str, tuple[tuple[Sentence, ...], ...]]:
    """The sentences by language and template: ``per_template`` fillings of every template
    (duplicates dropped: a template without slots has one), each with its normalised text and
    expected duration (normalising them all takes ~1 s). A draw picks a template, then a filling,
    so the plain sentences keep their templates' share."""
    normalize = default_normalizer()
    rng = random.Random(f"corpus/{seed}")
    out: dict[str, tuple[tuple[Sentence, ...], ...]] = {}
    for lang in LANGUAGES:
        groups = []
        for template in TEMPLATES[lang]:
            texts = dict.fromkeys(template.format(**_slots(rng)) for _ in range(per_template))
            groups.append(tuple(Sentence(lang, t, (spoken := normalize(t)), round(expected_seconds(spoken, lang), 3))
                                for t in texts))
        out[lang] = tuple(groups)
    return out
