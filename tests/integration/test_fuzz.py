"""Bad input against every endpoint on real local Ray (hypothesis-generated and hand-picked).

Every answer is either a success (200/201) or a documented error (400, 404, 405, 409, 413, 415,
429, 503) carrying the JSON error shape and the request id; never a 500, and no replica crashes
(the synthesizer replica id and the frontend's voices are the same after the run). Sizes are
enforced before the whole body is read: a request that declares a huge body is answered at once.
Hypothesis examples per endpoint stay modest (CI time); ``deadline=None`` because the service,
not the generator, sets the pace.
"""
from __future__ import annotations

import json
import socket
from urllib.parse import quote, urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.load import synthetic_prompt_wav
from cosyvoice_runtime.frontend.errors import InvalidVoiceIdError
from cosyvoice_runtime.frontend.voices import VoiceRegistry, check_voice_id

pytestmark = pytest.mark.ray

DOCUMENTED = {400, 404, 405, 409, 413, 415, 429, 503}
VOICE = "fuzzv"
EXAMPLES = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
TRIED = {"count": 0}


@pytest.fixture(scope="module")
def app(tts_app):
    url = tts_app["base_url"]
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": VOICE, "prompt_text": "fuzz voice", "overwrite": "true"},
                   files={"audio": ("v.wav", synthetic_prompt_wav(2.0), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
    before = _replica_ids(url)
    yield {"url": url, "client": httpx.Client(base_url=url, timeout=60)}
    # No replica crashed or restarted under the fuzz, and the service still works.
    assert _replica_ids(url) == before
    ok = httpx.post(f"{url}/v1/audio/speech", json={"model": "tts-1", "input": "Still fine.", "voice": VOICE,
                                                    "response_format": "pcm"}, timeout=30)
    assert ok.status_code == 200 and ok.content


def _replica_ids(url: str) -> set[str]:
    seen: set[str] = set()
    for _ in range(3):
        seen |= set(httpx.get(f"{url}/health?detail=1", timeout=30).json()["synthesizer_replicas"])
    return seen


def check(r: httpx.Response, ok=(200, 201)) -> None:
    """The contract for any input."""
    TRIED["count"] += 1
    assert r.status_code in set(ok) | DOCUMENTED, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error", "request_id"} and body["request_id"] == r.headers["x-request-id"], body
        assert isinstance(body["error"]["message"], str) and "Traceback" not in r.text
        if r.status_code in (429, 503):
            assert int(r.headers["retry-after"]) >= 1


# ------------------------------------------------------------------------------ strategies
weird_text = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=st.characters(codec="utf-8", categories=("Cc", "Cf", "Zs", "Zl", "Zp", "Co", "Mn")), max_size=40),
    st.sampled_from(["", " ", "\x00", "\u202e\u2066", "a\x00b", "<|endofprompt|>", "<|im_start|>", "🙂" * 30,
                     "1/0 = ∞", "%s%n%x", "' OR 1=1 --", "{{7*7}}", "\\u0000", "\r\n" * 10, "x" * 2001]),
)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                        st.floats(allow_nan=True, allow_infinity=True), weird_text)
voice_ids = st.one_of(st.text(max_size=80), st.sampled_from(
    ["../../etc/passwd", "..", ".", "/etc/passwd", "a/b", "a\\b", "%2e%2e%2f", "C:\\x", "fuzzv\x00", " fuzzv",
     "fuzzv/../fuzzv", "~root", "a" * 65, "CON", VOICE, "nobody"]))
speeds = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.text(max_size=5),
                   st.sampled_from([0, -1, 1e308, 0.49, 2.01, 1.0, "1.0", None, True]))
formats = st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "WAV", "", "exe", None, 3])


def _speech_bodies():
    base = {"model": st.one_of(st.just("tts-1"), weird_text), "input": st.one_of(st.just("Hi."), weird_text),
            "voice": st.one_of(st.just(VOICE), voice_ids), "response_format": formats, "speed": speeds,
            "stream": st.one_of(st.booleans(), json_scalar), "instructions": st.one_of(st.none(), weird_text),
            "seed": st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70)),
            "extra_field": json_scalar}
    return st.fixed_dictionaries({}, optional=base)


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN/Infinity literals are bad input too


# ------------------------------------------------------------------------------ synthesis
@EXAMPLES
@given(body=_speech_bodies())
def test_fuzz_openai_speech_json(app, body):
    check(app["client"].post("/v1/audio/speech", content=_dumps(body), headers={"content-type": "application/json"}))


