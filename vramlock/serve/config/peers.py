"""``peers:``: remote OpenAI-compatible servers, each with the models it serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import yaml

from ..timeouts import PEER_DEFAULTS, Timeouts
from .filters import Filters, read_filters
from .models import Model, find, plain_url
from .reader import Reader
from .timeouts import read_timeouts

PEER_KEYS = frozenset({"proxy", "models", "apiKey", "filters", "timeouts"})


@dataclass(frozen=True)
class Peer:
    """llama-swap's ``peers.ID``: a remote OpenAI-compatible server, no process here."""

    name: str
    line: int
    base: str  # ``proxy``: the request's path is appended to it
    models: tuple[str, ...]
    api_key: str = ""  # sent as Authorization: Bearer and x-api-key ("": nothing)
    filters: Filters = field(default_factory=Filters)
    timeouts: Timeouts = PEER_DEFAULTS  # connect, responseHeader, tlsHandshake


def read_peers(reader: Reader, node: yaml.Node, models: dict[str, Model]) -> dict[str, Peer]:
    """``peers``: each with proxy (an http(s) URL) and models (not empty), apiKey and
    filters; a PEER/MODEL name that a local model or alias has is refused, as is one
    that two peers make."""
    peers: dict[str, Peer] = {}
    made: dict[str, str] = {}  # PEER/MODEL -> the peer that makes it
    for name, key, value in reader.pairs(node, "peers"):
        where = f"peer {name!r}"
        fields = reader.keyed(value, where, PEER_KEYS)
        if "proxy" not in fields:
            raise reader.fail(key, f"{where}: proxy is required")
        pnode = fields["proxy"][1]
        base = reader.text(pnode, f"{where}: proxy")
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.netloc or not plain_url(base):
            raise reader.fail(pnode, f"{where}: proxy must be an http(s)://HOST[:PORT] URL,"
                                     " without spaces or control characters")  # fmt: skip
        listed = (
            reader.strings(fields["models"][1], f"{where}: models") if "models" in fields else []
        )
        if not listed:
            raise reader.fail(key, f"{where}: models must not be empty")
        for model in dict.fromkeys(listed):
            full = f"{name}/{model}"
            if find(models, full) is not None:
                what = f"{where}: {full} is already a local model's name or alias"
                raise reader.fail(fields["models"][1], what)
            if full in made:
                what = f"{where}: {full} is also peer {made[full]!r}'s model: which is meant?"
                raise reader.fail(fields["models"][1], what)
            made[full] = name
        api_key = reader.text(fields["apiKey"][1], f"{where}: apiKey") if "apiKey" in fields else ""
        filters = Filters()
        if "filters" in fields:
            filters = read_filters(reader, fields["filters"][1], f"{where}: filters", None)
        bounds = PEER_DEFAULTS
        if "timeouts" in fields:
            bounds = read_timeouts(reader, fields["timeouts"][1], where, peer=True)
        peers[name] = Peer(name, key.start_mark.line + 1, base.rstrip("/"),
                           tuple(dict.fromkeys(listed)), api_key, filters, bounds)  # fmt: skip
    return peers
