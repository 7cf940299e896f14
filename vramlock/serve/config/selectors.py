"""``selectors:`` and ``profiles:``: names resolved to a target per request (what they
do is in ``vramlock.serve.selectors``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from ..routing import Routing
from .models import Model, find
from .peers import Peer
from .reader import Reader

STRATEGIES = ("warm", "pin", "spillover")
SELECTOR_KEYS = frozenset(
    {"strategy", "targets", "settings", "name", "description", "unlisted", "metadata"}
)


@dataclass(frozen=True)
class Selector:
    """llama-swap's ``selectors.ID``: a name that picks one of its targets per request."""

    name: str
    line: int
    strategy: str  # warm, pin or spillover
    targets: tuple[str, ...]
    spillover: int = 1  # settings.spillover: requests per active target before the next
    title: str | None = None
    description: str | None = None
    unlisted: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """llama-swap's ``profiles.ID``: names replaced while it is the active profile."""

    name: str
    description: str
    pins: dict[str, str | None]  # None (or ""): the name answers 404 meanwhile


class Names:
    """The names a request may ask for, and what each one resolves to: a local model's
    name, or a peer's model as PEER/MODEL (a bare MODEL that one peer alone has)."""

    def __init__(self, models: dict[str, Model], peers: dict[str, Peer]) -> None:
        self.models = models
        self.local = set(models) | {a for m in models.values() for a in m.aliases}
        self.full = {f"{p.name}/{m}": f"{p.name}/{m}" for p in peers.values() for m in p.models}
        bare = [(m, f"{p.name}/{m}") for p in peers.values() for m in p.models]
        counts = [m for m, _ in bare]
        self.bare = {m: full for m, full in bare if counts.count(m) == 1}

    def resolve(self, name: str) -> str | None:
        model = find(self.models, name)
        if model is not None:
            return model.name
        return self.full.get(name) or self.bare.get(name)


def read_selectors(
    reader: Reader, node: yaml.Node, names: Names, rules: Routing
) -> dict[str, Selector]:
    """``selectors``: each a new name (no model, alias or PEER/MODEL has it), its
    strategy, its targets (known names; local models for warm; no selectors; for
    spillover, local models that the routing rules let be resident together)."""
    selectors = {n for n, _, _ in reader.pairs(node, "selectors")}
    out: dict[str, Selector] = {}
    for name, key, value in reader.pairs(node, "selectors"):
        where = f"selectors.{name}"
        if not name.strip():
            raise reader.fail(key, f"selectors: a selector's name cannot be blank ({name!r})")
        if name in names.local or name in names.full:
            raise reader.fail(key, f"{where}: a model, alias or peer model is named so")
        f = reader.keyed(value, where, SELECTOR_KEYS)
        strategy = reader.text(f["strategy"][1], f"{where}.strategy") if "strategy" in f else ""
        if strategy not in STRATEGIES:
            what = "is required" if not strategy else f"{strategy!r} is not warm, pin or spillover"
            raise reader.fail(f.get("strategy", (key, key))[1], f"{where}.strategy {what}")
        tnode = f["targets"][1] if "targets" in f else key
        targets = _targets(reader, tnode, where, strategy, names, selectors)
        if strategy == "spillover":
            _together(
                reader, tnode, where, [t for t in targets if find(names.models, t)], names, rules
            )
        spill = 1
        if "settings" in f:
            settings = reader.entries(f["settings"][1], where)
            if "spillover" in settings:
                spill = int(reader.number(settings["spillover"][1], f"{where}.spillover", 1))
        out[name] = Selector(name, key.start_mark.line + 1, strategy, targets, spill,
            reader.text(f["name"][1], where) if "name" in f else None,
            reader.text(f["description"][1], where) if "description" in f else None,
            "unlisted" in f and reader.flag(f["unlisted"][1], f"{where}.unlisted"),
            reader.params(f["metadata"][1], where) if "metadata" in f else {})  # fmt: skip
    return out


