"""Blocking work off serve's event loop, in a thread that ends with it.

Never in a pool's threads, which outlive their work: the wrappers' parent-death signal
(PR_SET_PDEATHSIG) is sent again each time they are handed from one of serve's threads
to another as the threads end, so that when serve is SIGKILLed, each thread still alive
signals the wrappers once more, in the middle of the cleanup the first signal began.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def briefly(fn: Callable[[], T]) -> T:
    """``fn()``, in a thread of its own that ends with it; awaited (a cancel leaves the
    thread to finish, its result dropped)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, err: BaseException | None) -> None:
        if done.done():
            return  # cancelled meanwhile
        if err is not None:
            done.set_exception(err)
        else:
            done.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        value: T | None = None
        err: BaseException | None = None
        try:
            value = fn()
        except BaseException as e:  # handed to the waiter
            err = e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, value, err)

    threading.Thread(target=run, name="vramlock-serve-briefly", daemon=True).start()
    return await done
