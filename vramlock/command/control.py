"""The cooperative control channel: a socketpair, one newline-terminated word per line.

    vramlock -> child:  release   restore
    child -> vramlock:  hello     released   restored   want

The child finds its end in the descriptor named by ``VRAMLOCK_CONTROL_FD``.
Unknown lines are ignored in both directions, so either side can grow.
"""

from __future__ import annotations

import os
import select
import socket
import time

ENV_CONTROL_FD = "VRAMLOCK_CONTROL_FD"
ENV_TOKEN_FD = "VRAMLOCK_TOKEN_FD"

_MAX_LINE = 256


class LineChannel:
    """Line framing over a stream socket; non-blocking reads, blocking writes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.closed = False  # the other end went away

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, word: str) -> bool:
        try:
            self.sock.sendall(word.encode() + b"\n")
        except OSError:
            self.closed = True
            return False
        return True

    def read_lines(self) -> list[str]:
        """Whatever complete lines have arrived (never blocks)."""
        if self.sock.fileno() < 0:
            self.closed = True
        while not self.closed:
            try:
                data = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self._buf += data
            if len(self._buf) > 64 * _MAX_LINE and b"\n" not in self._buf:
                self._buf = b""  # garbage without newlines: drop it
        *lines, self._buf = self._buf.split(b"\n")
        return [ln.decode(errors="replace").strip() for ln in lines if ln.strip()]

    def wait_lines(self, timeout: float | None) -> list[str]:
        """Block until at least one line arrives, the peer closes, or ``timeout`` passes."""
        end = None if timeout is None else time.monotonic() + timeout
        fd = self.sock.fileno()
        if fd < 0:  # closed by our own side (close() from another thread)
            self.closed = True
            return []
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            lines = self.read_lines()
            if lines or self.closed:
                return lines
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return []
            poller.poll(None if left is None else max(1, int(left * 1000)))

    def close(self) -> None:
        self.sock.close()


class ParentEnd(LineChannel):
    """vramlock's end. The child's end sits at descriptor ``child_fd``, a number that
    stays the same for every start of the command (``renew``)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        super().__init__(mine)
        self.child_fd = theirs.detach()

    def child_env(self, token_fd: int) -> dict[str, str]:
        return {ENV_CONTROL_FD: str(self.child_fd), ENV_TOKEN_FD: str(token_fd)}

    def started(self) -> None:
        """The child has its copy: drop ours, or we would never see the child close it."""
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        os.dup2(null, self.child_fd, inheritable=False)  # keeps the number reserved
        os.close(null)

    def renew(self) -> None:
        """A fresh channel for a command started again (restart, --yield-within)."""
        self.sock.close()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock, self._buf, self.closed = mine, b"", False
        os.dup2(theirs.fileno(), self.child_fd, inheritable=False)
        theirs.close()

    def close(self) -> None:
        os.close(self.child_fd)
        super().close()


def child_socket() -> socket.socket | None:
    """The child's end, from ``VRAMLOCK_CONTROL_FD``; None when not run by vramlock."""
    raw = os.environ.get(ENV_CONTROL_FD, "")
    if not (raw.isascii() and raw.isdigit()):
        return None
    fd = int(raw)
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    if sock.family != socket.AF_UNIX:
        sock.detach()
        return None
    os.set_inheritable(fd, False)  # our own children must not answer for us
    return sock
