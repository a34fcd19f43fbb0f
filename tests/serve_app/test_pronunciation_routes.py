"""Pronunciation dictionaries over HTTP (serve_app/pronunciation.py) in process, keys on: the
ElevenLabs-shaped CRUD with ownership and scopes, the official SDK's calls, and the aliases
reaching the audio through every route that takes them (OpenAI, ElevenLabs HTTP, WebSockets)."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments import constants
from serve_app.ingress import IngressConfig
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _ingress, client

ALICE = "sk-alice-0123456789abcdef"  # synthesis + voices
BOB = "sk-bob-00000000000000000000"  # synthesis + voices
READER = "sk-reader-000000000000000"  # synthesis only
ROOT_KEY = "sk-root-00000000000000000"  # admin
KEYS = f"{ALICE}:synthesis+voices,{BOB}:synthesis+voices,{READER}:synthesis,{ROOT_KEY}:admin"
BASE = "/v1/pronunciation-dictionaries"
RULES = [{"string_to_replace": "NYC", "type": "alias", "alias": "New York City"},
         {"string_to_replace": "sql", "type": "alias", "alias": "sequel", "case_sensitive": False}]


def _h(key: str) -> dict:
    return {"xi-api-key": key}


def _samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


@pytest.fixture
def ingress(monkeypatch, tmp_path):
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS)
    monkeypatch.setenv(constants.ENV_HOME, str(tmp_path))  # the pronunciation store's default place
    ingress = _ingress(IngressConfig(max_input_chars=1000))
    asyncio.run(ingress.frontend._target.register_voice("default", "hi", np.full(16000, 0.1, np.float32), 16000))
    return ingress


@pytest.fixture
def app(ingress):
    return ingress.__serve_build_asgi_app__()


def _run(app, fn):
    async def main():
        async with client(app) as c:
            return await fn(c)

    return asyncio.run(main())


def _detail(r) -> dict:
    body = r.json()
    assert set(body) == {"detail"}, body  # ElevenLabs' error shape
    return body["detail"]


def test_crud_ownership_versions_and_the_error_shape(app, tmp_path):
    async def main(c):
        r = await c.post(f"{BASE}/add-from-rules", headers=_h(ALICE), json={"name": "tech", "rules": RULES,
                                                                             "workspace_access": "viewer"})
        assert r.status_code == 200, r.text
        made = r.json()
        assert made["version_rules_num"] == 2 and made["name"] == "tech" and made["created_by"].startswith("key-")
        did = made["id"]
        r = await c.post(f"{BASE}/add-from-rules", headers=_h(READER), json={"name": "x", "rules": []})
        assert r.status_code == 403 and _detail(r)["status"] == "insufficient_scope"
        r = await c.post(f"{BASE}/add-from-rules", json={"name": "x", "rules": []})
        assert r.status_code == 401 and _detail(r)["status"] == "missing_api_key"
        shared = (await c.post(f"{BASE}/add-from-rules", headers=_h(ROOT_KEY), json={"name": "b", "rules": []})).json()
        # listing: each key its own; an admin all; newest first by default
        ids = lambda r: [d["id"] for d in r.json()["pronunciation_dictionaries"]]
        assert ids(await c.get(BASE, headers=_h(ALICE))) == [did]
        assert ids(await c.get(BASE, headers=_h(READER))) == []
        assert ids(await c.get(BASE, headers=_h(ROOT_KEY))) == [shared["id"], did]
        page = (await c.get(BASE, headers=_h(ROOT_KEY), params={"page_size": 1, "sort_direction": "ascending"})).json()
        assert page["has_more"] and [d["id"] for d in page["pronunciation_dictionaries"]] == [did]
        page = (await c.get(BASE, headers=_h(ROOT_KEY), params={"page_size": 1, "sort_direction": "ascending",
                                                                 "cursor": page["next_cursor"]})).json()
        assert not page["has_more"] and [d["id"] for d in page["pronunciation_dictionaries"]] == [shared["id"]]
        # another key's dictionary is unknown to read, change and use; the admin's own is not Alice's
        r = await c.get(f"{BASE}/{did}", headers=_h(BOB))
        assert r.status_code == 404 and _detail(r)["status"] == "pronunciation_dictionary_not_found"
        r = await c.post(f"{BASE}/{did}/add-rules", headers=_h(BOB), json={"rules": RULES})
        assert r.status_code == 404
        # rules: each change a new version
        got = (await c.get(f"{BASE}/{did}", headers=_h(ALICE))).json()
        assert got["rules"][1] == {"string_to_replace": "sql", "type": "alias", "alias": "sequel",
                                   "case_sensitive": False, "word_boundaries": True}
        r = await c.post(f"{BASE}/{did}/add-rules", headers=_h(ALICE),
                         json={"rules": [{"string_to_replace": "<&>", "type": "alias", "alias": "and"}]})
        v2 = r.json()
        assert r.status_code == 200 and v2["version_rules_num"] == 3 and v2["version_id"] != made["version_id"]
        r = await c.post(f"{BASE}/{did}/remove-rules", headers=_h(ALICE), json={"rule_strings": ["NYC"]})
        assert r.json()["version_rules_num"] == 2
        r = await c.post(f"{BASE}/{did}/set-rules", headers=_h(ALICE), json={"rules": RULES[:1]})
        assert r.json()["version_rules_num"] == 1
        r = await c.get(f"{BASE}/{did}/{v2['version_id']}/download", headers=_h(ALICE))
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/pls+xml")
        assert "<grapheme>&lt;&amp;&gt;</grapheme><alias>and</alias>" in r.text
        # rename and archive: no new version; archived ones are listed only when asked
        r = await c.patch(f"{BASE}/{did}", headers=_h(ALICE), json={"name": "renamed", "archived": True})
        assert r.status_code == 200 and r.json()["name"] == "renamed" and r.json()["archived_time_unix"]
        assert ids(await c.get(BASE, headers=_h(ALICE))) == []
        assert ids(await c.get(BASE, headers=_h(ALICE), params={"include_archived": "true"})) == [did]
        # refused input, in the family's shape
        r = await c.post(f"{BASE}/add-from-rules", headers=_h(ALICE), json={"name": "p", "rules": [
            {"string_to_replace": "tomato", "type": "phoneme", "phoneme": "təˈmeɪtoʊ", "alphabet": "ipa"}]})
        assert r.status_code == 400 and "phoneme rules are not supported" in _detail(r)["message"]
        r = await c.post(f"{BASE}/add-from-file", headers=_h(ALICE), files={"file": ("a.pls", b"<lexicon/>")},
                         data={"name": "f"})
        assert r.status_code == 400 and _detail(r)["status"] == "unsupported"
        assert (await c.get(f"{BASE}/no..pe", headers=_h(ALICE))).status_code == 400
        # a shared dictionary is changed by an admin only; deleting answers 404 afterwards
        r = await c.delete(f"{BASE}/{shared['id']}", headers=_h(ALICE))
        assert r.status_code == 404  # the admin's own dictionary is owned, not shared: unknown to Alice
        assert (await c.delete(f"{BASE}/{did}", headers=_h(ALICE))).json() == {
            "pronunciation_dictionary_id": did, "deleted": True}
        assert (await c.get(f"{BASE}/{did}", headers=_h(ALICE))).status_code == 404

    assert not (tmp_path / "pronunciation").exists()  # made at the first write, not by /health
    assert _run(app, lambda c: c.get("/health?detail=1", headers=_h(ROOT_KEY))).json()["frontend"][
        "pronunciation_store_writable"] is True
    _run(app, main)
    assert (tmp_path / "pronunciation").is_dir()  # $FAST_COSY_HOME/pronunciation


def test_a_store_that_refuses_writes_is_a_503_naming_it(app, tmp_path):
    (tmp_path / "pronunciation").write_bytes(b"")  # a file where the directory should be

    async def main(c):
        r = await c.post(f"{BASE}/add-from-rules", headers=_h(ALICE), json={"name": "x", "rules": RULES})
        assert r.status_code == 503 and _detail(r)["status"] == "pronunciation_store_unavailable"
        assert str(tmp_path / "pronunciation") in _detail(r)["message"]
        assert (await c.get(BASE, headers=_h(ALICE))).json()["pronunciation_dictionaries"] == []
        health = (await c.get("/health?detail=1", headers=_h(ROOT_KEY))).json()
        assert health["status"] == "degraded" and health["frontend"]["pronunciation_store_writable"] is False
        assert health["frontend"]["pronunciation_store"]["path"] == str(tmp_path / "pronunciation")

    _run(app, main)


def _dictionary(app, key=ALICE, rules=RULES) -> dict:
    return _run(app, lambda c: c.post(f"{BASE}/add-from-rules", headers=_h(key), json={"name": "d", "rules": rules})
                ).json()


def test_aliases_reach_the_audio_on_the_http_routes(app):
    d = _dictionary(app)
    loc = [{"pronunciation_dictionary_id": d["id"], "version_id": d["version_id"]}]

    async def main(c):
        out = {}
        r = await c.post("/v1/text-to-speech/alloy/stream?output_format=pcm_24000", headers=_h(ALICE),
                         json={"text": "NYC and SQL", "pronunciation_dictionary_locators": loc})
        out["eleven"] = r
        r = await c.post("/v1/audio/speech", headers={"Authorization": f"Bearer {ALICE}"}, json={
            "model": "tts-1", "input": "NYC and SQL", "voice": "alloy", "response_format": "pcm", "stream": False,
            "pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": d["id"]}],  # the latest version
            "pronunciation_rules": [{"string_to_replace": "and", "alias": "plus"}]})
        out["openai"] = r
        out["bob"] = await c.post("/v1/text-to-speech/alloy?output_format=pcm_24000", headers=_h(BOB),
                                  json={"text": "NYC", "pronunciation_dictionary_locators": loc})
        out["native"] = await c.post("/v1/tts", headers=_h(ALICE), json={
            "text": "NYC", "voice_id": "default", "response_format": "pcm",
            "pronunciation_rules": [{"string_to_replace": "NYC", "alias": "the city"}]})
        out["native_typo"] = await c.post("/v1/tts", headers=_h(ALICE), json={"text": "NYC", "voice_id": "default",
                                                                             "pronunciation_rule": []})
        out["four"] = await c.post("/v1/text-to-speech/alloy?output_format=pcm_24000", headers=_h(ALICE),
                                   json={"text": "NYC", "pronunciation_dictionary_locators": loc * 4})
        out["openai_bad"] = await c.post("/v1/audio/speech", headers=_h(ALICE), json={
            "model": "tts-1", "input": "NYC", "voice": "alloy", "pronunciation_rules": [{"string_to_replace": ""}]})
        return out

    out = _run(app, main)
    assert out["eleven"].status_code == 200 and len(out["eleven"].content) == 2 * _samples("New York City and sequel")
    assert len(out["openai"].content) == 2 * _samples("New York City plus sequel")
    assert len(out["native"].content) == 2 * _samples("the city")
    assert out["native_typo"].status_code == 400  # /v1/tts still refuses unknown fields
    assert out["bob"].status_code == 404 and _detail(out["bob"])["status"] == "pronunciation_dictionary_not_found"
    assert out["four"].status_code == 400 and "pronunciation_dictionary_locators" in _detail(out["four"])["message"]
    assert out["openai_bad"].status_code == 400 and out["openai_bad"].json()["error"]["param"].startswith(
        "pronunciation_rules")


def test_official_elevenlabs_sdk_pronunciation_dictionary_calls(app):
    elevenlabs = pytest.importorskip("elevenlabs")
    from elevenlabs.pronunciation_dictionaries.rules.types.pronunciation_dictionary_rule import (
        PronunciationDictionaryRule_Alias,
    )

    async def main():
        http = client(app)
        sdk = elevenlabs.AsyncElevenLabs(api_key=ALICE, base_url="http://t", httpx_client=http)
        pd = sdk.pronunciation_dictionaries
        made = await pd.create_from_rules(name="tech", rules=[
            elevenlabs.BodyAddAPronunciationDictionaryV1PronunciationDictionariesAddFromRulesPostRulesItem_Alias(
                string_to_replace="NYC", alias="New York City")])
        listed = await pd.list(page_size=10)
        got = await pd.get(made.id)
        added = await pd.rules.add(made.id, rules=[
            PronunciationDictionaryRule_Alias(string_to_replace="SQL", alias="sequel")])
        removed = await pd.rules.remove(made.id, rule_strings=["NYC"])
        updated = await pd.update(made.id, name="renamed")
        pls = b"".join([c async for c in pd.download(made.id, added.version_id)])
        locator = elevenlabs.PronunciationDictionaryVersionLocator(pronunciation_dictionary_id=made.id,
                                                                   version_id=added.version_id)
        audio = b"".join([c async for c in sdk.text_to_speech.convert(
            "alloy", text="NYC SQL", output_format="pcm_24000", pronunciation_dictionary_locators=[locator])])
        await http.aclose()
        return made, listed, got, added, removed, updated, pls, audio

    made, listed, got, added, removed, updated, pls, audio = asyncio.run(main())
    assert made.version_rules_num == 1 and [d.id for d in listed.pronunciation_dictionaries] == [made.id]
    assert got.rules[0].alias == "New York City" and got.latest_version_id == made.version_id
    assert added.version_rules_num == 2 and removed.version_rules_num == 1 and updated.name == "renamed"
    assert b"<grapheme>SQL</grapheme><alias>sequel</alias>" in pls
    assert len(audio) == 2 * _samples("New York City sequel")


# ------------------------------------------------------------------------------------ WebSockets
def _ws_audio(c, path: str, first: dict, texts: list[str]) -> tuple[int, list[dict]]:
    with c.websocket_connect(path) as ws:
        ws.send_json(first)
        for t in texts:
            ws.send_json({"text": t})
        ws.send_json({"text": ""})
        messages = []
        while True:
            m = ws.receive_json()
            messages.append(m)
            if m.get("isFinal") or "error" in m:
                break
    return sum(len(base64.b64decode(m["audio"])) for m in messages if m.get("audio")), messages


@pytest.mark.parametrize("mode", ["bistream", "sentence"])
def test_stream_input_applies_the_first_message_s_dictionaries_across_messages(app, mode):
    d = _dictionary(app, rules=[{"string_to_replace": "New York", "alias": "Big Apple"}])
    path = f"/v1/text-to-speech/alloy/stream-input?output_format=pcm_24000&mode={mode}"
    first = {"text": " ", "pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": d["id"],
                                                                 "version_id": d["version_id"]}]}
    with TestClient(app, headers=_h(ALICE)) as c:
        aliased, a = _ws_audio(c, path, first, ["I love New", " York", " in spring."])  # the rule spans messages
        expected, e = _ws_audio(c, path, {"text": " "}, ["I love Big Apple in spring."])
        plain, p = _ws_audio(c, path, {"text": " "}, ["I love New York in spring."])
        _, failed = _ws_audio(c, path, {"text": " ", "pronunciation_dictionary_locators": [
            {"pronunciation_dictionary_id": "nosuchdictionary"}]}, ["Hi."])
    assert [m[-1].get("error") for m in (a, e, p)] == [None] * 3  # a session cut short fails with its error
    assert aliased == expected != plain
    assert failed[-1]["error"]["code"] == "pronunciation_dictionary_not_found"


def test_multi_stream_input_contexts_have_their_own_dictionaries(app):
    d = _dictionary(app)
    loc = [{"pronunciation_dictionary_id": d["id"], "version_id": d["version_id"]}]
    audio: dict[str, int] = {}
    with TestClient(app, headers=_h(ALICE)) as c, c.websocket_connect(
            "/v1/text-to-speech/alloy/multi-stream-input?output_format=pcm_24000") as ws:
        ws.send_json({"text": " ", "context_id": "a", "pronunciation_dictionary_locators": loc})
        ws.send_json({"text": " ", "context_id": "b"})
        ws.send_json({"text": "NYC rocks", "context_id": "a", "flush": True})
        ws.send_json({"text": "NYC rocks", "context_id": "b", "flush": True})
        ws.send_json({"context_id": "a", "close_context": True})
        ws.send_json({"context_id": "b", "close_context": True})
        ws.send_json({"text": "Hi.", "context_id": "c", "flush": True,
                      "pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": "nosuchdictionary"}]})
        finals, errors = set(), []
        while finals != {"a", "b"} or not errors:
            m = ws.receive_json()
            if "error" in m:
                errors.append(m)
                continue
            if m.get("audio"):
                audio[m["contextId"]] = audio.get(m["contextId"], 0) + len(base64.b64decode(m["audio"]))
            if m.get("isFinal"):
                finals.add(m["contextId"])
        ws.send_json({"close_socket": True})
    assert audio == {"a": 2 * _samples("New York City rocks"), "b": 2 * _samples("NYC rocks")}
    # an unknown dictionary fails its context only
    assert [(e["contextId"], e["error"]) for e in errors] == [("c", "pronunciation_dictionary_not_found")]


def test_openai_sdk_sends_rules_with_extra_body(app):
    openai = pytest.importorskip("openai")
    d = _dictionary(app)

    async def main():
        http = client(app)
        sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key=ALICE, http_client=http, max_retries=0)
        r = await sdk.audio.speech.create(model="tts-1", voice="alloy", input="NYC and SQL", response_format="pcm",
                                          extra_body={"pronunciation_rules": [{"string_to_replace": "and",
                                                                               "alias": "plus"}],
                                                      "pronunciation_dictionary_locators": [
                                                          {"pronunciation_dictionary_id": d["id"]}]})
        await http.aclose()
        return r.content

    assert len(asyncio.run(main())) == 2 * _samples("New York City plus sequel")
