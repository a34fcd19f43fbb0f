"""Helpers around DeploymentHandle calls shared by the HTTP and WebSocket routes."""
from __future__ import annotations

import logging

from ray.serve.exceptions import BackPressureError

from deployments.protocol import OverloadedError

logger = logging.getLogger(__name__)


async def admitted(awaitable):
    """Await a handle call, turning Serve's backpressure rejection into our OverloadedError.

    NOTE: Serve installs its own plain-text handler for ``BackPressureError`` on the ingress app
    after ``__serve_build_asgi_app__`` returns, overriding ours; converting here keeps the one
    JSON error shape (and the rejecting deployment's Retry-After).
    """
    try:
        return await awaitable
    except BackPressureError as exc:
        raise OverloadedError(f"server is at capacity; retry after {exc.retry_after_s or 1} s",
                              retry_after_s=int(exc.retry_after_s or 1)) from None


def cancel_stream(gen) -> None:
    """Cancel a streaming handle call. NOTE: ``cancel()`` on a call that Serve rejected re-raises the
    rejection (BackPressureError), which would replace our JSON 429 with Serve's plain-text one."""
    try:
        gen.cancel()
    except Exception as exc:  # noqa: BLE001 - the call already failed; its error was answered
        logger.debug("cancel of a failed stream raised %s", type(exc).__name__)
