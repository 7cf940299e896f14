"""The protocol's two locks: the token (held = resident) and want (held shared = waiting).

Waiter: ``want.lock`` shared (blocking: a probe holds it exclusively for an
instant), ring, ``token.lock`` exclusive (blocking in the kernel, so waiters are
queued in order and visible in /proc/locks), then drop ``want.lock``.

Holder: probe ``want.lock`` with ``LOCK_EX|LOCK_NB`` on an open file description
of its own; failure means somebody waits.
"""

from __future__ import annotations

import os
import time

from ..errors import UsageError
from . import lockfd
from .directory import TOKEN, WANT, Arena


def _open(arena: Arena, name: str) -> int:
    return lockfd.open_lock_file(
        arena.dirfd, name, arena.shown(name), allowed_owners=arena.allowed_owners
    )


def _reopen(arena: Arena, name: str, fd: int) -> None:
    lockfd.reopen_lock_file(
        fd, arena.dirfd, name, arena.shown(name), allowed_owners=arena.allowed_owners
    )


class Token:
    """``token.lock``: an exclusive flock on it means resident on the GPU."""

    def __init__(self, arena: Arena, fd: int | None = None) -> None:
        """Open token.lock, or adopt ``fd``, a descriptor of it opened by our caller
        (``vramlock wait --fd``: the lock then belongs to the caller's open file description)."""
        self.arena = arena
        shown = arena.shown(TOKEN)
        own = _open(arena, TOKEN)
        if fd is not None:
            try:
                if not lockfd.same_file(fd, own):
                    raise UsageError(f"--fd {fd}: not an open descriptor of {shown}")
            finally:
                lockfd.close(own)
            if lockfd.is_path_only(fd):
                raise UsageError(
                    f"--fd {fd}: opened with O_PATH, which cannot be locked; "
                    f"open {shown} for reading (exec {fd}<FILE)"
                )
            lockfd.adopt(fd, shown)
            own = fd
        self.fd = own
        self.adopted = fd is not None  # the caller's description: never reopened
        self.held = False

    def acquire(self, timeout: float | None) -> bool:
        if not lockfd.lock_within(self.fd, exclusive=True, timeout=timeout):
            return False
        try:
            lockfd.check_still_linked(self.arena.dirfd, TOKEN, self.fd, self.arena.shown(TOKEN))
        except BaseException:
            lockfd.unlock(self.fd)
            raise
        self.held = True
        return True

    def drop(self) -> None:
        """Unlock: somebody else may be resident now."""
        self.held = False
        lockfd.unlock(self.fd)

    def linked(self) -> bool:
        """Is ``token.lock`` still the file we lock? (It may have been deleted.)"""
        return lockfd.still_linked(self.arena.dirfd, TOKEN, self.fd)

    def reopen(self) -> None:
        """Lock the file now at ``token.lock`` from here on (not while held)."""
        _reopen(self.arena, TOKEN, self.fd)

    @property
    def inode(self) -> int:
        return os.fstat(self.fd).st_ino

    def held_elsewhere(self) -> bool:
        """True when another open file description holds the token (we must not hold it)."""
        return lockfd.conflicts(self.fd, exclusive=False)

    def close(self) -> None:
        lockfd.close(self.fd)


class Want:
    """``want.lock``: the waiter's shared lock, and the holder's probe."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.fd = _open(arena, WANT)
        # The probe needs an open file description of its own: probing on the
        # waiter's descriptor would convert our own lock instead of seeing others'.
        self.probe_fd = _open(arena, WANT)
        self.holding = False

    def enter(self, timeout: float | None) -> bool:
        """Say we want the token: take want.lock shared, then ring the holder."""
        if not lockfd.lock_within(self.fd, exclusive=False, timeout=timeout):
            return False
        self.holding = True
        lockfd.ring(self.arena.dirfd, TOKEN)
        return True

    def linked(self) -> bool:
        return lockfd.still_linked(self.arena.dirfd, WANT, self.fd)

    def reopen(self) -> None:
        """Wait and probe on the file now at ``want.lock`` (not while waiting)."""
        _reopen(self.arena, WANT, self.fd)
        _reopen(self.arena, WANT, self.probe_fd)

    def leave(self) -> None:
        if self.holding:
            self.holding = False
            lockfd.unlock(self.fd)

    def probe(self) -> bool:
        """Does anybody wait for the token? (Holders have left want.lock, so it is never us.)"""
        return lockfd.conflicts(self.probe_fd, exclusive=True)

    def close(self) -> None:
        self.leave()
        lockfd.close(self.fd)
        lockfd.close(self.probe_fd)


def wait_turn(want: Want, token: Token, timeout: float | None, *, wanting: bool = True) -> bool:
    """Queue for the token as a waiter; True once it is ours, False when ``timeout`` ran out.

    ``wanting=False`` waits passively: residents are not asked to step aside.
    """
    end = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if end is None else max(0.0, end - time.monotonic())

    if wanting and not want.enter(left()):
        return False
    try:
        return token.acquire(left())
    finally:
        want.leave()
