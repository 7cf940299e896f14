"""A model's (or a peer's) ``useModelName`` and ``filters``: what is changed in a
request's JSON body before it is sent on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from .reader import Reader

FILTER_KEYS = frozenset({"stripParams", "setParams", "setParamsByID"})
# llama-swap's older spelling of stripParams, still read for models (not peers).
LEGACY_STRIP = "strip_params"


@dataclass(frozen=True)
class Filters:
    """What is changed in a request's JSON body before its model gets it: llama-swap's
    useModelName and filters (``model`` itself is never stripped or set by them)."""

    model: str | None = None  # useModelName
    strip: tuple[str, ...] = ()  # stripParams
    set: dict[str, Any] = field(default_factory=dict)  # setParams
    by_name: dict[str, dict[str, Any]] = field(default_factory=dict)  # setParamsByID

    def __bool__(self) -> bool:
        return bool(self.model or self.strip or self.set or self.by_name)

    def apply(self, body: dict[str, Any], asked: str) -> dict[str, Any]:
        """``body`` as the model gets it, asked for by the name ``asked``."""
        out = {k: v for k, v in body.items() if k == "model" or k not in self.strip}
        for params in (self.set, self.by_name.get(asked, {})):
            out.update((k, v) for k, v in params.items() if k != "model")
        if self.model is not None:
            out["model"] = self.model
        return out


def read_filters(
    reader: Reader, node: yaml.Node, where: str, model: str | None, *, legacy: bool = False
) -> Filters:
    """``filters``: stripParams (``legacy``: or strip_params, where stripParams is
    empty, as llama-swap reads a model's), setParams, setParamsByID."""
    entries = reader.entries(node, where)
    known = FILTER_KEYS | ({LEGACY_STRIP} if legacy else set())
    reader.check_keys(entries, known, {}, f"{where}: ")
    strip: tuple[str, ...] = ()
    for key in ("stripParams", LEGACY_STRIP) if legacy else ("stripParams",):
        if key in entries and not strip:
            text = reader.text(entries[key][1], f"{where}: {key}")
            strip = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    params = reader.params(entries["setParams"][1], where) if "setParams" in entries else {}
    by_name = {}
    if "setParamsByID" in entries:
        by_id = entries["setParamsByID"][1]
        for name, _, value in reader.pairs(by_id, f"{where}: setParamsByID"):
            by_name[name] = reader.params(value, where)
    return Filters(model=model, strip=strip, set=params, by_name=by_name)
