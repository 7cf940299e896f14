"""serve's client to the wrappers (``upstream.Pool``) on its own: its bounds."""

from __future__ import annotations

import asyncio
import socket

import pytest

pytest.importorskip("aiohttp")

from vramlock.serve.upstream import Pool, UpstreamTimeout

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
