"""serve's connections: the common request taken here, anything else given to aiohttp.

aiohttp's server costs about 0.12 ms a request on a 2-core machine, more than half of
what the router may add. The request that almost every client sends, a small JSON POST
naming its model on a kept-alive HTTP/1.1 connection, is parsed here from the bytes,
routed as the router routes it, and its answer relayed by its framing. A connection's
first request that is anything else (another method or route, a large, chunked or
multipart body, ``Expect``, ``Upgrade``, ``Connection: close``, or an application with
middlewares of its own) hands the connection, with what it has sent, to aiohttp for
good. The API keys are checked here as aiohttp's middleware checks them (``doors``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from .body import boundary
from .doors import CHALLENGE, REFUSED
from .errors import BUSY, RETRY_AFTER, error_doc, wants_text
from .inflight import uncancel
from .upstream import Response

if TYPE_CHECKING:
    from .doors import Keys
    from .inflight import Flight, Flights
    from .members import Wrapper

HEAD_MAX = 16 * 1024
# Larger bodies go to aiohttp, which holds them once as they come.
BODY_MAX = 1 << 20
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "host", "content-length"}
)  # fmt: skip
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            413: "Payload Too Large", 429: "Too Many Requests", 502: "Bad Gateway"}  # fmt: skip


class Underway(Protocol):
    """A request started from the data callback, with no task (the router's Express)."""

    def cancel(self) -> None: ...

    def waiter(self) -> asyncio.Future[None]: ...


class Taker(Protocol):
    """What takes the requests parsed here (the router)."""

    fronts: set[Front]
    keys: Keys
    flights: Flights

    def fast_path(self, path: str) -> bool: ...

    def express(self, front: Front, head: Head, body: bytes) -> Any: ...

    def fast(
        self, front: Front, head: Head, body: bytes, chosen: Any = None
    ) -> Coroutine[Any, Any, None]: ...


class Head:
    """A request head that this module takes: its target, headers and body length."""

    __slots__ = ("headers", "length", "target")

    def __init__(self, target: str, headers: list[tuple[str, str]], length: int) -> None:
        self.target = target
        self.headers = headers
        self.length = length


def parse_head(head: bytes, taken: Callable[[str], bool]) -> Head | None:
    """The head (without its blank line) of a request this module takes; None for any
    other, which aiohttp answers. ``taken(path)``: is the path the router's by-model
    route for a POST?"""
    lfs = head.count(b"\n")
    if b"\0" in head or head.count(b"\r\n") != lfs or head.count(b"\r") != lfs:
        return None  # a bare CR or LF, or a NUL: aiohttp refuses it, nothing is passed on
    line, *lines = head.decode("latin-1").split("\r\n")
    method, _, rest = line.partition(" ")
    target, _, version = rest.partition(" ")
    if method != "POST" or version != "HTTP/1.1" or not target.startswith("/"):
        return None
    if not taken(target.partition("?")[0]):
        return None
    headers, length = [], None
    for field in lines:
        name, colon, value = field.partition(":")
        if not colon or not name or name != name.strip() or name[0] in " \t":
            return None
        lower, value = name.lower(), value.strip()
        if lower in ("transfer-encoding", "expect", "upgrade"):
            return None
        if lower == "connection" and "close" in value.lower():
            return None
        if lower == "content-type" and boundary(value) is not None:
            return None
        if lower == "accept" and wants_text(value):
            return None  # its errors as text: the router's middleware says them so
        if lower == "content-length":
            if length is not None or not (value.isascii() and value.isdigit()):
                return None
            length = int(value)
        headers.append((name, value))
    if length is None or length > BODY_MAX:
        return None
    return Head(target, headers, length)


class Front(asyncio.Protocol):
    """One client's connection to serve, while its requests are the common kind."""

    def __init__(self, router: Taker, handoff: Callable[[], asyncio.Protocol]) -> None:
        self.router = router
        self.handoff = handoff
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.express: Underway | None = None  # a request under way with no task
        self.flight: Flight | None = None  # the request in progress, whose answer is kept
        self.peer: Any = None  # the client's address
        self._writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        self.router.fronts.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.router.fronts.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client went away: so does its request
        if self.express is not None:
            self.express.cancel()
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the client went away"))

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    async def drain(self) -> None:
        if self._writable is not None:
            await self._writable

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None and self.express is None:
            self._next()
        elif len(self.buffer) > HEAD_MAX + BODY_MAX and self.transport is not None:
            self.transport.pause_reading()  # a client that sends on without reading

    def _next(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > HEAD_MAX:
                self._hand_off()
            return
        head = parse_head(bytes(self.buffer[:end]), self.router.fast_path)
        if head is None:
            self._hand_off()
            return
        whole = end + 4 + head.length
        if len(self.buffer) < whole:
            return  # the rest of the body is on its way
        body = bytes(self.buffer[end + 4 : whole])
        del self.buffer[:whole]
        keys = self.router.keys
        if keys.keys and not keys.admits("POST", head.target.partition("?")[0], head.headers):
            self.refuse(401, REFUSED, headers=(CHALLENGE,))
            # the next request from the loop, not from here: many sent at once would
            # recurse
            asyncio.get_running_loop().call_soon(self._go_on)
            return
        chosen = self.router.express(self, head, body)
        if chosen is not None:
            self.run(self.router.fast(self, head, body, chosen))

    def _go_on(self) -> None:
        if self.task is None and self.express is None:
            self.ended()

    def run(self, request: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """The task that takes the rest of a request, ``request``."""
        self.task = asyncio.get_running_loop().create_task(self._serve(request))
        return self.task

    def _hand_off(self) -> None:
        """aiohttp's from now on, with what the client has sent."""
        assert self.transport is not None
        self.router.fronts.discard(self)
        protocol = self.handoff()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        if self.buffer:
            protocol.data_received(bytes(self.buffer))
        self.buffer.clear()

    async def _serve(self, request: Coroutine[Any, Any, None]) -> None:
        try:
            await request
        except BaseException as err:
            self.lost()
            if isinstance(err, (OSError, asyncio.CancelledError)):
                return
            raise
        finally:
            self.task = None
        self.ended()

    def lost(self) -> None:
        """The answer cannot be finished: the connection is cut."""
        if self.transport is not None:
            self.transport.abort()

    def ended(self) -> None:
        """A request was answered: on to the next one."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.resume_reading()
        if self.buffer:
            self._next()  # a request sent before this one's answer

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            raise ConnectionResetError("the client went away")
        self.transport.write(data)

    def refuse(
        self,
        status: int,
        message: str,
        extra: dict[str, Any] | None = None,
        code: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> int:
        """Answer an error as the router does; the status."""
        body = json.dumps(error_doc(status, message, code, **(extra or {}))).encode()
        fields = [("Content-Type", "application/json; charset=utf-8"), *headers]
        self.write(_head(status, _REASONS.get(status, "Error"), fields, len(body)) + body)
        if self.flight is not None and self.flight.resp_headers is None:
            self.flight.answered(status, fields, body)
        return status

    def busy(self, message: str) -> int:
        """A 429 over a model's concurrencyLimit, as the router answers it."""
        return self.refuse(429, message, code=BUSY, headers=(("Retry-After", RETRY_AFTER),))

    def answer(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes) -> None:
        """A whole answer, in one write, with the upstream's ``headers`` but its own."""
        kept = [(k, v) for k, v in headers if k.lower() not in _HOP]
        self.write(_head(status, reason, kept, len(body)) + body)
        if self.flight is not None:
            self.flight.answered(status, kept, body)

    async def relay(self, w: Wrapper, up: Response, whole: int) -> int:
        """Pass ``up`` on to the client as it comes (read whole up to ``whole`` bytes of
        known length, and sent in one write); its status."""
        if up.length is not None and up.length <= whole:
            try:
                data = b"".join([chunk async for chunk in up.body])
            except OSError as err:
                return self.refuse(502, f"model {w.model.name}: its server did not answer: {err}")
            self.answer(up.status, up.reason, up.headers, data)
            return up.status
        headers = [(k, v) for k, v in up.headers if k.lower() not in _HOP]
        chunked = up.length is None
        self.write(_head(up.status, up.reason, headers, up.length))
        flight = self.flight
        if flight is not None:
            flight.head(up.status, headers)
            self.router.flights.started(flight)
        try:
            async for chunk in up.body:
                if chunk:
                    self.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if flight is not None:
                        flight.took(chunk)
                    await self.drain()
        except OSError:
            # Cut in the middle: cut the client's connection too, so that it sees the
            # answer end early rather than wait for the rest.
            assert self.transport is not None
            self.transport.abort()
            return up.status
        except asyncio.CancelledError:
            if flight is None or not flight.cancelled:
                raise
            # Cancelled (POST /api/inflight/ID/cancel): the answer ends where it stands,
            # as llama-swap's; one of announced length cannot, and is cut.
            uncancel()
            if not chunked:
                assert self.transport is not None
                self.transport.abort()
                return up.status
            w.info(f"POST {flight.path} cancelled")
        if chunked:
            self.write(b"0\r\n\r\n")
        return up.status


def _head(status: int, reason: str, headers: list[tuple[str, str]], length: int | None) -> bytes:
    """A response head; chunked where ``length`` is None."""
    lines = [f"HTTP/1.1 {status} {reason}".rstrip(), *(f"{k}: {v}" for k, v in headers)]
    lines.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
