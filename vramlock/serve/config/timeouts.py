"""``unloadTimeout`` and ``timeouts`` (a model's, a peer's), as serve reads them; what
they mean is in ``vramlock.serve.timeouts``."""

from __future__ import annotations

import dataclasses

import yaml

from ..timeouts import PEER_DEFAULTS, PEER_UNUSED, UNUSED, Timeouts
from .reader import Reader


def read_timeouts(reader: Reader, node: yaml.Node, where: str, peer: bool = False) -> Timeouts:
    """A model's (``peer``: a peer's) ``timeouts:`` mapping (``where``: whose, for
    messages)."""
    what = f"{where}: timeouts"
    entries = reader.entries(node, what)
    fields = [("connect", "connect"), ("responseHeader", "header")]
    if peer:
        fields.append(("tlsHandshake", "tls"))
    unused = PEER_UNUSED if peer else UNUSED
    reader.check_keys(entries, frozenset(n for n, _ in fields), dict(unused), f"{what}: ")
    given = {field: reader.number(entries[name][1], f"{what}: {name}", 0) or None
             for name, field in fields if name in entries}  # fmt: skip
    return dataclasses.replace(PEER_DEFAULTS if peer else Timeouts(), **given)


def read_unload_timeout(reader: Reader, node: yaml.Node, what: str) -> float | None:
    """``unloadTimeout``: seconds, 0 for none given here."""
    return reader.number(node, what, 0) or None