@EXAMPLES
@given(body=st.fixed_dictionaries({}, optional={
    "text": st.one_of(st.just("Hi."), weird_text), "mode": st.one_of(
        st.sampled_from(["voice", "zero_shot", "cross_lingual", "instruct", "VOICE", ""]), json_scalar),
    "voice_id": st.one_of(st.just(VOICE), voice_ids), "prompt_text": weird_text, "instruct_text": weird_text,
    "response_format": formats, "speed": speeds, "stream": json_scalar, "seed": json_scalar}))
def test_fuzz_native_tts_json(app, body):
    check(app["client"].post("/v1/tts", content=_dumps(body), headers={"content-type": "application/json"}))


def _corrupt_audio():
    wav = synthetic_prompt_wav(1.0)
    return st.one_of(
        st.binary(max_size=2048),
        st.just(wav[:44]), st.just(wav[:100]), st.just(b"RIFF" + b"\xff" * 60),
        st.builds(lambda cut: wav[:cut], st.integers(0, len(wav))),
        st.builds(lambda pos, byte: wav[:pos] + bytes([byte]) + wav[pos + 1:], st.integers(0, 60), st.integers(0, 255)),
        st.just(wav),
    )


@EXAMPLES
@given(audio=_corrupt_audio(), text=st.one_of(st.just("Hi."), weird_text), prompt_text=weird_text,
       mode=st.sampled_from(["zero_shot", "cross_lingual", "instruct", "voice"]),
       ctype=st.sampled_from(["audio/wav", "application/octet-stream", "text/plain", ""]))
def test_fuzz_native_tts_multipart_audio(app, audio, text, prompt_text, mode, ctype):
    data = {"text": text, "mode": mode, "prompt_text": prompt_text}
    data = {k: v.replace("\x00", "") for k, v in data.items()}  # form fields cannot carry NUL on the client side
    check(app["client"].post("/v1/tts", data=data, files={"prompt_audio": ("p.wav", audio, ctype)}))


@EXAMPLES
@given(voice_id=voice_ids, prompt_text=weird_text, audio=_corrupt_audio(),
       filename=st.sampled_from(["a.wav", "../../../../tmp/evil.wav", "/etc/passwd", "a\\..\\b.wav", "", "x" * 300]),
       overwrite=st.sampled_from(["true", "false", "yes", "2", ""]))
def test_fuzz_register_voice(app, voice_id, prompt_text, audio, filename, overwrite):
    fields = {"voice_id": voice_id.replace("\x00", ""), "prompt_text": prompt_text.replace("\x00", ""),
              "overwrite": overwrite}
    if fields["voice_id"] == VOICE:
        fields["voice_id"] = "other"  # keep the fixture's voice intact
    check(app["client"].post("/v1/voices", data=fields, files={"audio": (filename, audio, "audio/wav")}))


@EXAMPLES
@given(voice_id=voice_ids, method=st.sampled_from(["GET", "DELETE"]), encode=st.booleans())
def test_fuzz_voice_paths(app, voice_id, method, encode):
    if method == "DELETE" and voice_id == VOICE:
        voice_id = "nobody"
    path = quote(voice_id, safe="" if encode else "/") if voice_id else ""
    r = app["client"].request(method, f"/v1/voices/{path}")
    # A trailing slash is served as the route without it (".../voices/" lists); never a redirect.
    check(r)
    if r.status_code == 200 and "voice_id" in r.json():  # "." and "" normalise to the list route
        assert r.json()["voice_id"] in (voice_id, VOICE)


# ------------------------------------------------------------------------------ hand-picked
_HUGE = 12 * 1024 * 1024


@pytest.mark.parametrize("path, kwargs, status", [
    ("/v1/audio/speech", {"content": b"\xff\xfe\xfd not utf-8", "headers": {"content-type": "application/json"}}, 400),
    ("/v1/audio/speech", {"content": b'{"model":"tts-1","input":"\xff\xfe","voice":"fuzzv"}',
                          "headers": {"content-type": "application/json"}}, 400),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "a" * (1 << 20), "voice": VOICE}}, 413),
    ("/v1/audio/speech", {"content": b"{" * 100_000, "headers": {"content-type": "application/json"}}, 400),
    ("/v1/audio/speech", {"content": b"[" * 50_000 + b"]" * 50_000, "headers": {"content-type": "application/json"}},
     400),
    ("/v1/audio/speech", {"content": b"model=m&input=hi", "headers": {"content-type": "application/x-www-form-urlencoded"}},
     400),
    ("/v1/audio/speech", {"content": b"\x00" * 1000, "headers": {"content-type": "application/octet-stream"}}, 400),
    ("/v1/audio/speech", {"json": [1, 2, 3]}, 400),
    ("/v1/audio/speech", {"json": "just a string"}, 400),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "hi", "voice": VOICE, "speed": 1e308}}, 400),
    ("/v1/tts", {"content": b"--xx\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=xx"}}, 400),
    ("/v1/tts", {"content": b"data", "headers": {"content-type": "multipart/form-data"}}, 400),  # no boundary
    ("/v1/tts", {"json": {"text": "a" * (1 << 20), "voice_id": VOICE}}, 413),
    ("/v1/voices", {"content": b"x" * 100, "headers": {"content-type": "text/plain"}}, 415),
    ("/v1/voices", {"data": {"voice_id": "big", "prompt_text": "t"},
                    "files": {"audio": ("a.wav", b"\x00" * _HUGE, "audio/wav")}}, 413),
    ("/v1/tts", {"data": {"text": "x", "mode": "zero_shot", "prompt_text": "t"},
                 "files": {"prompt_audio": ("a.wav", b"\x00" * _HUGE, "audio/wav")}}, 413),
    ("/v1/audio/speech", {"content": b" " * _HUGE, "headers": {"content-type": "application/json"}}, 413),
])
def test_bad_bodies(app, path, kwargs, status):
    r = app["client"].post(path, **kwargs)
    check(r)
    assert r.status_code == status, r.text[:300]


