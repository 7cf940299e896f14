"""The conversation between vramlock run and the processes of a swapped command: the
Python end of vramlock/gpu/core/control.c, beside it, with its words defined once.

Each process that sets up the engine (the CUDA library preloaded, or the Vulkan layer)
connects once to a unix socket in a private directory, named to it by
``VRAMLOCK_SWAP_SOCKET``, and says ``hello <pid>``; the hub keeps it only when the
kernel's pid for the connection (``SO_PEERCRED``) is that pid and a process of this run,
and answers ``resident``, or ``release`` when the command is released at that moment, so
a process that starts while another member holds the token never touches the GPU. The
hub listens on an abstract socket too (``VRAMLOCK_SWAP_ABSTRACT``), for a process that
cannot reach the path (another user after a privilege drop, a private /tmp); one that
reaches neither runs without swap or exits (``VRAMLOCK_SWAP_UNREACHED``), and says so in
a mapping of its own (``UNREACHED``).

A word to every process, and each one's answer:

    release   released          its memory is in host memory, its GPU calls blocked
              refused <why>     it cannot be swapped: it runs on
              failed <why>      it tried and could not; it runs on, memory kept
    restore   restored          its memory is back, its GPU calls free
              failed <why>      it found no memory for it: it stays released
    unpin     unpinned <bytes>  its host copies unlocked, before a park
    pin       pinned            locked again

``unpin`` and ``pin`` are answered ``failed not released`` by a process that is not
released. A process whose connection is gone (vramlock run died) decides by the
command's token: ``PARKED`` beside the socket says a process of the command may be
checkpointed.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TypeVar

from ... import procfs
from ...command.control import LineChannel
from ...errors import StrategyError


class SwapUnavailable(StrategyError):
    """The engine cannot be used here: its library is not there and cannot be built, or
    its socket has no place."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"--release swap cannot be used here: {reason}")
        self.reason = reason


# The words (core/control.c).
HELLO = "hello"
RESIDENT = "resident"
RELEASE = "release"
RELEASED = "released"
RESTORE = "restore"
RESTORED = "restored"
REFUSED = "refused"
FAILED = "failed"
UNPIN = "unpin"
UNPINNED = "unpinned"
PIN = "pin"
PINNED = "pinned"

ENV_SOCKET = "VRAMLOCK_SWAP_SOCKET"
# The hub's abstract socket, for a process that cannot reach the path: another user's
# (a privilege drop), another mount namespace's (a private /tmp). "vramlock-swap/<our
# pid>/<our start time>/<random>": the library checks that we are who listens there.
ENV_ABSTRACT = "VRAMLOCK_SWAP_ABSTRACT"
# What a process that reaches neither does: "run" without swap (auto), or "exit" before
# its GPU work (--release swap).
ENV_UNREACHED = "VRAMLOCK_SWAP_UNREACHED"
# A process that connected says hello at once; one told to release as it joins has
# nothing to copy yet.
HELLO_WITHIN = 2.0
JOIN_WITHIN = 5.0
# The name of the mapping the engine keeps while its process has not joined (core/gate.h).
UNJOINED = "vramlock-swap-unjoined"
SET_UP = "vramlock-swap-set-up"  # the library's mapping once it has set up (core/gate.c)
# The library's mapping in a process that could reach neither socket and runs without
# swap: "vramlock-swap-unreached:<errno>" (core/gate.c).
UNREACHED = re.compile(r"vramlock-swap-unreached:(\d+)")
SOCKET_NAME = "control"
# Beside the socket while a process of the command may be checkpointed (parked): the
# library's word for it too (core/control.c).
PARKED = "parked"
MAX_SOCKET_PATH = 108  # a unix socket's address, its final NUL included
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


@dataclass
class Peer:
    """One process of the command (CUDA or Vulkan), connected to the hub."""

    pid: int
    channel: LineChannel


