"""The browser playground: a page served by the ingress (``GET /playground``, also ``GET /``).

Plain HTML/JS/CSS shipped in ``serve_app/static/`` (package data; no build step, no CDN). The
page calls the public API with the key typed into it (kept in the tab's sessionStorage, sent as
``Authorization: Bearer``; the WebSocket carries it as the ``api_key`` query parameter), so the
page, its two static files and ``/playground/info`` are open: they hold no secret and start no
work beyond one cached health call. ``/playground/info`` tells the page whether the synthesizer
serves the tiny random-weight model (noise, not speech). docs/serving.md#playground.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

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

    Asks one synthesizer replica once (its health detail names ``random_weights`` and the
    family) and keeps the first answer for the life of the ingress replica: every synthesizer of
    an app loads the same model, and an open endpoint must not turn into a stream of handle calls.
    """

    def __init__(self, synth: Any, timeout_s: float) -> None:
        self.synth, self.timeout_s = synth, timeout_s
        self._known: dict | None = None

    async def endpoint(self, request: Request) -> Response:
        if self._known is None:
            try:
                res = await asyncio.wait_for(self.synth.health.remote(), self.timeout_s)
            except Exception:  # noqa: BLE001 - any failure: the page says "unknown", asked again on the next load
                logger.warning("playground info: no synthesizer health answer")
                return JSONResponse({"random_weights": None, "family": None}, headers=_HEADERS)
            detail = res.detail or {}
            self._known = {"random_weights": detail.get("random_weights"), "family": detail.get("family")}
        return JSONResponse(self._known, headers=_HEADERS)


def _files() -> dict[str, tuple[bytes, str]]:
    out = {name: ((STATIC_DIR / name).read_bytes(), media) for name, media in ASSETS.items()}
    out[PAGE] = ((STATIC_DIR / PAGE).read_bytes(), "text/html; charset=utf-8")
    return out


def routes(synth: Any, timeout_s: float) -> list[Route]:
    """The playground's routes; the files are read once, when the ingress replica builds its app."""
    files = _files()

    def serve(name: str):
        data, media = files[name]

        async def endpoint(request: Request) -> Response:
            return Response(data, media_type=media, headers=_HEADERS)

        return endpoint

    page = serve(PAGE)
    return [*(Route(path, page, methods=["GET"]) for path in PAGE_PATHS),
            Route(INFO_PATH, PlaygroundInfo(synth, timeout_s).endpoint, methods=["GET"]),
            *(Route(f"/static/{name}", serve(name), methods=["GET"]) for name in ASSETS)]
