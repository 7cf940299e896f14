"""A matrix (``routing.router.settings.matrix``, or the older top-level ``matrix:``):
its vars, evict_costs and sets, each set's expression expanded into the combinations
of models it allows."""

from __future__ import annotations

import re

import yaml

from ..routing import Routing
from .reader import ConfigError, Reader

# What one set's expression may expand to: combinations multiply. llama-swap's own
# tests have a set of 11**4 (four models, each one of eleven, with a fifth).
MAX_COMBINATIONS = 1 << 15

_VAR = re.compile(r"[A-Za-z0-9.-]{1,32}")
_TOKEN = re.compile(r"\s*(?:(?P<op>[&|()])|\+(?P<ref>[\w.-]+)|(?P<name>[\w.-]+)|(?P<bad>\S))")


def read_matrix(reader: Reader, node: yaml.Node, models: set[str], what: str) -> Routing:
    fields = reader.entries(node, what)
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

    def __init__(self, reader: Reader, what: str, names: dict[str, str]) -> None:
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
