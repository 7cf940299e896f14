"""Binding an aiohttp application's address, for ``vramlock serve`` and ``vramlock ui``.

aiohttp comes with the ``serve`` extra: it is imported here only inside the function, so that
importing this module costs nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING, Any

from ..errors import AddressError

if TYPE_CHECKING:
    from aiohttp import web


async def bind_until_signalled(
    runner: web.AppRunner, host: str | None, port: int, listen: str, **site: Any
) -> asyncio.Event:
    """Take ``host:port`` for ``runner`` (set up already) and return an event that SIGTERM,
    SIGINT or SIGHUP sets. A busy or forbidden address is an AddressError naming
    ``--listen listen``, the runner cleaned up."""
    from aiohttp import web

    bound = web.TCPSite(runner, host, port, reuse_address=True, **site)
    try:
        await bound.start()
    except OSError as err:
        await runner.cleanup()
        # aiohttp rewords the error: the errno says it in the usual words.
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise AddressError("--listen", listen, reason) from None
    return until_signalled()


def until_signalled() -> asyncio.Event:
    """An event that SIGTERM, SIGINT or SIGHUP sets, from now on (in the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(s, stop.set)
    return stop
