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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import yaml

    from .config import _Reader

DEFAULT_CONNECT = 30.0
UNUSED = {
    "keepalive": "serve reaches each model on loopback, where TCP keepalives find nothing",
    "idleConn": "serve keeps idle connections to a model until its wrapper ends them",
    "tlsHandshake": "serve reaches each model over plain HTTP",
}


@dataclass(frozen=True)
class Timeouts:
    """A model's bounds on serve's requests to it, in seconds (None: no bound)."""

    connect: float | None = DEFAULT_CONNECT
    header: float | None = None  # responseHeader


def read_timeouts(reader: _Reader, node: yaml.Node, where: str) -> Timeouts:
    """A model's ``timeouts:`` mapping (``where``: the model, for messages)."""
    what = f"{where}: timeouts"
    entries = {name: (key, value) for name, key, value in reader.pairs(node, what)}
    known = frozenset({"connect", "responseHeader"})
    reader.check_keys(entries, known, {k: f"{v}" for k, v in UNUSED.items()}, f"{what}: ")
    bounds: dict[str, float | None] = {}
    for name, field in (("connect", "connect"), ("responseHeader", "header")):
        if name in entries:
            seconds = reader.number(entries[name][1], f"{what}: {name}", 0)
            bounds[field] = seconds or None
    return Timeouts(**bounds)


def read_unload_timeout(reader: _Reader, node: yaml.Node, what: str) -> float | None:
    """``unloadTimeout``: seconds, 0 for none given here."""
    return reader.number(node, what, 0) or None
