"""llama-swap's routing: which models may be resident together, and whom serve releases
before a request's model is let in (``routing.router``, or the older top-level
``groups:`` and ``matrix:``), and the order queued requests are let in
(``routing.scheduler``).

- groups (``use: group``): a model is in one group at most; those in none make up a
  group of their own that swaps and is exclusive. Starting a model of a group that
  swaps releases the group's other models; one of an exclusive group releases the
  models of every other group, but those of persistent groups.
- matrix (``use: matrix``): named sets of models that may be resident together, each an
  expression of model names (or ``vars``) joined by ``&`` (together) and ``|`` (either),
  with ``()`` and ``+SET`` (another set's expression). Starting a model picks, among the
  sets' combinations that contain it, the one whose release costs least
  (``evict_costs``, 1 by default, summed over the resident models outside it; ties: the
  first defined), and releases the resident models outside it. A model in no set is
  resident alone.

Nothing is released for a request whose model is resident already.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from .config import ConfigError, _Reader

ENGINES = ("group", "matrix")
SCHEDULERS = ("fifo",)
DEFAULT_GROUP = "(default)"  # llama-swap's name for the models in no group
# What one set's expression may expand to: combinations multiply.
MAX_COMBINATIONS = 4096

_VAR = re.compile(r"[A-Za-z0-9.-]{1,32}")
_TOKEN = re.compile(r"\s*(?:(?P<op>[&|()])|\+(?P<ref>[\w.-]+)|(?P<name>[\w.-]+)|(?P<bad>\S))")


@dataclass(frozen=True)
class Group:
    name: str
    members: tuple[str, ...]
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False


@dataclass(frozen=True)
class Routing:
    """What the configuration says about routing; ``engine`` None: no rules (the
    arenas alone decide who is resident)."""

    engine: str | None = None
    groups: tuple[Group, ...] = ()
    sets: tuple[tuple[str, tuple[frozenset[str], ...]], ...] = ()  # matrix: by name, in order
    costs: dict[str, int] = field(default_factory=dict)  # matrix: evict_costs, by model
    priority: dict[str, int] = field(default_factory=dict)  # fifo: model -> priority
    line: int = 0  # where the rules are

    def evict(self, target: str, running: Iterable[str]) -> list[str]:
        """The resident models (``running``) to release before ``target`` starts:
        none when it is resident already."""
        resident = list(running)
        if self.engine is None or target in resident:
            return []
        return self._evict(target, resident)

    def _evict(self, target: str, resident: list[str]) -> list[str]:
        if self.engine == "group":
            return self._by_groups(target, resident)
        return self._by_matrix(target, resident)

    def _group(self, model: str) -> Group:
        found = next((g for g in self.groups if model in g.members), None)
        return found or Group(DEFAULT_GROUP, (model,))

    def _by_groups(self, target: str, resident: list[str]) -> list[str]:
        tg = self._group(target)
        out = []
        for m in resident:
            og = self._group(m)
            same = og.name == tg.name
            if (same and tg.swap) or (not same and tg.exclusive and not og.persistent):
                out.append(m)
        return out

    def _by_matrix(self, target: str, resident: list[str]) -> list[str]:
        best: frozenset[str] | None = None
        best_cost = 0
        for _, combos in self.sets:
            for combo in combos:
                if target not in combo:
                    continue
                cost = sum(self.costs.get(m, 1) for m in resident if m not in combo)
                if best is None or cost < best_cost:
                    best, best_cost = combo, cost
        return [m for m in resident if best is None or m not in best]

    def together(self, a: str, b: str) -> bool:
        """May ``a`` and ``b`` be resident together by the rules?"""
        if self.engine is None:
            return True
        return a not in self._evict(b, [a]) or b not in self._evict(a, [b])


# -- reading the configuration ---------------------------------------------------------


def read(reader: _Reader, top: dict[str, tuple[yaml.Node, yaml.Node]], models: set[str]) -> Routing:
    """``routing:``, ``groups:`` and ``matrix:`` of the file's top level."""
    router: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    scheduler: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    if "routing" in top:
        entries = _entries(reader, top["routing"][1], "routing")
        reader.check_keys(entries, frozenset({"router", "scheduler"}), {}, "routing: ")
        if "router" in entries:
            router = _entries(reader, entries["router"][1], "routing.router")
            reader.check_keys(router, frozenset({"use", "settings"}), {}, "routing.router: ")
        if "scheduler" in entries:
            scheduler = _entries(reader, entries["scheduler"][1], "routing.scheduler")
            known = frozenset({"use", "settings"})
            reader.check_keys(scheduler, known, {}, "routing.scheduler: ")
    legacy = [k for k in ("groups", "matrix") if k in top]
    if legacy and router:
        raise reader.fail(top[legacy[0]][0], f"{legacy[0]}: give routing.router or the"
                                             " top-level groups/matrix, not both")  # fmt: skip
    if len(legacy) == 2:
        raise reader.fail(top["matrix"][0], "matrix: give groups or matrix, not both")
    priority = _scheduler(reader, scheduler, models)
    if legacy:
        name = legacy[0]
        rules = _engine(reader, name if name == "matrix" else "group", top[name][1], models)
        line = top[name][0].start_mark.line + 1
    elif router:
        rules, line = _router(reader, router, models), _line(router)
    else:
        return Routing(priority=priority)
    return Routing(engine=rules.engine, groups=rules.groups, sets=rules.sets,
                   costs=rules.costs, priority=priority, line=line)  # fmt: skip


