"""Holds the read ends of the wrappers' output pipes, and drains them once serve is gone.

serve reads its wrappers' output; if serve dies (even SIGKILLed), the wrappers get
SIGTERM and release their commands, writing as they go. With no reader left, each
write would be EPIPE (or SIGPIPE, which ends a server in the middle of its release);
with a reader that does not read, a full pipe would block them. So this process, one per
serve, started with it in a session of its own, gets each pipe's read end from serve
(``SCM_RIGHTS`` on a socket) and holds it; once serve's end of the socket closes, it
copies what every pipe carries to serve's own standard output or error (which it
shares) as far as they take it, dropping the rest, until its writers have all exited;
then exits.
A pipe whose writers all exited while serve runs is let go at once (POLLHUP).

``python -m vramlock.serve.drain FD``: FD is its end of the socket.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys

_MAX_FDS = 16
_PIPE_BUF = 4096


class Drain:
    """serve's side: a drainer process and the socket to it."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vramlock.serve.drain", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )  # fmt: skip
        self.sock = mine

    def hold(self, fds: list[int]) -> None:
        """Give the drainer copies of ``fds``: the read ends of a wrapper's standard
        output's pipe and its standard error's."""
        with contextlib.suppress(OSError):  # the drainer gone: serve goes on without it
            socket.send_fds(self.sock, [b"f"], fds)

    def close(self) -> None:
        """serve is ending: the drainer drains what is left and exits by itself."""
        self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(0)


def main(control: int) -> None:
    sock = socket.socket(fileno=control)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    held: dict[int, int] = {}  # a pipe's read end -> where its output goes (1 or 2)
    while True:
        for fd, events in poller.poll():
            if fd != sock.fileno():
                if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    poller.unregister(fd)
                    os.close(fd)
                    held.pop(fd, None)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1, _MAX_FDS)
            except OSError:
                data, fds = b"", []
            for fd, out in zip(fds, (1, 2), strict=False):
                held[fd] = out
                poller.register(fd, 0)  # hang-ups only, while serve reads them
            if not data:
                _drain(held)
                return


def _drain(held: dict[int, int]) -> None:
    """serve is gone: copy each pipe to its stream until its writers have exited."""
    poller = select.poll()
    for fd in held:
        os.set_blocking(fd, True)  # serve read it non-blocking: the same open file
        poller.register(fd, select.POLLIN)
    while held:
        for fd, _ in poller.poll():
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                os.close(fd)
                held.pop(fd)
                continue
            _offer(held[fd], data)


def _offer(out: int, data: bytes) -> None:
    """``data`` to ``out`` as far as it takes it now, PIPE_BUF bytes at a time (a pipe
    that polls writable takes that much whole); the rest is dropped: whoever reads serve's
    output may be gone or stopped, and nothing may wait for them."""
    poller = select.poll()
    poller.register(out, select.POLLOUT)
    while data and any(ev & select.POLLOUT for _, ev in poller.poll(0)):
        try:
            data = data[os.write(out, data[:_PIPE_BUF]) :]
        except OSError:
            return  # that stream is gone: what it was to get too


if __name__ == "__main__":
    main(int(sys.argv[1]))
