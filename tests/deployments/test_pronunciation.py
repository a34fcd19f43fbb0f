"""Pronunciation dictionaries on the frontend deployment: ownership as for voices, a request's
aliases from its rules and dictionaries (versions, precedence, bounds), and, over the real tiny
model's frontend, an alias changing what is normalised and tokenised."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.pronunciation import MAX_LOCATORS, PronunciationConfig, PronunciationService
from deployments.protocol import (
    AliasRule,
    DictionaryForbiddenError,
    DictionaryNotFoundError,
    InvalidInputError,
    PayloadTooLargeError,
    PronunciationSpec,
    SynthesisRequest,
    VoiceAccess,
)

ALICE, BOB = VoiceAccess(owner="key-a", sees_all=False), VoiceAccess(owner="key-b", sees_all=False)
ADMIN, OPEN = VoiceAccess(owner="key-root", sees_all=True), VoiceAccess()
NYC = AliasRule("NYC", "New York City")


def _service(tmp_path, **limits) -> PronunciationService:
    return PronunciationService(PronunciationConfig(dir=str(tmp_path / "pron"), **limits))


def test_dictionaries_belong_to_their_key_as_voices_do(tmp_path):
    svc = _service(tmp_path)
    mine = svc.create("mine", None, [NYC], ALICE)
    shared = svc.create("shared", "made with keys off", [AliasRule("SQL", "sequel")], OPEN)
    assert mine.owner == "key-a" and shared.owner is None
    assert {d.id for d in svc.list(ALICE)} == {mine.id, shared.id}
    assert {d.id for d in svc.list(BOB)} == {shared.id}
    assert {d.id for d in svc.list(ADMIN)} == {mine.id, shared.id}
    with pytest.raises(DictionaryNotFoundError):  # another key's: unknown, to read, change and use
        svc.get(mine.id, BOB)
    with pytest.raises(DictionaryNotFoundError):
        svc.add_rules(mine.id, BOB, [AliasRule("x", "y")])
    with pytest.raises(DictionaryNotFoundError):
        svc.rewrite("NYC", PronunciationSpec(locators=((mine.id, None),)), BOB)
    with pytest.raises(DictionaryForbiddenError):  # a shared one: used by all, changed by an admin only
        svc.delete(shared.id, ALICE)
    assert svc.rewrite("SQL", PronunciationSpec(locators=((shared.id, None),)), BOB) == "sequel"
    svc.update(shared.id, ADMIN, name="renamed")
    svc.delete(mine.id, ALICE)
    assert {d.id for d in svc.list(ADMIN)} == {shared.id}


def test_rule_changes_make_versions_and_locators_pick_them(tmp_path):
    svc = _service(tmp_path)
    d = svc.create("d", None, [NYC, AliasRule("NYC", "the city")], ALICE)  # the later rule for a string wins
    v1 = d.version_id
    assert d.rules_num == 1 and svc.get(d.id, ALICE).rules == (AliasRule("NYC", "the city"),)
    v2 = svc.add_rules(d.id, ALICE, [NYC, AliasRule("LA", "Los Angeles")]).version_id
    assert [r.alias for r in svc.get(d.id, ALICE).rules] == ["New York City", "Los Angeles"]  # replaced in place
    v3 = svc.remove_rules(d.id, ALICE, ["NYC"]).version_id
    v4 = svc.set_rules(d.id, ALICE, [AliasRule("SF", "San Francisco")]).version_id
    assert len({v1, v2, v3, v4}) == 4

    def said(version):
        return svc.rewrite("NYC LA SF", PronunciationSpec(locators=((d.id, version),)), ALICE)

    assert [said(v) for v in (v1, v2, v3, v4, None)] == [
        "the city LA SF", "New York City Los Angeles SF", "NYC Los Angeles SF", "NYC LA San Francisco",
        "NYC LA San Francisco"]


def test_request_rules_come_before_dictionaries_in_the_order_named(tmp_path):
    svc = _service(tmp_path)
    a = svc.create("a", None, [AliasRule("NYC", "from a"), AliasRule("LA", "from a")], ALICE)
    b = svc.create("b", None, [AliasRule("NYC", "from b"), AliasRule("SF", "from b")], ALICE)
    spec = PronunciationSpec(locators=((b.id, None), (a.id, None)), rules=(AliasRule("SF", "own"),))
    assert svc.rewrite("NYC LA SF", spec, ALICE) == "from b from a own"
    assert svc.lexicon(spec, ALICE) is svc.lexicon(spec, ALICE)  # compiled once per resolved versions
    svc.add_rules(a.id, ALICE, [AliasRule("LA", "new a")])
    assert svc.rewrite("LA", spec, ALICE) == "new a"  # a new latest version: compiled again


def test_request_bounds(tmp_path):
    svc = _service(tmp_path)
    ids = [svc.create(f"d{i}", None, [], ALICE).id for i in range(MAX_LOCATORS + 1)]
    with pytest.raises(InvalidInputError, match="at most 3"):
        svc.lexicon(PronunciationSpec(locators=tuple((i, None) for i in ids)), ALICE)
    with pytest.raises(InvalidInputError):
        svc.lexicon(PronunciationSpec(rules=(AliasRule("", "x"),)), ALICE)
    grow = PronunciationSpec(rules=(AliasRule("a", "x" * 500),))
    assert len(svc.rewrite("a " * 2, grow, ALICE)) == 1002
    with pytest.raises(PayloadTooLargeError):  # more than four times longer + 1024
        svc.rewrite("a " * 20, grow, ALICE)
    assert svc.rewrite("NYC", None, ALICE) == "NYC" and svc.lexicon(PronunciationSpec(), ALICE) is None


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-cosyvoice2", "cosyvoice2")
    cfg = FrontendConfig(voices_dir=str(tmp_path_factory.mktemp("voices")),
                         pronunciation={"dir": str(tmp_path_factory.mktemp("pron"))})
    return TextFrontend(cfg, ModelSource(str(model_dir)))


def test_an_alias_changes_what_the_real_frontend_normalises_and_tokenises(frontend):
    """Applied before normalisation: "5G" read as the alias says, not as wetext would read it."""
    async def main():
        d = await frontend.create_dictionary("tech", None, [AliasRule("5G", "fifth generation"),
                                                            AliasRule("nyc", "New York City", False)], OPEN)
        text = "5G in NYC costs 5 dollars."
        plain = await frontend.prepare(SynthesisRequest(request_id="p", text=text, voice_id="default"))
        aliased = await frontend.prepare(SynthesisRequest(
            request_id="a", text=text, voice_id="default",
            pronunciation=PronunciationSpec(locators=((d.id, d.version_id),))))
        return plain, aliased

    plain, aliased = asyncio.run(main())
    plain_text = " ".join(p.text for p in plain.pieces)
    said = " ".join(p.text for p in aliased.pieces)
    assert "fifth generation" in said and "New York City" in said and "NYC" in plain_text
    assert "five" in said  # the rest is still normalised ("5 dollars")
    ids = np.concatenate([p.text_ids for p in aliased.pieces])
    assert ids.tolist() == np.concatenate([frontend.rt.tokenize(p.text) for p in aliased.pieces]).tolist()
    assert ids.tolist() != np.concatenate([p.text_ids for p in plain.pieces]).tolist()
