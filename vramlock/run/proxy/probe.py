"""Waiting for the upstream after a start or restore: is it ready to be forwarded to?

Ready: ``GET ready_url`` answers 2xx, or without a ready_url, a TCP connection is
accepted (that connection then serves the first client). The addresses the upstream
resolves to are tried in turn.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from ...net.address import Target, show
from .loop import PENDING, READ, WRITE, Loop, connect_to

# How often the upstream is probed while a restored server is starting, and how long
# one probe may take (a server that accepts and does not answer yet).
PROBE_EVERY = 0.05
PROBE_TIMEOUT = 1.0
_REPLY_MAX = 4096  # a status line longer than this is no answer


class Probe:
    """One probe at a time. ``ready(sock)`` is called once the upstream is ready (``sock``:
    a connection to it for the first client, or None); ``retry()`` once a probe failed
    (the next should come ``PROBE_EVERY`` later); ``starve(err)`` when no socket could
    be had; ``vet()``, once a connection is made, whether what accepted it may be asked.
    ``answer`` says what the last probe got, for a warning."""

    def __init__(
        self,
        loop: Loop,
        upstreams: list[Target],
        ready_url: str | None,
        *,
        ready: Callable[[socket.socket | None], None],
        retry: Callable[[], None],
        starve: Callable[[OSError], None],
        vet: Callable[[], bool] | None = None,
    ) -> None:
        self._loop, self._upstreams, self.ready_url = loop, upstreams, ready_url
        self._vet = vet  # False: the listener that accepted is not to be asked
        self._ready, self._retry, self._starve = ready, retry, starve
        self.target = upstreams[0]  # the upstream address that accepted last
        self.until = 0.0  # when a probe that has no answer yet fails
        self.answer = ""
        self._sock: socket.socket | None = None  # a probe's connection in progress
        self._reply: bytearray | None = None  # None: the probe is connecting

    @property
    def active(self) -> bool:
        """A probe is under way."""
        return self._sock is not None

    def start(self) -> None:
        """Connect to the current target, and ask it if there is a ready_url."""
        try:
            sock, code = connect_to(self.target)
        except OSError as err:  # EMFILE: try again once some are free
            self._starve(err)
            self._next()
            return
        if code not in (0, *PENDING):
            sock.close()
            self.answer = "connection refused"
            self._next()
            return
        self._sock, self.until, self._reply = sock, time.monotonic() + PROBE_TIMEOUT, None
        self._loop.watch(sock, self._on_event, WRITE)

    def timed_out(self) -> None:
        """The probe under way got no answer within ``PROBE_TIMEOUT``."""
        self.answer = self.answer or "no answer"
        self.failed()

    def failed(self) -> None:
        """Not ready: the next address, a little later."""
        self.stop()
        self._next()

    def stop(self) -> None:
        """End the probe under way, if any."""
        if self._sock is not None:
            self._loop.forget(self._sock)
            self._sock = None

    def _next(self) -> None:
        i = self._upstreams.index(self.target)
        self.target = self._upstreams[(i + 1) % len(self._upstreams)]
        self._retry()

    def _on_event(self, events: int) -> None:
        sock = self._sock
        assert sock is not None
        if self._reply is not None:
            self._read(sock)
        elif sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.answer = "connection refused"
            self.failed()
        elif self._vet is not None and not self._vet():
            self.answer = "the port is not the command's"
            self.failed()  # nothing sent to it
        elif self.ready_url is None:
            self._loop.unwatch(sock)
            self._sock = None
            self._ready(sock)  # its connection serves the first client
        else:
            self._ask(sock)

    def _ask(self, sock: socket.socket) -> None:
        """Send the readiness request (small: a fresh connection takes it at once)."""
        host = show(self.target[1])
        request = (
            f"GET {self.ready_url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            sent = sock.send(request)
        except OSError as err:
            sent, self.answer = 0, (err.strerror or str(err)).lower()
        if sent != len(request):
            self.failed()
            return
        self.answer = ""
        self._reply = bytearray()
        self._loop.arm(sock, READ)

    def _read(self, sock: socket.socket) -> None:
        assert self._reply is not None
        try:
            data = sock.recv(_REPLY_MAX)
        except OSError as err:
            data, self.answer = b"", (err.strerror or str(err)).lower()
        if not data:
            self.answer = self.answer or "the connection was closed without an answer"
            self.failed()
            return
        self._reply += data
        line, crlf, _ = bytes(self._reply).partition(b"\r\n")
        if not crlf and len(self._reply) < _REPLY_MAX:
            return  # more to come
        parts = line.split()
        status = parts[1].decode(errors="replace") if len(parts) > 1 else "no status"
        if len(parts) > 1 and parts[0].startswith(b"HTTP/") and status[:1] == "2":
            self.stop()
            self._ready(None)
        else:
            self.answer = f"GET {self.ready_url} answered {status[:20]}"
            self.failed()
