"""Wake-up hints: inotify IN_OPEN on the arena directory.

A waiter opens ``token.lock`` after it has taken ``want.lock`` (our waiters ring
on purpose; ``flock -s want.lock flock -x token.lock`` does it by the order of its
opens). The holder sleeps in poll() on this descriptor and probes want.lock when
it wakes, and at a fixed interval anyway: the hint only makes it sooner.
"""

from __future__ import annotations

import ctypes
import os

_IN_OPEN = 0x00000020
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


def drain(fd: int) -> bool:
    """Read a non-blocking descriptor (inotify, a wake-up pipe) until it is empty;
    True when there was something to read."""
    got = False
    try:
        while os.read(fd, 65536):
            got = True
    except BlockingIOError:
        pass
    return got


class Hint:
    """A pollable descriptor that becomes readable when a file in the arena (any of
    the arenas, for a member of several) is opened."""

    def __init__(self, *dirfds: int) -> None:
        self.fd: int | None = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init, add = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError):
            return
        init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
        add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
        fd = init(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return
        # Watch the directories we already opened, not their paths, which may have changed.
        for dirfd in dirfds:
            if add(fd, f"/proc/self/fd/{dirfd}".encode(), _IN_OPEN) < 0:
                os.close(fd)
                return
        self.fd = fd

    def drain(self) -> None:
        if self.fd is not None:
            drain(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
