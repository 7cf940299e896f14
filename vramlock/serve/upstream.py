"""HTTP/1.1 to the wrappers' listen addresses, on kept-alive asyncio streams.

aiohttp's client costs about 0.3 ms a request on a 2-core machine, more than the whole
router may add; the wrappers are on loopback and speak plain HTTP/1.1, so a request
here is one write of bytes, the response head parsed, and the body relayed by its
framing (``Content-Length``, chunked, or to the end of the connection) as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

_CHUNK = 256 * 1024
# A body up to this size is sent with its head, copied: one write, not two.
_JOINED = 64 * 1024
# A response head longer than this is the StreamReader's to refuse (its limit).
_HEAD_LIMIT = 1 << 16
# Kept-alive connections per wrapper: more are closed when returned.
POOL = 32


class UpstreamError(Exception):
    """The wrapper closed or broke the connection before a whole response head."""


class UpstreamTimeout(Exception):
    """A bound of the model's ``timeouts`` passed: ``key`` (its name), ``seconds``."""

    def __init__(self, what: str, key: str, seconds: float) -> None:
        super().__init__(f"{what} within {key}, {seconds:g} s")
        self.key, self.seconds = key, seconds


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    length: int | None  # Content-Length; None: chunked or to the end of the connection
    body: AsyncGenerator[bytes, None] = field(repr=False)


@dataclass
class Stream:
    """A request body passed on as it comes, never held whole: ``length`` bytes
    (Content-Length), or chunked when None."""

    chunks: AsyncIterator[bytes]
    length: int | None


Body = bytes | bytearray | Stream


