"""The ingress's ASGI middleware and body limits in process (no Ray): trailing slashes, the app's
own admission limit (JSON 429), and 413 for a chunked upload before the rest of it is read.
The same behaviour over real HTTP through Serve's proxy is in tests/integration/test_ingress_limits.py."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve_app.ingress import SERVE_HEADROOM, IngressConfig, TTSIngress
from serve_app.metrics import IngressMetrics
from serve_app.middleware import AdmissionControl, RequestAccounting, TrailingSlash
from tests.serve_app.test_ingress_inproc import _app, _wav


def _run(coro):
    return asyncio.run(coro)


def test_trailing_slash_variants_answer_like_the_plain_routes():
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://t") as c:
            r = await c.post("/v1/voices/", data={"voice_id": "v1", "prompt_text": "hi"},
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201, r.text
            plain, slashed = await c.get("/v1/voices"), await c.get("/v1/voices/")
            assert slashed.status_code == plain.status_code == 200 and slashed.json() == plain.json()
            assert (await c.get("/v1/voices/v1/")).json()["voice_id"] == "v1"
            assert (await c.get("/health/")).status_code == 200
            # An encoded slash is part of the path, not a trailing slash: the JSON 404, never a redirect.
            r = await c.get("/v1/voices/%2F")
            assert r.status_code == 404 and set(r.json()) == {"error", "request_id"}
            r = await c.delete("/v1/voices/")
            assert r.status_code == 405 and set(r.json()) == {"error", "request_id"}
            for path in ("/v1/voices/", "/v1/voices//", "/v1/audio/speech/", "/metrics/", "/nope/"):
                r = await c.request("GET", path)
                assert r.status_code < 300 or r.status_code >= 400, (path, r.status_code)

    _run(main())


def test_trailing_slash_keeps_the_mount_point():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["path"], scope.get("raw_path")))
        await JSONResponse({})(scope, receive, send)

    async def main():
        mw = TrailingSlash(app)
        for path, raw in (("/p/", b"/p/"), ("/p/v1/voices/", b"/p/v1/voices/"), ("/p/v1/voices//", b"/p/v1/voices/%2F")):
            await mw({"type": "http", "path": path, "raw_path": raw, "root_path": "/p", "headers": [],
                      "method": "GET"}, None, _sink)

    async def _sink(message):
        pass

    _run(main())
    assert seen == [("/p/", b"/p/"), ("/p/v1/voices", b"/p/v1/voices"), ("/p/v1/voices//", b"/p/v1/voices/%2F")]


def _gated_app(max_running: int, max_waiting: int, gate: asyncio.Event):
    async def slow(request):
        await gate.wait()
        return JSONResponse({"ok": True})

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/tts", slow, methods=["POST"]), Route("/health", health)], middleware=[
        Middleware(TrailingSlash), Middleware(RequestAccounting, metrics=IngressMetrics()),
        Middleware(AdmissionControl, max_running=max_running, max_waiting=max_waiting, retry_after_s=7)])


def _admission(app: Starlette) -> AdmissionControl | None:
    """The app's AdmissionControl instance (Starlette builds its middleware stack at the first request)."""
    node = app.middleware_stack
    while node is not None and not isinstance(node, AdmissionControl):
        node = getattr(node, "app", None)
    return node


def test_admission_limit_answers_json_429_and_keeps_probes_open():
    async def main():
        gate = asyncio.Event()
        app = _gated_app(2, 3, gate)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            held = [asyncio.create_task(c.post("/v1/tts")) for _ in range(5)]  # 2 running + 3 waiting
            for _ in range(10_000):  # event-loop turns until the five are inside, not a time
                admission = _admission(app)
                if admission is not None and (admission.running, admission.waiting) == (2, 3):
                    break
                await asyncio.sleep(0)
            assert (admission.running, admission.waiting) == (2, 3)
            extra = await asyncio.gather(*(c.post("/v1/tts") for _ in range(4)))
            assert [r.status_code for r in extra] == [429] * 4
            for r in extra:
                body = r.json()
                assert r.headers["retry-after"] == "7" and body["error"]["code"] == "queue_full"
                assert body["error"]["type"] == "overloaded_error" and body["request_id"]
            assert (await c.get("/health")).status_code == 200  # never held back
            gate.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 5
            assert (await c.post("/v1/tts")).status_code == 200  # turns were all given back

    _run(main())


def test_serve_limits_of_the_ingress_sit_above_the_app_limits():
    cfg = IngressConfig(max_ongoing_requests=4, max_queued_requests=6, retry_after_s=2)
    opts = TTSIngress.deployment_options(cfg)
    assert opts["max_ongoing_requests"] == SERVE_HEADROOM * (4 + 6) > 4 + 6
    assert opts["max_queued_requests"] == 6


def test_chunked_upload_past_the_limit_is_refused_before_the_rest_is_read():
    limit = 256 * 1024
    sent = {"bytes": 0}

    async def endless():  # no Content-Length: httpx sends it chunked
        head = (b'--b\r\nContent-Disposition: form-data; name="voice_id"\r\n\r\nv\r\n'
                b'--b\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
                b"Content-Type: audio/wav\r\n\r\n")
        sent["bytes"] += len(head)
        yield head
        for _ in range(10_000):
            sent["bytes"] += 16 * 1024
            yield b"\0" * 16 * 1024

    async def main():
        app = _app(IngressConfig(max_upload_bytes=limit))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/voices", content=endless(),
                                headers={"content-type": "multipart/form-data; boundary=b"})

    r = _run(main())
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
    assert sent["bytes"] <= limit + 64 * 1024, sent  # stopped at the limit, not after 160 MB


def _accounted(app) -> tuple[RequestAccounting, IngressMetrics]:
    metrics = IngressMetrics()
    return RequestAccounting(app, metrics=metrics), metrics


def _count(metrics: IngressMetrics, status: str) -> float:
    return metrics.registry.get_sample_value("tts_http_requests_total",
                                             {"route": "/v1/audio/speech", "status": status}) or 0.0


async def _streamed(send, then: BaseException | None) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"audio", "more_body": True})
    if then is not None:
        raise then
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.mark.parametrize("then, status", [(None, "200"), (RuntimeError("replica died mid-stream"), "500"),
                                          (asyncio.CancelledError(), "499")])
def test_a_stream_that_breaks_after_its_headers_does_not_count_as_200(then, status):
    """Complete: 200. A server fault after the headers: 500 (and a server error). The client gone
    first: 499. Before, both broken streams counted as the 200 their headers said."""
    async def app(scope, receive, send):
        await _streamed(send, then)

    async def sink(message):
        pass

    mw, metrics = _accounted(app)
    scope = {"type": "http", "path": "/v1/audio/speech", "root_path": "", "headers": [], "method": "POST"}

    async def main():
        if then is None:
            await mw(scope, None, sink)
        else:
            with pytest.raises(type(then)):
                await mw(scope, None, sink)

    _run(main())
    assert _count(metrics, status) == 1.0 and sum(_count(metrics, s) for s in ("200", "499", "500")) == 1.0
    server_errors = metrics.registry.get_sample_value("tts_http_errors_total",
                                                      {"route": "/v1/audio/speech", "type": "server"}) or 0.0
    assert server_errors == (1.0 if status == "500" else 0.0)
