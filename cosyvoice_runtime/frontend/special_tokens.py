"""The text special tokens CosyVoice2 / CosyVoice3 register on top of the Qwen2 tokenizer (spec §2.3).

The released ``CosyVoice-BlankEN`` directory does not contain them: the reference adds them with
``add_special_tokens`` at load time, so their ids follow from the order below. This module is the
single place that order is written down; the runtime reads the resulting ids back from the loaded
tokenizer (``TextTokenizer.special_token_ids``) and checks them against the expected sizes.
"""
from __future__ import annotations

from typing import Literal

Family = Literal["cosyvoice2", "cosyvoice3"]

# Already part of the Qwen2 base vocabulary (ids 151643-151645 in the released model).
QWEN_BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"
ENDOFSYSTEM = "<|endofsystem|>"

# Registered by both families, in registration order (after the Qwen2 base specials).
_COMMON = (
    "<|endofprompt|> [breath] <strong> </strong> [noise] [laughter] [cough] [clucking] [accent] "
    "[quick_breath] <laughter> </laughter> [hissing] [sigh] [vocalized-noise] [lipsmack] [mn]"
).split()

# CosyVoice3 only: ARPAbet phones (with stress digits) for pronunciation inpainting.
_CMU_PHONES = (
    "AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 "
    "B CH D DH EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 "
    "JH K L M N NG OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 "
    "V W Y Z ZH"
).split()

# CosyVoice3 only: pinyin initials and tone-marked finals.
_PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié "
    "iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s "
    "sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī "
    "uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng "
    "ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn "
    "īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
).split()

CV2_SPECIALS: tuple[str, ...] = tuple(_COMMON)
CV3_SPECIALS: tuple[str, ...] = (
    tuple(_COMMON) + (ENDOFSYSTEM,) + tuple(f"[{p}]" for p in _CMU_PHONES) + tuple(f"[{p}]" for p in _PINYIN)
)

# Tokenizer length after registration (spec §2.3); checked at load time.
EXPECTED_VOCAB_SIZE = {"cosyvoice2": 151663, "cosyvoice3": 151924}
# Ids of the Qwen2 base specials and of <|endofprompt|> in the released vocabulary.
QWEN_BASE_VOCAB = 151643


def family_specials(family: Family) -> tuple[str, ...]:
    """Special tokens the family registers, in registration (= id) order."""
    if family == "cosyvoice2":
        return CV2_SPECIALS
    if family == "cosyvoice3":
        return CV3_SPECIALS
    raise ValueError(f"unknown model family {family!r}")


assert len(_CMU_PHONES) == 84 and len(_PINYIN) == 176, "special-token tables out of sync with spec §2.3"
assert QWEN_BASE_VOCAB + len(QWEN_BASE_SPECIALS) + len(CV2_SPECIALS) == EXPECTED_VOCAB_SIZE["cosyvoice2"]
assert QWEN_BASE_VOCAB + len(QWEN_BASE_SPECIALS) + len(CV3_SPECIALS) == EXPECTED_VOCAB_SIZE["cosyvoice3"]
