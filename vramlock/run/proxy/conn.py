"""One client's connection through the proxy, and whether an exchange is in progress."""

from __future__ import annotations

import socket
from collections import deque

from ...net.framing import Framing


class Flow:
    """One direction of a connection: bytes read from ``src`` go to ``dst``; what ``dst``
    did not take yet waits in ``buf``, and ``src`` is not read meanwhile."""

    __slots__ = ("buf", "dst", "eof", "src")

    def __init__(self, src: socket.socket, dst: socket.socket | None) -> None:
        self.src, self.dst = src, dst
        self.buf = bytearray()
        self.eof = False  # src sends no more

    @property
    def done(self) -> bool:
        """The end of the stream came, and every byte before it went on."""
        return self.eof and not self.buf


class Conn:
    """A client and, once forwarded, its connection to the upstream."""

    __slots__ = (
        "client",
        "connecting",
        "down",
        "last_down",
        "last_up",
        "parked",
        "requests",
        "responses",
        "up",
        "upstream",
    )

    def __init__(self, client: socket.socket, now: float) -> None:
        self.client = client
        self.upstream: socket.socket | None = None  # None: held
        self.connecting = False
        self.parked = False  # forwarded, but the client spoke while the gate was not open
        self.up = Flow(client, None)  # client -> upstream
        self.down: Flow | None = None  # upstream -> client
        # Accepting counts as traffic (for --idle): a new client is about to speak.
        self.last_up = self.last_down = now
        methods: deque[bytes] = deque()
        self.requests = Framing(responses=False, methods=methods)
        self.responses = Framing(responses=True, methods=methods)

    @property
    def waiting(self) -> bool:
        """Waits for the gate: held, or parked."""
        return self.upstream is None or self.parked

    def in_progress(self) -> bool:
        """Forwarded, and in the middle of an exchange: a request has begun and its
        response has not ended, or bytes wait for either side. Where the traffic is not
        HTTP/1.x, the client spoke last (an answer is awaited)."""
        if self.up.buf or (self.down is not None and self.down.buf):
            return True
        if self.requests.opaque or self.responses.opaque:
            return self.last_up > self.last_down
        return self.requests.started > self.responses.done

    def busy(self) -> bool:
        """Waits for the gate, connects, or is in an exchange."""
        return self.waiting or self.connecting or self.in_progress()
