"""Request bodies read with their limits: nothing past ``limit`` bytes is read, a malformed body is
a 400 in the one error shape, and a large JSON body is parsed off the event loop."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartParser
from starlette.requests import Request

from deployments.protocol import PayloadTooLargeError
from serve_app.errors import ApiError

JSON_INLINE_BYTES = 64 * 1024  # JSON bodies above this are parsed in a worker thread (10 MiB: ~1 s)
MAX_FORM_FIELDS = 32


async def body_chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body as it arrives, refused with a 413 past ``limit`` bytes: at once from a
    declared ``Content-Length``, or as soon as a chunked body passes it (nothing past the limit is
    read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"body is {declared} bytes; the limit is {limit}")
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"body exceeds {limit} bytes")
        yield chunk


async def read_json(request: Request, limit: int) -> Any:
    """The JSON body, size-limited as :func:`body_chunks`."""
    data = b"".join([chunk async for chunk in body_chunks(request, limit)])
    try:
        return json.loads(data) if len(data) <= JSON_INLINE_BYTES else await asyncio.to_thread(json.loads, data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: absurdly nested arrays
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None


async def read_form(request: Request, limit: int, file_fields: tuple[str, ...]) -> tuple[dict, dict[str, bytes]]:
    """A multipart body's fields and files (only ``file_fields`` may be files), size-limited as
    :func:`body_chunks`."""
    parser = MultiPartParser(request.headers, body_chunks(request, limit), max_files=len(file_fields),
                             max_fields=MAX_FORM_FIELDS)
    try:
        form = await parser.parse()
    except PayloadTooLargeError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed multipart
        raise ApiError(400, f"malformed multipart body: {exc}", code="invalid_input") from None
    try:
        fields: dict[str, Any] = {}
        files: dict[str, bytes] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key not in file_fields:
                    raise ApiError(400, f"unexpected file field '{key}'", code="invalid_input")
                files[key] = await value.read()
            else:
                fields[key] = value
        return fields, files
    finally:
        await form.close()  # spooled temporary files
