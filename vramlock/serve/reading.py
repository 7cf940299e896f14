"""A request's body as serve reads it: held whole (bounded) to find its model, or
passed on as it comes (counted against the same bound)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from aiohttp import web

from . import body as bodies
from .errors import error_response

# A request body larger than this is refused (413): a JSON body is held whole, to find
# its model, and several large ones at once must not exhaust memory. Other bodies are
# passed on as they come, and cut (413) once this much has passed.
MAX_BODY = 64 << 20
# A multipart form's model field must be within its first this many bytes.
FORM_PREFIX = 1 << 20
_STREAM_CHUNK = 256 * 1024
# A JSON body up to this size is parsed whole to find its model (faster than skipping
# over its members, and a copy of it costs nothing); a larger one is scanned.
_PARSED = 64 * 1024


def named(body: bytes | bytearray) -> str | None:
    """The model a JSON body names; None when it names none."""
    try:
        if len(body) <= _PARSED:
            doc = json.loads(body)
            name = doc.get("model") if isinstance(doc, dict) else None
        else:
            name = bodies.json_model(body)
    except (ValueError, RecursionError):  # RecursionError: nested deep
        name = None
    return name if isinstance(name, str) else None


class TooLarge(Exception):
    """A body went over ``MAX_BODY`` as it was read."""


def too_large() -> web.Response:
    return error_response(413, f"the request body is over {MAX_BODY >> 20} MiB")


async def held(request: web.Request) -> bytearray | web.Response:
    """The request's body, held once, or a 413 when it is over ``MAX_BODY`` (said
    before any of it is read where Content-Length tells)."""
    if (request.content_length or 0) > MAX_BODY:
        return too_large()
    try:
        return await _read(request, MAX_BODY)
    except TooLarge:
        return too_large()


async def _read(request: web.Request, limit: int) -> bytearray:
    """The body; TooLarge past ``limit`` bytes."""
    held = bytearray()
    async for chunk in request.content.iter_any():
        held += chunk
        if len(held) > limit:
            raise TooLarge
    return held


async def read_some(request: web.Request, into: bytearray) -> None:
    """What of the body has come (some of it, or the end), appended to ``into``."""
    into += await request.content.readany()


async def counted(request: web.Request, first: bytes = b"") -> AsyncIterator[bytes]:
    """The body as it comes (after ``first``, read already); TooLarge once more than
    ``MAX_BODY`` bytes have passed."""
    passed = len(first)
    if first:
        yield first
    async for chunk in request.content.iter_chunked(_STREAM_CHUNK):
        passed += len(chunk)
        if passed > MAX_BODY:
            raise TooLarge
        yield chunk