def _raw_exchange(url: str, head: bytes, send_bytes: int, wait_s: float) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=wait_s) as s:
        s.sendall(head + b"\r\n" + b" " * send_bytes)
        s.settimeout(wait_s)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            pass
        return data


@pytest.mark.parametrize("path, ctype", [("/v1/audio/speech", "application/json"), ("/v1/tts", "application/json"),
                                         ("/v1/voices", "multipart/form-data; boundary=b"),
                                         ("/v1/tts", "multipart/form-data; boundary=b")])
def test_size_limit_is_enforced_before_reading_the_body(app, path, ctype):
    """Declare 1 GB, send 1 KB: the 413 comes without the rest (a server that waited for the body
    would never answer: the exchange ends at its guard with nothing)."""
    TRIED["count"] += 1
    host = urlsplit(app["url"]).netloc.encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host.decode()}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {1 << 30}\r\n").encode()
    data = _raw_exchange(app["url"], head, 1024, wait_s=120)  # a failure guard, not a bound on the answer
    assert data.startswith(b"HTTP/1.1 413"), data[:200]


# ------------------------------------------------------------------------------ voice store
@settings(max_examples=300, deadline=None)
@given(voice_id=st.one_of(st.text(max_size=40), voice_ids))
def test_voice_store_ids_never_escape_the_root(tmp_path_factory, voice_id):
    """Any id either is refused or names a file directly inside the store's directory."""
    root = tmp_path_factory.getbasetemp() / "voice-root"
    reg = VoiceRegistry(root)
    try:
        check_voice_id(voice_id)
    except InvalidVoiceIdError:
        with pytest.raises(InvalidVoiceIdError):
            reg.exists(voice_id)
        return
    path = reg._record_path(voice_id)
    assert path.resolve().parent == root.resolve()
    assert "/" not in voice_id and "\\" not in voice_id and "\x00" not in voice_id and ".." not in voice_id


# ------------------------------------------------------------------------------ prompt uploads
@pytest.fixture(scope="module")
def upload_cases():
    from bench.fuzz_uploads import cases

    return cases(quick=True)


@pytest.mark.parametrize("route", ["/v1/voices", "/v1/tts"])
def test_upload_campaign_quick(app, upload_cases, route):
    """Odd rates, channel counts, lengths, formats, truncated/corrupt files and compression bombs
    (bench/fuzz_uploads.py, quick set): each a documented answer, never a 500. Bombs are 413 from
    their header and well-formed prompts succeed; the rest depends on the (fake) frontend runtime."""
    seen = set()
    for case in upload_cases:
        if route == "/v1/voices":
            r = app["client"].post(route, data={"voice_id": "fuzzup", "prompt_text": "fuzz", "overwrite": "true"},
                                   files={"audio": ("u.bin", case.data, "application/octet-stream")})
        else:
            r = app["client"].post(route, data={"text": "Hi.", "mode": "zero_shot", "prompt_text": "fuzz",
                                                "response_format": "pcm"},
                                   files={"prompt_audio": ("u.bin", case.data, "application/octet-stream")})
        check(r)
        ok = 201 if route == "/v1/voices" else 200
        if case.expect == {413}:
            assert r.status_code == 413, (case.name, r.text[:200])
        elif case.expect == {201}:
            assert r.status_code == ok, (case.name, r.text[:200])
        seen.add(case.kind)
    assert seen == {"rate", "channels", "length", "format", "truncated", "corrupt", "bomb"}


def test_fuzz_figures(app):
    """Runs last in this module: how many bad inputs were tried (reported in bench/results)."""
    assert TRIED["count"] >= 5 * 50
    print(f"\nfuzz: {TRIED['count']} requests, all documented answers")
