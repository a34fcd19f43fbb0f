"""The browser playground: a page served by the ingress (``GET /playground``, also ``GET /``).

Plain HTML/JS/CSS shipped in ``serve_app/static/`` (package data; no build step, no CDN). The
page calls the public API with the key typed into it (kept in the tab's sessionStorage, sent as
``Authorization: Bearer``; the WebSocket carries it as the ``api_key`` query parameter), so the
page, its two static files and ``/playground/info`` are open: they hold no secret and start no
work (the info comes from the ingress's cached health status). ``/playground/info`` tells the page whether the synthesizer
serves the tiny random-weight model (noise, not speech). docs/serving.md#playground.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
PAGE = "playground.html"
ASSETS = {"playground.js": "text/javascript; charset=utf-8", "playground.css": "text/css; charset=utf-8"}
PAGE_PATHS = ("/", "/playground")
INFO_PATH = "/playground/info"
# Paths the auth middleware leaves open (serve_app/auth.py): nothing secret, no synthesis.
OPEN_PATHS = frozenset({*PAGE_PATHS, INFO_PATH, *(f"/static/{name}" for name in ASSETS)})
# Same-origin only; `ws:`/`wss:` for the text-in WebSocket, `blob:` for finished non-PCM audio.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; media-src 'self' blob:; "
       "connect-src 'self' ws: wss:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class PlaygroundInfo:
    """``GET /playground/info``: what the page states about the served model.

    Read from the ingress's health status (a synthesizer replica's health detail names
    ``random_weights`` and the family; serve_app/health.py keeps the last one): an open endpoint
    never turns into handle calls, however often it is asked. Unknown (null) until a probe landed.
    """

    def __init__(self, latest: Callable[[], dict | None]) -> None:
        self.latest = latest

    async def endpoint(self, request: Request) -> Response:
        detail = self.latest() or {}
        return JSONResponse({"random_weights": detail.get("random_weights"), "family": detail.get("family")},
                            headers=_HEADERS)


def _files() -> dict[str, tuple[bytes, str]]:
    out = {name: ((STATIC_DIR / name).read_bytes(), media) for name, media in ASSETS.items()}
    out[PAGE] = ((STATIC_DIR / PAGE).read_bytes(), "text/html; charset=utf-8")
    return out


def routes(runtime_detail: Callable[[], dict | None]) -> list[Route]:
    """The playground's routes; the files are read once, when the ingress replica builds its app.

    ``runtime_detail``: what a synthesizer replica last said it loaded (``HealthMonitor.runtime_detail``)."""
    files = _files()

    def serve(name: str):
        data, media = files[name]

        async def endpoint(request: Request) -> Response:
            return Response(data, media_type=media, headers=_HEADERS)

        return endpoint

    page = serve(PAGE)
    return [*(Route(path, page, methods=["GET"]) for path in PAGE_PATHS),
            Route(INFO_PATH, PlaygroundInfo(runtime_detail).endpoint, methods=["GET"]),
            *(Route(f"/static/{name}", serve(name), methods=["GET"]) for name in ASSETS)]