def _targets(
    reader: Reader, node: yaml.Node, where: str, strategy: str, names: Names, selectors: set[str]
) -> tuple[str, ...]:
    """A selector's targets: each a model, alias or peer's model, as llama-swap wants."""
    listed = reader.strings(node, f"{where}.targets") if isinstance(node, yaml.SequenceNode) else []
    if not listed:
        raise reader.fail(node, f"{where}.targets must have at least one entry")
    targets, resolved = [], []
    for i, target in enumerate(listed):
        if target in selectors:
            raise reader.fail(node, f"{where}.targets[{i}]: {target!r} is a selector")
        found = names.resolve(target)
        if found is None:
            raise reader.fail(node.value[i], f"{where}.targets[{i}] references unknown model"
                                             f" {target!r}")  # fmt: skip
        if strategy == "warm" and find(names.models, target) is None:
            raise reader.fail(node, f"{where}.targets[{i}]: warm picks local models only")
        if strategy == "spillover" and found in resolved:
            raise reader.fail(node, f"{where}.targets: {found!r} is there twice")
        targets.append(target)
        resolved.append(found)
    return tuple(targets)


def _together(
    reader: Reader, node: yaml.Node, where: str, local: list[str], names: Names, rules: Routing
) -> None:
    """Spillover's local targets must be resident together by the rules, as llama-swap
    checks it: one set of the matrix holds them all, or one group that does not swap.
    Without rules (``engine`` None) the arena decides: nothing to check."""
    models = {m.name for t in local if (m := find(names.models, t)) is not None}
    if len(models) < 2 or rules.engine is None:
        return
    if rules.engine == "matrix":
        if not any(models <= combo for _, combos in rules.sets for combo in combos):
            raise reader.fail(node, f"{where}.targets must all appear together in one"
                                    " expanded matrix set")  # fmt: skip
        return
    group = next((g for g in rules.groups if models <= set(g.members)), None)
    if group is None or group.swap:
        raise reader.fail(node, f"{where}: spillover targets must share a group with"
                                " swap: false")  # fmt: skip


def read_profiles(
    reader: Reader, node: yaml.Node, known: set[str], reserved: set[str]
) -> dict[str, Profile]:
    """``profiles``: each a mapping of description and pins (name: target, or null);
    a pin may not be named as a peer's PEER/MODEL (``reserved``)."""
    out: dict[str, Profile] = {}
    for name, key, value in reader.pairs(node, "profiles"):
        where = f"profiles.{name}"
        if not name.strip():
            raise reader.fail(key, f"profiles: a profile's name cannot be blank ({name!r})")
        if isinstance(value, yaml.SequenceNode):  # llama-swap refuses it too
            raise reader.fail(value, f"{where}: a list of models is llama-swap's old profile,"
                              " which it no longer takes either: for models resident"
                              " together, use a group with swap: false; a profile is a"
                              " mapping of description and pins")  # fmt: skip
        if not isinstance(value, yaml.MappingNode):
            raise reader.fail(value, f"{where}: a profile is a mapping of description and pins")
        f = reader.keyed(value, where, frozenset({"description", "pins"}))
        pins: dict[str, str | None] = {}
        pnode = f["pins"][1] if "pins" in f else key
        for pin, pkey, target in reader.pairs(pnode, f"{where}.pins") if "pins" in f else []:
            if not pin.strip():
                raise reader.fail(pkey, f"{where}.pins: a pin's name cannot be blank ({pin!r})")
            if pin in reserved:
                raise reader.fail(pkey, f"{where}.pins: {pin!r} is a peer's model")
            text = None if reader.value(target) is None else reader.text(target, where)
            if text and text not in known:  # another pin's name too: pins do not chain
                raise reader.fail(target, f"{where}.pins.{pin} references unknown model"
                                          f" {text!r}")  # fmt: skip
            pins[pin] = text or None
        if not pins:
            raise reader.fail(pnode, f"{where}.pins must have at least one entry")
        text = reader.text(f["description"][1], where) if "description" in f else ""
        out[name] = Profile(name, text, pins)
    return out