def _line(router: dict[str, tuple[yaml.Node, yaml.Node]]) -> int:
    key = next(iter(router.values()))[0]
    return key.start_mark.line + 1


def _entries(reader: _Reader, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    return {name: (key, value) for name, key, value in reader.pairs(node, what)}


def _router(
    reader: _Reader, router: dict[str, tuple[yaml.Node, yaml.Node]], models: set[str]
) -> Routing:
    use = "group"
    if "use" in router:
        use = reader.text(router["use"][1], "routing.router.use")
        if use not in ENGINES:
            raise reader.fail(router["use"][1], f"routing.router.use: unknown router {use!r}"
                                                " (group or matrix)")  # fmt: skip
    settings: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    if "settings" in router:
        settings = _entries(reader, router["settings"][1], "routing.router.settings")
        known = frozenset({"groups", "matrix"})
        reader.check_keys(settings, known, {}, "routing.router.settings: ")
    if use == "matrix" and "matrix" not in settings:
        where = router["use"][1]
        raise reader.fail(where, "routing.router.use is matrix, but"
                                 " routing.router.settings has no matrix")  # fmt: skip
    key = "matrix" if use == "matrix" else "groups"
    if key not in settings:
        return Routing(engine="group")  # no groups: every model in the default one
    return _engine(reader, use, settings[key][1], models, f"routing.router.settings.{key}")


def _engine(
    reader: _Reader, use: str, node: yaml.Node, models: set[str], what: str = ""
) -> Routing:
    if use == "matrix":
        return _matrix(reader, node, models, what or "matrix")
    return Routing(engine="group", groups=_groups(reader, node, models, what or "groups"))


def _scheduler(
    reader: _Reader, scheduler: dict[str, tuple[yaml.Node, yaml.Node]], models: set[str]
) -> dict[str, int]:
    """routing.scheduler: fifo (the only one), and its priorities."""
    if "use" in scheduler:
        use = reader.text(scheduler["use"][1], "routing.scheduler.use")
        if use not in SCHEDULERS:
            raise reader.fail(scheduler["use"][1], "routing.scheduler.use: unknown scheduler"
                                                   f" {use!r} (fifo)")  # fmt: skip
    if "settings" not in scheduler:
        return {}
    where = "routing.scheduler.settings"
    settings = _entries(reader, scheduler["settings"][1], where)
    reader.check_keys(settings, frozenset({"fifo"}), {}, f"{where}: ")
    if "fifo" not in settings:
        return {}
    fifo = _entries(reader, settings["fifo"][1], f"{where}.fifo")
    reader.check_keys(fifo, frozenset({"priority"}), {}, f"{where}.fifo: ")
    if "priority" not in fifo:
        return {}
    out = {}
    for name, key, value in reader.pairs(fifo["priority"][1], f"{where}.fifo.priority"):
        number = reader.value(value)
        if not isinstance(number, int) or isinstance(number, bool):
            raise reader.fail(value, f"{where}.fifo.priority: {name}'s must be a whole number")
        if name not in models:
            # llama-swap's own example names models it does not define (A to D): a
            # priority of no model can order nothing, so it is left out, said once.
            reader.warn(key, f"{where}.fifo.priority: no model {name!r}: left out")
            continue
        out[name] = number
    return out


def _groups(reader: _Reader, node: yaml.Node, models: set[str], what: str) -> tuple[Group, ...]:
    groups: list[Group] = []
    taken: dict[str, str] = {}  # model -> its group
    known = frozenset({"swap", "exclusive", "persistent", "members"})
    for name, key, value in reader.pairs(node, what):
        where = f"{what}: group {name!r}"
        fields = _entries(reader, value, where)
        reader.check_keys(fields, known, {}, f"{where}: ")
        if "members" not in fields:
            raise reader.fail(key, f"{where}: no members")
        members = fields["members"][1]
        if not isinstance(members, yaml.SequenceNode):
            raise reader.fail(members, f"{where}: members must be a list")
        names: list[str] = []
        for item in members.value:
            model = reader.text(item, f"{where}: members")
            if model in taken:
                raise reader.fail(item, f"{where}: model {model!r} is in group"
                                        f" {taken[model]!r} already")  # fmt: skip
            taken[model] = name
            if model not in models:
                # llama-swap takes such a member too (its own example has some).
                reader.warn(item, f"{where}: no model {model!r}: left out of the group")
                continue
            names.append(model)
        flags = {k: reader.flag(fields[k][1], f"{where}: {k}") for k in known - {"members"}
                 if k in fields}  # fmt: skip
        groups.append(Group(name, tuple(names), **flags))
    return tuple(groups)


def _matrix(reader: _Reader, node: yaml.Node, models: set[str], what: str) -> Routing:
    fields = _entries(reader, node, what)
    reader.check_keys(fields, frozenset({"vars", "evict_costs", "sets"}), {}, f"{what}: ")
    names: dict[str, str] = {m: m for m in models}  # a var before a model of its name
    if "vars" in fields:
        for var, key, value in reader.pairs(fields["vars"][1], f"{what}.vars"):
            if not _VAR.fullmatch(var):
                raise reader.fail(key, f"{what}.vars: bad name {var!r} (1-32 letters,"
                                       " digits, '-' or '.')")  # fmt: skip
            model = reader.text(value, f"{what}.vars: {var}")
            if model not in models:
                raise reader.fail(value, f"{what}.vars: {var}: no model {model!r}")
            names[var] = model
    costs = {}
    if "evict_costs" in fields:
        for name, key, value in reader.pairs(fields["evict_costs"][1], f"{what}.evict_costs"):
            if name not in names:
                raise reader.fail(key, f"{what}.evict_costs: no var or model {name!r}")
            cost = reader.value(value)
            if not isinstance(cost, int) or isinstance(cost, bool) or cost <= 0:
                raise reader.fail(value, f"{what}.evict_costs: {name}'s must be a whole"
                                         " number above 0")  # fmt: skip
            costs[names[name]] = cost
    if "sets" not in fields:
        raise reader.fail(node, f"{what}: no sets")
    sets = _Sets(reader, f"{what}.sets", names).read(fields["sets"][1])
    return Routing(engine="matrix", sets=sets, costs=costs)


class _Sets:
    """A matrix's sets: each expression parsed, its ``+SET`` references followed
    (a cycle is an error), and expanded into the combinations it allows."""

    def __init__(self, reader: _Reader, what: str, names: dict[str, str]) -> None:
        self.reader, self.what, self.names = reader, what, names
        self.nodes: dict[str, yaml.Node] = {}
        self.texts: dict[str, str] = {}
        self.done: dict[str, tuple[frozenset[str], ...]] = {}
        self.visiting: list[str] = []

    def read(self, node: yaml.Node) -> tuple[tuple[str, tuple[frozenset[str], ...]], ...]:
        for name, _, value in self.reader.pairs(node, self.what):
            self.nodes[name] = value
            self.texts[name] = self.reader.text(value, f"{self.what}: {name}")
        if not self.nodes:
            raise self.reader.fail(node, f"{self.what}: no sets")
        return tuple((name, self.expand(name)) for name in self.nodes)

    def expand(self, name: str) -> tuple[frozenset[str], ...]:
        if name in self.done:
            return self.done[name]
        if name in self.visiting:
            cycle = " -> ".join([*self.visiting[self.visiting.index(name) :], name])
            raise self.reader.fail(self.nodes[name], f"{self.what}: a cycle: {cycle}")
        self.visiting.append(name)
        parser = _Parser(self, name)
        self.done[name] = parser.parse()
        self.visiting.pop()
        return self.done[name]

    def fail(self, name: str, what: str) -> ConfigError:
        return self.reader.fail(self.nodes[name], f"{self.what}: {name}: {what}")


class _Parser:
    """One set's expression: ``or := and ('|' and)*``, ``and := atom ('&' atom)*``,
    ``atom := NAME | +SET | '(' or ')'``; each value the combinations it allows."""

    def __init__(self, sets: _Sets, name: str) -> None:
        self.sets, self.name = sets, name
        self.tokens = self._tokens(sets.texts[name])
        self.at = 0

    def _tokens(self, text: str) -> list[tuple[str, str]]:
        out = []
        for m in _TOKEN.finditer(text):
            if m.group("bad"):
                raise self.sets.fail(self.name, f"unexpected character {m.group('bad')!r}")
            kind = next(k for k in ("op", "ref", "name") if m.group(k))
            out.append((kind, m.group(kind)))
        if not out:
            raise self.sets.fail(self.name, "the expression is empty")
        return out

    def parse(self) -> tuple[frozenset[str], ...]:
        combos = self._or()
        if self.at < len(self.tokens):
            raise self.sets.fail(self.name, f"unexpected {self.tokens[self.at][1]!r}")
        return tuple(dict.fromkeys(combos))

    def _peek(self) -> str | None:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else None

    def _or(self) -> list[frozenset[str]]:
        combos = self._and()
        while self._peek() == "|":
            self.at += 1
            combos = combos + self._and()
            self._check(len(combos))
        return combos

    def _and(self) -> list[frozenset[str]]:
        combos = self._atom()
        while self._peek() == "&":
            self.at += 1
            right = self._atom()
            self._check(len(combos) * len(right))
            combos = [a | b for a in combos for b in right]
        return combos

    def _check(self, count: int) -> None:
        if count > MAX_COMBINATIONS:
            raise self.sets.fail(self.name, f"expands to more than {MAX_COMBINATIONS}"
                                            " combinations")  # fmt: skip

    def _atom(self) -> list[frozenset[str]]:
        if self.at >= len(self.tokens):
            raise self.sets.fail(self.name, "the expression ends too soon")
        kind, value = self.tokens[self.at]
        self.at += 1
        if kind == "name":
            if value not in self.sets.names:
                raise self.sets.fail(self.name, f"no var or model {value!r}")
            return [frozenset({self.sets.names[value]})]
        if kind == "ref":
            if value not in self.sets.nodes:
                raise self.sets.fail(self.name, f"+{value}: no set {value!r}")
            return list(self.sets.expand(value))
        if value != "(":
            raise self.sets.fail(self.name, f"unexpected {value!r}")
        combos = self._or()
        if self._peek() != ")":
            raise self.sets.fail(self.name, "a '(' is not closed")
        self.at += 1
        return combos