class Hub:
    """The socket the command's processes join (those of the CUDA library and of the
    Vulkan layer alike), and the word to all of them.

    ``released`` and the list of peers change under ``lock`` only, so a process
    either is among those a release speaks to, or joins after it and is told to
    release as it joins.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.peers: list[Peer] = []
        self.released = False
        # Each process that connected, with the program it ran then (``image``): it had
        # set up, whether or not its mark shows.
        self._connected: dict[int, tuple[int, ...]] = {}
        self._socks = [_listening(path)]
        self.abstract = _abstract_name()
        with contextlib.suppress(OSError):  # taken (by chance, or by malice): the path only
            self._socks.append(_listening(f"\0{self.abstract}"))
        if len(self._socks) == 1:
            self.abstract = ""
        self._threads = [
            threading.Thread(target=self._serve, args=(s,), name="vramlock-swap", daemon=True)
            for s in self._socks
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed: the run is over
            pid = _peer_pid(conn)
            if pid is None or pid not in procfs.descendants(os.getpid()):
                conn.close()  # a stranger: nothing it says counts
                continue
            program = image(pid)
            if program is not None:
                with self.lock:
                    self._connected = {p: i for p, i in self._connected.items() if procfs.living(p)}
                    self._connected[pid] = program
            self._join(pid, LineChannel(conn))

    def _join(self, pid: int, channel: LineChannel) -> None:
        lines = channel.wait_lines(HELLO_WITHIN)
        if lines[:1] != [f"{HELLO} {pid}"]:
            channel.close()  # not ours; if it was, it stays blocked: the safe side
            return
        peer = Peer(pid, channel)
        with self.lock:
            if not self.released:
                channel.send(RESIDENT)
            else:
                channel.send(RELEASE)
                answer = channel.wait_lines(JOIN_WITHIN)
                if answer[:1] != [RELEASED]:
                    channel.close()  # it cannot run unless we say so
                    return
            self.peers.append(peer)

    def joined(self) -> bool:
        """Is a process of the command connected (those that exited are dropped)?"""
        with self.lock:
            for peer in self.peers:
                peer.channel.read_lines()  # stale: each answer is read after its word
            self.peers = [p for p in self.peers if not p.channel.closed]
            return bool(self.peers)

    def connected(self) -> set[int]:
        """The pids of the processes connected now (stale lines dropped, a connection
        that closed noticed)."""
        with self.lock:
            for peer in self.peers:
                peer.channel.read_lines()
            return {p.pid for p in self.peers if not p.channel.closed}

    def connected_at_once(self, pid: int) -> tuple[int, ...] | None:
        """The program ``pid`` ran when it connected (``image``), or None: it did not."""
        with self.lock:
            return self._connected.get(pid)

    def tell(self, word: str, *, released: bool) -> list[Peer]:
        """Say ``word`` to every process, with ``released`` as the new state for any
        that joins from now on; the processes told (stale lines dropped first)."""
        with self.lock:
            self.released = released
            live = []
            for peer in self.peers:
                peer.channel.read_lines()
                if not peer.channel.closed and peer.channel.send(word):
                    live.append(peer)
            self.peers = live
            return list(live)

    def stopped(self) -> list[int]:
        """The connected processes that are stopped (SIGSTOP, a debugger): they cannot
        answer until continued."""
        with self.lock:
            return [p.pid for p in self.peers if procfs.state(p.pid) in ("T", "t")]

    def reset(self) -> None:
        """The command was ended: what joins next is a fresh start, resident."""
        with self.lock:
            for peer in self.peers:
                peer.channel.close()
            self.peers = []
            self.released = False

    def close(self) -> None:
        # shutdown wakes the accepting thread (close alone would leave it blocked on
        # a socket that still takes connections).
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(1.0)
        for sock in self._socks:
            sock.close()
        self.reset()


def image(pid: int) -> tuple[int, ...] | None:
    """The program ``pid`` runs, told from any it exec'd before or after: its start time,
    and where the kernel laid that program out (``procfs.layout``, its size left out);
    None when it is gone or cannot be read."""
    start, layout = procfs.starttime(pid), procfs.layout(pid)
    if start is None or layout is None or not any(layout[1:]):
        return None
    return (start, *layout[1:])


def _listening(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def _abstract_name() -> str:
    """A name for the hub's abstract socket that says who listens there (the library
    checks it against the kernel's word), and that nobody can guess to take first."""
    start = procfs.starttime(os.getpid())
    return f"vramlock-swap/{os.getpid()}/{start}/{secrets.token_hex(16)}"


def unreached(paths: set[str]) -> str | None:
    """Why the process that has ``paths`` mapped could not reach the hub and runs without
    swap (the library's mapping says so), or None."""
    for path in paths:
        found = UNREACHED.search(path)
        if found:
            code = int(found.group(1))
            return os.strerror(code) if code else "no reason given"
    return None


def _peer_pid(conn: socket.socket) -> int | None:
    """The pid of the process at the other end, as the kernel saw it connect."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid: int = _UCRED.unpack(creds)[0]
    return pid if pid > 0 else None


def socket_dir() -> str:
    """A private directory (mode 0700) for the hub's socket, in the temporary directory
    where its path fits a unix socket's address, else in /tmp."""
    for base in (None, "/tmp"):
        directory = tempfile.mkdtemp(prefix="vramlock-swap-", dir=base)
        if len(os.path.join(directory, SOCKET_NAME).encode()) < MAX_SOCKET_PATH:
            return directory
        os.rmdir(directory)
    raise SwapUnavailable("no directory for its socket has a path short enough")


_HUBS: dict[str, Hub] = {}
H = TypeVar("H", bound=Hub)


def open_hub(make: Callable[[str], H], env: dict[str, str], scratch: ExitStack) -> H:
    """A hub made by ``make(socket path)`` in a directory of its own, named to the command
    by ``env``'s ``VRAMLOCK_SWAP_SOCKET``, closed and its directory gone with ``scratch``."""
    directory = socket_dir()
    scratch.callback(shutil.rmtree, directory, ignore_errors=True)
    path = os.path.join(directory, SOCKET_NAME)
    hub = make(path)
    _HUBS[path] = hub
    scratch.callback(_HUBS.pop, path, None)
    scratch.callback(hub.close)
    env[ENV_SOCKET] = path
    return hub


def prepared_hub(env: Mapping[str, str]) -> Hub | None:
    """The hub ``open_hub`` made for a command of ``env``, or None."""
    return _HUBS.get(env.get(ENV_SOCKET, ""))