class Pool:
    """Kept-alive connections to one loopback port."""

    def __init__(
        self, port: int, *, connect: float | None = None, header: float | None = None
    ) -> None:
        self.port = port
        self.connect = connect  # timeouts.connect: seconds, None: no bound
        self.header = header  # timeouts.responseHeader
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        # Counts close()s: a connection whose exchange began before the last one is
        # closed when the exchange ends, not kept (its answer may reach the client a
        # moment before the connection would be back among the idle ones).
        self.epoch = 0

    def close(self) -> None:
        self.epoch += 1
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: Body,
        exited: asyncio.Future[None] | None = None,
    ) -> Response:
        """Send the request; the response once its head has come. A kept-alive
        connection that turns out closed before any byte of an answer is retried once
        on a new one (the wrapper ends idle connections when its server goes); a
        streamed body, which cannot be sent twice, always goes on a new connection.
        What ``body``'s chunks raise ends the request (its connection closed). Once
        ``exited`` is done (the wrapper exited: a connection in the backlog of the
        listening socket it had would wait for nobody), ConnectionResetError."""
        data = self.encode(method, target, headers, body)
        if isinstance(body, Stream):
            return await self._fresh(method, data, exited)
        return await self._kept(method, data, exited)

    def encode(
        self, method: str, target: str, headers: list[tuple[str, str]], body: Body
    ) -> tuple[bytes, Body]:
        """The request's head, and its body: what ``request`` sends."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: 127.0.0.1:{self.port}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if not isinstance(body, Stream):
            lines.append(f"Content-Length: {len(body)}")
        elif body.length is not None:
            lines.append(f"Content-Length: {body.length}")
        else:
            lines.append("Transfer-Encoding: chunked")
        return "\r\n".join([*lines, "", ""]).encode("latin-1"), body

    async def _fresh(
        self, method: str, data: tuple[bytes, Body], exited: asyncio.Future[None] | None
    ) -> Response:
        _check(exited)
        try:
            connecting = asyncio.open_connection("127.0.0.1", self.port)
            reader, writer = await asyncio.wait_for(connecting, self.connect)
        except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
            assert self.connect is not None
            raise UpstreamTimeout("no connection", "timeouts.connect", self.connect) from None
        exchange = self._exchange(reader, writer, method, data, fresh=True)
        return await _unless(exited, writer, exchange)

    def take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A kept-alive connection that looks open, for ``Peek``; None if none is idle."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not (reader.at_eof() or writer.is_closing()):
                return reader, writer
            writer.close()
        return None

    def keep(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, epoch: int | None = None
    ) -> None:
        """A connection whose exchange ended whole, back among the idle ones, unless the
        pool was closed since the exchange began (``epoch``: ``self.epoch`` then)."""
        if len(self._idle) < POOL and (epoch is None or epoch == self.epoch):
            self._idle.append((reader, writer))
        else:
            writer.close()

    async def resume(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        data: tuple[bytes, Body],
        exited: asyncio.Future[None] | None = None,
    ) -> Response:
        """``request``'s response where ``data`` (a POST) went on a kept-alive connection
        already (``take``): its answer as ``request`` has it, retried as it retries."""
        try:
            exchange = self._exchange(reader, writer, "POST", data, sent=True)
            return await _unless(exited, writer, exchange)
        except UpstreamError:
            return await self._kept("POST", data, exited)

    async def _kept(
        self, method: str, data: tuple[bytes, Body], exited: asyncio.Future[None] | None
    ) -> Response:
        """On a kept-alive connection while one is idle and answers, else on a new one."""
        while (pair := self.take()) is not None:
            reader, writer = pair
            try:
                return await _unless(exited, writer, self._exchange(reader, writer, method, data))
            except UpstreamError:
                continue
        return await self._fresh(method, data, exited)

    async def _exchange(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        method: str,
        data: tuple[bytes, Body],
        fresh: bool = False,
        sent: bool = False,
    ) -> Response:
        epoch = self.epoch
        try:
            if sent:
                pass
            elif not isinstance(data[1], Stream) and len(data[1]) <= _JOINED:
                writer.write(data[0] + data[1])  # one segment: the wrapper wakes once
            else:
                writer.write(data[0])
                await _send(writer, data[1])
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header)
        except asyncio.IncompleteReadError as err:
            writer.close()
            if err.partial or fresh:
                raise ConnectionResetError("the wrapper closed the connection") from None
            raise UpstreamError from None
        except (ConnectionError, asyncio.LimitOverrunError):
            writer.close()
            if fresh:
                raise
            raise UpstreamError from None
        except asyncio.TimeoutError:
            writer.close()
            assert self.header is not None
            raise UpstreamTimeout(
                "no response head", "timeouts.responseHeader", self.header
            ) from None
        except BaseException:
            # Cancelled (the client went away, or POST /api/inflight/ID/cancel): the
            # answer is nobody's. Reset, not closed: a wrapper that holds the request
            # for a model still loading sees it and never passes it on.
            reset(writer)
            raise
        code, reason, headers, length, keep = parse_response(head[:-4], method)
        chunked = length is None and keep
        body = self._body(reader, writer, length, chunked, keep, epoch)
        return Response(code, reason, headers, length, body)

    async def _body(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        length: int | None,
        chunked: bool,
        keep: bool,
        epoch: int,
    ) -> AsyncGenerator[bytes, None]:
        done = False
        try:
            if chunked:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers
                        break
                    yield (await reader.readexactly(size + 2))[:-2]
            elif length is not None:
                left = length
                while left > 0:
                    chunk = await reader.read(min(left, _CHUNK))
                    if not chunk:
                        raise ConnectionResetError("the wrapper closed the connection")
                    left -= len(chunk)
                    yield chunk
            else:
                while chunk := await reader.read(_CHUNK):
                    yield chunk
            done = True
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("the wrapper closed the connection") from None
        finally:
            if done and keep:
                self.keep(reader, writer, epoch)
            else:
                writer.close()


class Peek(asyncio.Protocol):
    """Stands in for a kept-alive connection's own protocol (its StreamReader's) for one
    exchange: a response of known length up to ``whole`` bytes goes to ``answered``
    from the data callback once it has come, the connection back among the pool's idle
    ones, with no task to wake. Anything else (another framing, a larger body, a head
    that is not one, the connection ended or broken) is given back to the StreamReader
    as it came, and ``missed()`` called: ``Pool.resume`` goes on from there."""

    def __init__(
        self,
        pool: Pool,
        pair: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        whole: int,
        answered: Callable[[int, str, list[tuple[str, str]], bytes], None],
        missed: Callable[[], None],
    ) -> None:
        self.pool, self.pair, self.whole = pool, pair, whole
        self.epoch = pool.epoch
        self.answered, self.missed = answered, missed
        self.transport = pair[1].transport
        self.own = cast(asyncio.Protocol, self.transport.get_protocol())
        self.buffer = bytearray()
        self.transport.set_protocol(self)

    def _back(self) -> bool:
        """The connection's own protocol again; False if it was already."""
        if self.transport.get_protocol() is not self:
            return False
        self.transport.set_protocol(self.own)
        return True

    def _miss(self) -> None:
        if self._back():
            if self.buffer:
                self.own.data_received(bytes(self.buffer))
            self.missed()

    def cancel(self) -> None:
        """The answer is nobody's: the connection is closed."""
        self._back()
        self.pair[1].close()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _HEAD_LIMIT:
                self._miss()  # the StreamReader says what is wrong with it
            return
        try:
            code, reason, headers, length, keep = parse_response(bytes(buf[:end]), "POST")
        except ValueError:
            length = None
        if length is None or length > self.whole:
            self._miss()
            return
        whole = end + 4 + length
        if len(buf) < whole:
            return  # the rest of the body is on its way
        self._back()
        if len(buf) > whole:
            self.own.data_received(bytes(buf[whole:]))  # as the StreamReader would hold it
        if keep:
            self.pool.keep(*self.pair, self.epoch)
        else:
            self.pair[1].close()
        self.answered(code, reason, headers, bytes(buf[end + 4 : whole]))

    def eof_received(self) -> bool | None:
        if not self._back():
            return None
        if self.buffer:
            self.own.data_received(bytes(self.buffer))
        keep_open = self.own.eof_received()
        self.missed()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        if self._back():
            if self.buffer:
                self.own.data_received(bytes(self.buffer))
            self.own.connection_lost(exc)
            self.missed()

    def pause_writing(self) -> None:
        self.own.pause_writing()

    def resume_writing(self) -> None:
        self.own.resume_writing()


