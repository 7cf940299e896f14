"""The proxy thread's selector: each socket watched with its handler, and a wake-up pipe."""

from __future__ import annotations

import errno
import os
import selectors
import socket
from collections.abc import Callable

from ...arena.hint import drain
from ...net.address import Target

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
# connect_ex's answers for a connection still under way.
PENDING = (errno.EINPROGRESS, errno.EAGAIN)


def connect_to(target: Target) -> tuple[socket.socket, int]:
    """A non-blocking connection started to ``target``, and connect's errno (0: connected)."""
    sock = socket.socket(target[0], socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock, sock.connect_ex(target[1])


def poke(fd: int) -> None:
    """Write a wake-up byte to the pipe ``fd``."""
    try:
        os.write(fd, b"!")
    except BlockingIOError:
        pass  # full: a wake-up is pending anyway


class Loop:
    """Sockets and the events each is watched for; ``wake()`` ends a ``turn`` early."""

    def __init__(self) -> None:
        self._handlers: dict[socket.socket, Callable[[int], None]] = {}
        self._masks: dict[socket.socket, int] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, READ, None)

    def handle(self, sock: socket.socket, handler: Callable[[int], None]) -> None:
        """``handler(events)`` is called for ``sock``'s events, once armed (``arm``)."""
        self._handlers[sock] = handler

    def watch(self, sock: socket.socket, handler: Callable[[int], None], mask: int = 0) -> None:
        """Call ``handler(events)`` for ``sock``'s events in ``mask``."""
        self.handle(sock, handler)
        self.arm(sock, mask)

    def arm(self, sock: socket.socket, mask: int) -> None:
        """Watch ``sock`` for the events in ``mask`` (0: none)."""
        old = self._masks.get(sock, 0)
        if mask == old:
            return
        if not mask:
            self._sel.unregister(sock)
            del self._masks[sock]
            return
        if old:
            self._sel.modify(sock, mask, self._handlers[sock])
        else:
            self._sel.register(sock, mask, self._handlers[sock])
        self._masks[sock] = mask

    def unwatch(self, sock: socket.socket) -> None:
        """Stop watching ``sock``, and forget its handler; the socket stays open."""
        self.arm(sock, 0)
        self._handlers.pop(sock, None)

    def forget(self, sock: socket.socket) -> None:
        """Stop watching ``sock`` and close it."""
        self.unwatch(sock)
        sock.close()

    def wake(self) -> None:
        """End the ``turn`` in progress, or the next one, at once (from any thread)."""
        poke(self._wake_w)

    def turn(self, timeout: float | None) -> None:
        """Wait for events (``timeout`` at most) and call the handlers of those that came."""
        for key, events in self._sel.select(timeout):
            if key.data is None:
                drain(self._wake_r)
            else:
                key.data(events)

    def close(self) -> None:
        """Close the selector and the wake-up pipe (the sockets are their owners')."""
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
