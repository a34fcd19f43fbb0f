"""Ingress limits over real HTTP through Serve's proxy (real local Ray, fake runtimes).

* a chunked multipart upload without ``Content-Length`` gets the JSON 413 as soon as it passes
  ``max_upload_bytes``, while the client is still sending (the body is not read to its end);
* trailing-slash variants answer like the plain routes, never with a redirect;
* the ingress's own admission limit answers overload with the JSON 429 + ``Retry-After``;
* what is left of Serve's plain-text 429: only when the ingress replica's *Serve* slots (set
  above the app's limits) are all taken, here by handle calls that bypass the HTTP admission.
"""
from __future__ import annotations

import select
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.conftest import TEST_ARGS

pytestmark = pytest.mark.ray

APP, PREFIX = "limits", "/limits"
RETRY_AFTER = 5
VOICE = "limv"
LONG = "l" * 1500  # ~6 s of fake decoding per stream, longer when several share the engine


@pytest.fixture(scope="module")
def limits_app(ray_session):
    from ray import serve

    from bench.load import synthetic_prompt_wav
    from serve_app.app import build_app
    from serve_app.args import AppArgs

    args = {**TEST_ARGS,
            "ingress": {**TEST_ARGS["ingress"], "max_ongoing_requests": 2, "max_queued_requests": 2,
                        "retry_after_s": RETRY_AFTER},
            "synthesizer": {**TEST_ARGS["synthesizer"], "max_queued_requests": 16}}
    serve.run(build_app(AppArgs.model_validate(args)), name=APP, route_prefix=PREFIX)
    url = ray_session["base_url"] + PREFIX
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": VOICE, "prompt_text": "limits", "overwrite": "true"},
                   files={"audio": ("v.wav", synthetic_prompt_wav(2.0), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
    yield {"url": url, "handle": serve.get_app_handle(APP)}
    serve.delete(APP)


def _speech(text: str, stream: bool = True) -> dict:
    return {"model": "tts-1", "input": text, "voice": VOICE, "response_format": "pcm", "stream": stream}


# ------------------------------------------------------------------------------ 413, chunked
def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_chunked_upload_gets_413_before_the_body_is_read(tts_app):
    """POST /v1/voices, Transfer-Encoding: chunked, no Content-Length, an endless file part sent at
    ~16 MB/s: the JSON 413 arrives while we are still sending, after about ``max_upload_bytes``
    (10 MiB). Before the fix the ingress read the whole body first, so an endless one got no answer.

    NOTE: paced on purpose. Ray 2.60's proxy drains the client's body into an unbounded queue of its
    own, whatever the replica reads, until the response is sent; an unpaced loopback client pushed
    58 MB before the 413 reached it (docs/serving.md, *Request size limits*)."""
    limit = 10 * 1024 * 1024
    pace_s = 0.004  # per 64 KiB block
    parts = urlsplit(tts_app["base_url"])
    head = (f"POST /v1/voices HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    first = (b'--b\r\nContent-Disposition: form-data; name="voice_id"\r\n\r\nbig\r\n'
             b'--b\r\nContent-Disposition: form-data; name="prompt_text"\r\n\r\nt\r\n'
             b'--b\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
             b"Content-Type: audio/wav\r\n\r\n")
    block = _chunk(b"\0" * 64 * 1024)
    sent, reply = 0, b""
    started = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(head + _chunk(first))
        try:
            while sent < 8 * limit and time.monotonic() - started < 60:
                readable, writable, _ = select.select([s], [s], [], 1.0)
                if readable:
                    break
                if writable:
                    sent += s.send(block)
                    time.sleep(pace_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were sending
        s.settimeout(10)
        try:
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                data = s.recv(65536)
                if not data:
                    break
                reply += data
        except (TimeoutError, ConnectionResetError):
            pass
    assert reply.startswith(b"HTTP/1.1 413"), (sent, reply[:300])
    assert b'"payload_too_large"' in reply and b'"request_id"' in reply, reply[:500]
    # Answered near the limit (socket buffers and the proxy's queue hold a few MiB more), while an
    # endless body was still being sent.
    assert sent < 2 * limit, sent
    print(f"\n413 after {sent / 2**20:.1f} MiB sent (limit {limit / 2**20:.0f} MiB)")


# ------------------------------------------------------------------------------ trailing slash
def test_trailing_slash_variants_are_not_redirected(tts_app):
    url = tts_app["base_url"]
    with httpx.Client(base_url=url, timeout=30, follow_redirects=False) as c:
        plain, slashed = c.get("/v1/voices"), c.get("/v1/voices/")
        assert slashed.status_code == plain.status_code == 200 and slashed.json() == plain.json()
        assert c.get("/health/").status_code == 200
        for path in ("/v1/voices/", "/v1/voices//", "/health/", "/metrics/", "/v1/voices/%2F", "/v1/voices/nobody/"):
            r = c.get(path)
            assert not 300 <= r.status_code < 400, (path, r.status_code, r.headers)
            if r.status_code >= 400:
                assert set(r.json()) == {"error", "request_id"}, (path, r.text)
        r = c.post("/v1/audio/speech/", json={**_speech("Slash.", stream=False), "voice": "nobody"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"


# ------------------------------------------------------------------------------ 429
class _Stream(threading.Thread):
    def __init__(self, url: str, text: str) -> None:
        super().__init__(daemon=True)
        self.url, self.text = url, text
        self.first = threading.Event()
        self.status: int | None = None
        self.nbytes = 0

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/audio/speech", json=_speech(self.text), timeout=120) as r:
                self.status = r.status_code
                for part in r.iter_raw():
                    self.nbytes += len(part)
                    self.first.set()
        finally:
            self.first.set()


def test_ingress_admission_limit_answers_json_429(limits_app):
    """2 in progress + 2 waiting per ingress replica; the next ones get the JSON 429 at once."""
    url = limits_app["url"]
    held = [_Stream(url, LONG) for _ in range(4)]
    for s in held[:2]:
        s.start()
        assert s.first.wait(30) and s.status == 200
    for s in held[2:]:
        s.start()
    time.sleep(1.0)  # the last two wait for a turn in the ingress
    assert not any(s.nbytes for s in held[2:])
    with httpx.Client(base_url=url, timeout=30) as c:
        for _ in range(4):
            started = time.monotonic()
            r = c.post("/v1/audio/speech", json=_speech("Too many.", stream=False))
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == str(RETRY_AFTER)
            assert r.headers["content-type"].startswith("application/json")
            body = r.json()
            assert body["error"]["code"] == "queue_full" and body["request_id"] == r.headers["x-request-id"]
            assert time.monotonic() - started < 5  # answered at once, not after waiting
        assert c.get("/health").status_code == 200  # probes are never held back
    for s in held:
        s.join(120)
        assert s.status == 200 and s.nbytes > 0
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/v1/audio/speech", json=_speech("Recovered.", stream=False)).status_code == 200


def test_serve_plain_text_429_when_the_ingress_serve_slots_are_full(limits_app):
    """Documents Serve's residual answer (docs/serving.md): Serve's limits of the ingress are
    2 x (2 + 2) = 8 requests in the replica and 2 queued in the proxy. Handle calls to the ingress
    (the Python API, which the HTTP admission does not see) take all 8 slots; then HTTP requests
    queue in the proxy, and the ones past its queue get Serve's own 429: plain text, with the
    ingress's Retry-After, not our JSON shape."""
    from deployments.protocol import SynthesisRequest

    handle = limits_app["handle"].options(stream=True)
    gens = []
    try:
        for i in range(8):  # one at a time: this driver's own handle queue also holds only 2
            gens.append(handle.stream.remote(SynthesisRequest(request_id=f"h{i}", text=LONG, voice_id=VOICE,
                                                              stream=True)))
            time.sleep(0.3)
        time.sleep(1.0)  # routed: every Serve slot of the ingress replica is taken

        def post(out: list, i: int) -> None:
            out[i] = httpx.post(f"{limits_app['url']}/v1/audio/speech", json=_speech("Queued.", stream=False),
                                timeout=120)

        out: list = [None] * 8
        threads = [threading.Thread(target=post, args=(out, i), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # a loaded 2-core runner routes slowly: wait for the first answer
        while time.monotonic() < deadline and not any(r is not None for r in out):
            time.sleep(0.2)
        time.sleep(0.5)  # the other requests past the proxy queue are rejected in the same breath
        rejected = [r for r in out if r is not None and r.status_code == 429]
        # Serve counts its queue loosely (router.py: requests being routed are not "queued"); here up to
        # 5 waited with max_queued_requests=2, so only "some" is certain.
        assert rejected, [r and (r.status_code, r.text[:80]) for r in out]
        for r in rejected:
            assert r.headers["retry-after"] == str(RETRY_AFTER)
            assert r.headers["content-type"].startswith("text/plain"), r.headers
            assert r.text.startswith("Request dropped due to backpressure"), r.text
    finally:
        for g in gens:
            try:
                g.cancel()
            except Exception:  # noqa: BLE001 - a call that failed re-raises its error on cancel
                pass
    for t in threads:
        t.join(120)
    # The queued ones go on once the slots free up: served, or (past the app's own limit) the JSON 429.
    assert all(r is not None for r in out)
    for r in out:
        if r.status_code == 429 and r not in rejected:
            assert r.json()["error"]["code"] == "queue_full"
        else:
            assert r.status_code in (200, 429), (r.status_code, r.text[:200])
    print(f"\nServe plain-text 429: {len(rejected)} of 8; then {sum(r.status_code == 200 for r in out)} served")
