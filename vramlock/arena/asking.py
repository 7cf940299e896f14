"""Asking one budget resident to step aside, and nobody else (docs/protocol.md, "The
budget": an ask is an OFD read lock on ``want.lock`` at the resident's units).

A whole-GPU waiter (``vramlock wait``) ends every resident of a budget arena; an ask
at one resident's units ends that one alone: it honours its minimum hold and its
``--yield-within`` as it does for any budget waiter, then gives up every unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from . import lockfd
from .directory import TOKEN, WANT, Arena


@contextlib.contextmanager
def asking(arena: Arena, units: Iterable[int]) -> Iterator[None]:
    """Hold asks at ``units`` for as long as the block runs (the kernel drops them
    with the descriptor, should we die)."""
    fd = lockfd.open_lock_file(
        arena.dirfd, WANT, arena.shown(WANT), allowed_owners=arena.allowed_owners
    )
    try:
        for unit in sorted(set(units)):
            lockfd.try_lock_bytes(fd, unit, write=False)
        lockfd.ring(arena.dirfd, TOKEN)
        yield
    finally:
        lockfd.close(fd)