def parse_response(
    head: bytes, method: str
) -> tuple[int, str, list[tuple[str, str]], int | None, bool]:
    """A response head (without its blank line): its status, reason, headers, length
    (None: chunked, or to the end of the connection) and whether the connection stays
    open after it. ValueError for a status that is no number."""
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    _, status, reason = [*status_line.split(" ", 2), ""][:3]
    headers = [(k, v.strip()) for k, _, v in (h.partition(":") for h in header_lines)]
    names = {k.lower(): v for k, v in headers}
    keep = names.get("connection", "").lower() != "close"
    code = int(status)
    length: int | None = None
    if method == "HEAD" or code in (204, 304) or 100 <= code < 200:
        length = 0
    elif "chunked" in names.get("transfer-encoding", "").lower():
        pass
    elif "content-length" in names:
        length = int(names["content-length"])
    else:
        keep = False  # to the end of the connection
    return code, reason, headers, length, keep


def _check(exited: asyncio.Future[None] | None) -> None:
    if exited is not None and exited.done():
        raise ConnectionResetError("the wrapper exited")


async def _unless(
    exited: asyncio.Future[None] | None,
    writer: asyncio.StreamWriter,
    exchange: Coroutine[Any, Any, Response],
) -> Response:
    """``exchange``'s response; ConnectionResetError if ``exited`` is done first (the
    connection is cut then, which ends the exchange). No task of its own: a request
    costs no more turns of the event loop for it."""
    if exited is None:
        return await exchange
    try:
        _check(exited)
    except ConnectionResetError:
        exchange.close()
        writer.close()
        raise

    def cut(_: asyncio.Future[None]) -> None:
        writer.transport.abort()

    exited.add_done_callback(cut)
    try:
        return await exchange
    except (ConnectionError, UpstreamError, asyncio.IncompleteReadError):
        _check(exited)
        raise
    finally:
        exited.remove_done_callback(cut)


async def _send(writer: asyncio.StreamWriter, body: Body) -> None:
    """Write ``body``, a piece at a time past ``_CHUNK``, each once the last has gone:
    the transport's buffer never holds a copy of a large body."""
    if isinstance(body, Stream):
        chunked = body.length is None
        async for chunk in body.chunks:
            if chunk:
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
        return
    if len(body) <= _CHUNK:
        writer.write(body)
        return
    view = memoryview(body)
    for i in range(0, len(view), _CHUNK):
        writer.write(view[i : i + _CHUNK])
        await writer.drain()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with a reset (RST), not an orderly end."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
