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
import socket
import struct
from collections.abc import Callable

from ... import procfs

_LISTEN = b"0A"  # TCP_LISTEN in /proc/net/tcp's st column
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, NLM_F_DUMP, NLMSG_DONE,
# NLMSG_ERROR, TCP_LISTEN (linux/netlink.h, linux/sock_diag.h, net/tcp_states.h)
_NETLINK_SOCK_DIAG, _BY_FAMILY, _REQUEST, _DUMP, _DONE, _ERROR = 4, 20, 1, 0x300, 3, 2
_TCP_LISTEN = 10


def listeners(port: int) -> set[int]:
    """The inodes of the sockets listening on TCP port ``port`` (any address): asked of
    the kernel's socket diagnostics for listening sockets alone, else read from
    /proc/net/tcp{,6} (every socket of the host: milliseconds where there are many)."""
    try:
        return {inode for p, inode in _diag_listeners() if p == port}
    except OSError:
        return _table_listeners(port)


def _diag_listeners() -> list[tuple[int, int]]:
    """(port, inode) of every listening TCP socket, by NETLINK_SOCK_DIAG."""
    found: list[tuple[int, int]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        for family in (socket.AF_INET, socket.AF_INET6):
            # inet_diag_req_v2: family, protocol, ext, pad, states; a zeroed socket id
            req = struct.pack("=BBBBI48x", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN)
            head = struct.pack("=IHHII", 16 + len(req), _BY_FAMILY, _REQUEST | _DUMP, 1, 0)
            nl.send(head + req)
            found += _dumped(nl)
    return found


def _dumped(nl: socket.socket) -> list[tuple[int, int]]:
    """The (port, inode) of each inet_diag_msg answered, until NLMSG_DONE."""
    found: list[tuple[int, int]] = []
    while True:
        data = nl.recv(1 << 16)
        at = 0
        while at + 16 <= len(data):
            size, kind = struct.unpack_from("=IH", data, at)
            if kind == _DONE:
                return found
            if kind == _ERROR or size < 16:
                raise OSError("sock_diag refused the request")
            # inet_diag_msg: family, state, timer, retrans; id (sport first, big-endian,
            # 48 bytes); expires, rqueue, wqueue, uid; inode
            sport = struct.unpack_from("!H", data, at + 16 + 4)[0]
            inode = struct.unpack_from("=I", data, at + 16 + 4 + 48 + 16)[0]
            found.append((sport, inode))
            at += (size + 3) & ~3


def _table_listeners(port: int) -> set[int]:
    found: set[int] = set()
    local = f":{port:04X} ".encode()  # local_address ends so; remote ones never start a line
    for table in _TABLES:
        try:
            with open(table, "rb") as f:
                data = f.read()
        except OSError:
            continue
        at = data.find(local)
        while at >= 0:
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            fields = data[start : end if end >= 0 else len(data)].split()
            at = data.find(local, at + 1)
            if len(fields) < 10 or fields[3] != _LISTEN or not fields[1].endswith(local[:-1]):
                continue
            found.add(int(fields[9]))
    return found


def holding(pids: list[int], inodes: set[int]) -> int | None:
    """The first of ``pids`` with a descriptor on one of the sockets ``inodes``."""
    names = {f"socket:[{i}]" for i in inodes}
    for pid in pids:
        for path in procfs.descriptors(pid):
            try:
                if os.readlink(path) in names:
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
