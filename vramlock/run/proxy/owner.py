"""Whose is the upstream's port? Clients are forwarded only to a listener of the
command's own processes: another program on that port (a port handed out that somebody
else took, another user's server) would get their requests, headers and all.

The kernel lists every listening TCP socket in /proc/net/tcp and /proc/net/tcp6 (by
local port and inode); a process's descriptors name the sockets they are
(``socket:[INODE]`` in /proc/PID/fd). A listener whose inode none of the command's
processes holds is a stranger's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ... import procfs

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def listeners(port: int) -> set[int]:
    """The inodes of the sockets listening on TCP port ``port`` (any address)."""
    found: set[int] = set()
    for table in _TABLES:
        try:
            with open(table, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            try:
                if int(fields[1].rpartition(":")[2], 16) == port:
                    found.add(int(fields[9]))
            except ValueError:
                continue
    return found


def holding(pids: list[int], inodes: set[int]) -> int | None:
    """The first of ``pids`` with a descriptor on one of the sockets ``inodes``."""
    names = {f"socket:[{i}]" for i in inodes}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in names:
                    return pid
            except OSError:
                continue
    return None


def who(port: int) -> str:
    """Which program listens on ``port``, in words, as far as we may see."""
    inodes = listeners(port)
    if not inodes:
        return "nobody"
    pid = holding([p for p in procfs.all_pids() if p != os.getpid()], inodes)
    if pid is None:
        return "a program that is not ours to see (another user's?)"
    return f"{procfs.text(pid, 'comm') or '?'} (pid {pid})"


def in_use(port: int) -> str | None:
    """Before the command starts: None when nobody listens on ``port``, else who does."""
    return who(port) if listeners(port) else None


class Guard:
    """The proxy's check of its upstream's listener, made once per start of the command
    (``key()``: its pid now; ``processes()``: its processes) and again after a failure."""

    def __init__(
        self, port: int, key: Callable[[], int], processes: Callable[[], list[int]]
    ) -> None:
        self.port = port
        self._key = key
        self._processes = processes
        self._verified: int | None = None  # the key the last check passed for

    def check(self) -> str | None:
        """None when nobody listens on the port yet or the command does, else why its
        clients may not go there (in words). Passed once for a start, it is not made
        again until the command starts anew or ``forget``."""
        key = self._key()
        if key == self._verified:
            return None
        inodes = listeners(self.port)
        if not inodes:
            return None  # nobody yet: the command is starting
        if holding(self._processes(), inodes) is not None:
            self._verified = key
            return None
        return (f"port {self.port} is served by {who(self.port)}, not by the command;"
                " its clients are not forwarded there")  # fmt: skip

    def forget(self) -> None:
        """Check again next time (a connection to the upstream failed)."""
        self._verified = None
