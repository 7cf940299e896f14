"""llama-swap's ``unloadTimeout`` and per-model ``timeouts``, as serve reads them.

``unloadTimeout`` (seconds; top level, and per model where 0 means the top level's)
bounds an unload (the API's, a ttl's, one for the routing rules); past it serve stops
the model hard: it ends the model's wrapper, which ends its command. Without one an
unload waits up to healthCheckTimeout and a model that has not released by then keeps
running.

``timeouts``: ``connect`` (default 30 s) and ``responseHeader`` (default none) bound
serve's requests to the model (through its wrapper: the wait for the response's head
includes the time the model takes to come back); each past its bound is a 504 that
names it. 0 is no bound. The others mean nothing here, and say why.

A peer's ``timeouts`` have llama-swap's defaults for peers: ``connect`` 30 s,
``responseHeader`` 60 s and ``tlsHandshake`` 10 s (the TCP connection and its TLS
handshake are bounded together by their sum: the HTTP client times them as one).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CONNECT = 30.0
UNUSED = {
    "keepalive": "serve reaches each model on loopback, where TCP keepalives find nothing",
    "idleConn": "serve keeps idle connections to a model until its wrapper ends them",
    "tlsHandshake": "serve reaches each model over plain HTTP",
    "expectContinue": "serve sends no Expect: 100-continue",
}
PEER_UNUSED = {
    "keepalive": "the HTTP client keeps its own TCP settings",
    "idleConn": "the HTTP client closes idle connections after its own 15 s",
    "expectContinue": "serve sends no Expect: 100-continue",
}


@dataclass(frozen=True)
class Timeouts:
    """A model's (or a peer's) bounds on serve's requests to it, in seconds (None: no
    bound)."""

    connect: float | None = DEFAULT_CONNECT
    header: float | None = None  # responseHeader
    tls: float | None = None  # tlsHandshake (peers only)


PEER_DEFAULTS = Timeouts(DEFAULT_CONNECT, 60.0, 10.0)
