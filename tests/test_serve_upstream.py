"""serve's client to the wrappers (``upstream.Pool``) on its own: its bounds."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from vramlock.serve.upstream import Body, Peek, Pool, UpstreamTimeout

pytestmark = pytest.mark.timeout(30)


def test_a_connection_not_made_within_timeouts_connect_says_so() -> None:
    # A listener that accepts nobody, its backlog full: a new connection waits.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            queued.append(s)

        async def main() -> str:
            pool = Pool(port, connect=0.3)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(UpstreamTimeout) as err:
                await pool.request("POST", "/", [], b"{}")
            assert loop.time() - started < 2
            return str(err.value)

        assert asyncio.run(main()) == "no connection within timeouts.connect, 0.3 s"
    finally:
        for s in queued:
            s.close()
        server.close()


async def _server(answers: list[bytes]) -> tuple[asyncio.Server, int, list[bytes]]:
    """A server that answers each request it reads (a head and its Content-Length body)
    with the next of ``answers`` (empty: it closes the connection); what it read."""
    seen: list[bytes] = []

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen.append(head + await reader.readexactly(length))
            answer = answers.pop(0)
            if not answer:
                break
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(one, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _peek(pool: Pool, data: tuple[bytes, Body]) -> asyncio.Future[Any]:
    """A kept-alive connection of ``pool``'s under a Peek, ``data`` sent on it: done
    with ("answered", status, headers, body) or ("missed", pair)."""
    outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    pair = pool.take()
    assert pair is not None

    def answered(status: int, reason: str, headers: list[tuple[str, str]], body: bytes) -> None:
        outcome.set_result(("answered", status, headers, body))

    Peek(pool, pair, 1 << 20, answered, lambda: outcome.set_result(("missed", pair)))
    assert isinstance(data[1], bytes)
    pair[1].write(data[0] + data[1])
    return outcome


def test_peek_passes_a_whole_answer_on_and_keeps_the_connection() -> None:
    async def main() -> None:
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\nhi"
        server, port, seen = await _server([ok, ok])
        pool = Pool(port)
        first = await pool.request("POST", "/a", [], b"{}")
        assert b"".join([c async for c in first.body]) == b"hi"
        data = pool.encode("POST", "/b", [("Content-Type", "text/plain")], b"xyz")
        got = await _peek(pool, data)
        assert got == ("answered", 200, [("Content-Length", "2"), ("X-A", "b")], b"hi")
        assert seen[1] == data[0] + b"xyz"
        assert len(pool._idle) == 1  # back, for the next request
        pool.close()
        server.close()

    asyncio.run(main())


def test_peek_gives_a_chunked_answer_back_to_the_reader() -> None:
    async def main() -> None:
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
        chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
        server, port, _ = await _server([ok, chunked])
        pool = Pool(port)
        assert [c async for c in (await pool.request("POST", "/", [], b"{}")).body]
        data = pool.encode("POST", "/", [], b"{}")
        what, pair = await _peek(pool, data)
        assert what == "missed"
        up = await pool.resume(pair[0], pair[1], data)
        assert (up.status, up.length) == (200, None)
        assert b"".join([c async for c in up.body]) == b"hi"
        pool.close()
        server.close()

    asyncio.run(main())


def test_peek_on_a_connection_closed_unanswered_retries_on_a_new_one() -> None:
    async def main() -> None:
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
        server, port, seen = await _server([ok, b"", ok])
        pool = Pool(port)
        assert [c async for c in (await pool.request("POST", "/", [], b"{}")).body]
        data = pool.encode("POST", "/", [], b"{}")
        what, pair = await _peek(pool, data)
        assert what == "missed"
        up = await pool.resume(pair[0], pair[1], data)
        assert (up.status, b"".join([c async for c in up.body])) == (200, b"hi")
        assert len(seen) == 3  # sent again, once
        pool.close()
        server.close()

    asyncio.run(main())
