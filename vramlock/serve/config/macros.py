"""llama-swap's macros, expanded in the node tree before any key is read.

- ``${env.VAR}``: first, in every value and key of the file (comments aside), from the
  environment; an unset variable, or a value holding CR, LF or NUL, is refused.
- ``macros:`` (top level, and per model: a model's own replaces a global one of its name
  in place): ordered; ``${NAME}`` is expanded in every value of the known top-level keys
  (global macros) and of each model (its scope: ``MODEL_ID``, the global macros, its
  own), the macros taken last to first, so that a macro may use those defined before it,
  and a model's macro is seen inside the global macros that use its name. A value that
  is one macro alone takes the macro's type (``ttl: ${t}`` is a number).
- ``${PORT}``: handed out from ``startPort`` in the models' sorted IDs (as llama-swap),
  to each model whose ``cmd`` uses it; a ``proxy`` (the default one included:
  ``http://localhost:${PORT}``) may use it only then.
- ``${PID}``: left for ``cmdStop``. Anything else of the form ``${NAME}`` left once
  expanded is an unknown macro: refused.
"""

from __future__ import annotations

import decimal
import math
import os
import re
from typing import Any

import yaml

from .reader import MAX_VALUES, MERGE, NULL, ConfigError, Reader

STR = "tag:yaml.org,2002:str"
_TAGS = {bool: "tag:yaml.org,2002:bool", int: "tag:yaml.org,2002:int",
         float: "tag:yaml.org,2002:float", str: STR}  # fmt: skip
MACRO = re.compile(r"\$\{([A-Za-z0-9_-]+)\}")
_ENV = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,63}")
RESERVED = frozenset({"PID", "PORT", "MODEL_ID"})
DEFAULT_PROXY = "http://localhost:${PORT}"
# What one value may expand to: macros that double each other must not exhaust memory.
MAX_EXPANDED = 1 << 20

Macros = list[tuple[str, Any]]  # (name, value), in the order they are defined


class _TooBig(Exception):
    pass


def expand_file(
    reader: Reader, root: yaml.MappingNode, known: frozenset[str], default_port: int
) -> dict[str, int]:
    """Expand every macro of the file in place (see the module); the port each model
    that uses ``${PORT}`` was given."""
    _environment(reader, root)
    top = reader.entries(root, "the file")
    global_ = declare(reader, top["macros"][1], "macros") if "macros" in top else []
    for name, (key, value) in top.items():
        if name in known and name not in ("models", "macros"):
            top[name] = (key, _Expander(reader, global_, name).field(value))
            _check(reader, top[name][1], name, pid=False)
    root.value = list(top.values())
    start = reader.port(top["startPort"][1]) if "startPort" in top else default_port
    models = top["models"][1] if "models" in top else None
    if not isinstance(models, yaml.MappingNode):
        return {}
    entries = reader.pairs(models, "models")
    done: dict[str, yaml.Node] = {}
    ports: dict[str, int] = {}
    for name, key, node in sorted(entries, key=lambda e: e[0]):  # code points: Go's order
        done[name], uses_port = _model(reader, global_, name, key, node, start + len(ports))
        if uses_port:
            ports[name] = start + len(ports)
    models.value = [(key, done[name]) for name, key, _ in entries]
    return ports


def parse(reader: Reader, text: str, path: str | None = None) -> yaml.MappingNode:
    """The file's top-level mapping. Where it is no valid YAML but holds ``${env.``,
    the variables are put in its text first, as llama-swap does (``apiKeys:
    [${env.KEY}]`` is YAML only once expanded); else they are put in its values."""
    try:
        return reader.root(text, path)
    except ConfigError:
        if "${env." not in text:
            raise
    mark = yaml.Mark(path or reader.path, 0, 0, 0, None, None)  # type: ignore[arg-type]
    at = yaml.ScalarNode(STR, "", mark, mark)
    expanded = _ENV.sub(lambda m: _escaped(_variable(reader, at, m.group(1))), text)
    return reader.root(expanded, path)


def _escaped(value: str) -> str:
    """A value put in YAML text, escaped for a double-quoted string (llama-swap's)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def declare(reader: Reader, node: yaml.Node, where: str) -> Macros:
    """A ``macros:`` mapping: names of letters, digits, ``_`` and ``-`` (not reserved),
    values that are strings, numbers or true/false, none naming itself."""
    out: Macros = []
    for name, key, value in reader.pairs(node, where):
        if not _NAME.fullmatch(name) or name in RESERVED:
            raise reader.fail(key, f"{where}: bad name {name!r} (letters, digits, _, -;"
                                   " not PID, PORT, MODEL_ID)")  # fmt: skip
        raw = reader.value(value)
        if not isinstance(raw, str | int | float):
            raise reader.fail(value, f"{where}: {name} must be a string, a number or a flag")
        if isinstance(raw, str) and f"${{{name}}}" in raw:
            raise reader.fail(value, f"{where}: {name} uses itself")
        out.append((name, raw))
    return out


def _model(
    reader: Reader, global_: Macros, name: str, key: yaml.Node, node: yaml.Node, port: int
) -> tuple[yaml.Node, bool]:
    """One model's entry with its macros expanded, and whether it takes ``port``."""
    if not isinstance(node, yaml.MappingNode):
        return node, False  # the models' reader says what is wrong
    where = f"model {name!r}"
    fields = reader.entries(node, where)
    own = declare(reader, fields["macros"][1], f"{where}: macros") if "macros" in fields else []
    scope: Macros = [("MODEL_ID", name), *global_]
    for macro in own:
        at = next((i for i, (n, _) in enumerate(scope) if n == macro[0]), None)
        if at is None:
            scope.append(macro)
        else:
            scope[at] = macro  # in its place: global macros that use it see it
    given = "proxy" in fields and fields["proxy"][1].tag != NULL
    if not given:
        marks = key.start_mark, key.end_mark
        fields["proxy"] = (
            yaml.ScalarNode(STR, "proxy", *marks),
            yaml.ScalarNode(STR, DEFAULT_PROXY, *marks),
        )
    for field in ("cmd", "cmdStop"):
        if field in fields and fields[field][1].tag == STR:
            k, v = fields[field]
            text = "\n".join(ln for ln in v.value.split("\n") if not ln.strip().startswith("#"))
            style = getattr(v, "style", None)
            fields[field] = (k, yaml.ScalarNode(STR, text, v.start_mark, v.end_mark, style))
    out = _Expander(reader, scope, where).model(fields)
    cmd, proxy = (_scalar(out, f) for f in ("cmd", "proxy"))
    uses_port = "${PORT}" in cmd
    if "${PORT}" in proxy and not uses_port:
        said = "proxy" if given else f"the default proxy {DEFAULT_PROXY}"
        raise reader.fail(out["proxy"][1], f"{where}: {said} uses ${{PORT}}, but cmd does"
                                          " not: ${PORT} is given to a model whose cmd"
                                          " uses it")  # fmt: skip
    if uses_port:
        out = _Expander(reader, [("PORT", port)], where).model(out)
    for field, (_, value) in out.items():
        if field != "macros":
            _check(reader, value, f"{where}: {field}", pid=field == "cmdStop")
    by_id = _by_id_node(reader, out, where)
    for key, _ in by_id.value if by_id is not None else ():
        _check(reader, key, f"{where}: filters.setParamsByID", pid=False)
    pairs = list(out.values())
    return yaml.MappingNode(
        node.tag, pairs, node.start_mark, node.end_mark, node.flow_style
    ), uses_port


def _scalar(fields: dict[str, tuple[yaml.Node, yaml.Node]], name: str) -> str:
    node = fields[name][1] if name in fields else None
    return node.value if isinstance(node, yaml.ScalarNode) and node.tag == STR else ""


class _Expander:
    """Copies of nodes with ``macros`` expanded (aliases are copied where they are
    used: a model's macros must not reach another model through an anchor)."""

    def __init__(self, reader: Reader, macros: Macros, where: str) -> None:
        self.reader, self.where = reader, where
        self.macros = [(f"${{{n}}}", v, _text(v)) for n, v in reversed(macros)]
        self.left = MAX_VALUES

    def model(
        self, fields: dict[str, tuple[yaml.Node, yaml.Node]]
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        out = {n: (k, v if n == "macros" else self.field(v)) for n, (k, v) in fields.items()}
        by_id = _by_id_node(self.reader, out, self.where)
        if by_id is not None:
            self._by_id(by_id)
        return out

    def field(self, node: yaml.Node) -> yaml.Node:
        self.left = MAX_VALUES
        try:
            return self._copy(node)
        except _TooBig:
            raise self.reader.fail(node, f"a value of more than {MAX_VALUES} values"
                                         " (aliases of aliases?)") from None  # fmt: skip

    def _copy(self, node: yaml.Node) -> yaml.Node:
        self.left -= 1
        if self.left < 0:
            raise _TooBig
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node)
        if isinstance(node, yaml.SequenceNode):
            items = [self._copy(item) for item in node.value]
            return yaml.SequenceNode(
                node.tag, items, node.start_mark, node.end_mark, node.flow_style
            )
        pairs = [(k, self._copy(v)) for k, v in node.value]
        flow = getattr(node, "flow_style", None)
        return yaml.MappingNode(node.tag, pairs, node.start_mark, node.end_mark, flow)

    def _scalar(self, node: yaml.ScalarNode) -> yaml.ScalarNode:
        if node.tag != STR or "${" not in node.value:
            return node
        value, tag = node.value, STR
        for slug, macro, text in self.macros:
            if value == slug:  # the macro alone: its value, typed
                value, tag = text, _TAGS[type(macro)]
                if tag != STR:
                    break
            elif slug in value:
                value = self._replace(node, value, slug, text)
        return yaml.ScalarNode(tag, value, node.start_mark, node.end_mark, node.style)

    def _replace(self, node: yaml.Node, value: str, slug: str, text: str) -> str:
        if len(value) + value.count(slug) * (len(text) - len(slug)) > MAX_EXPANDED:
            limit = f"{MAX_EXPANDED >> 20} MiB"
            raise self.reader.fail(node, f"{self.where}: its macros expand to more than {limit}")
        return value.replace(slug, text)

    def _by_id(self, by_id: yaml.MappingNode) -> None:
        """setParamsByID's keys, expanded (llama-swap's: no other key is)."""
        seen: dict[str, str] = {}
        pairs = []
        for name, key, value in self.reader.pairs(by_id, f"{self.where}: setParamsByID"):
            text = name
            for slug, _, replacement in self.macros:
                if slug in text:
                    text = self._replace(key, text, slug, replacement)
            if text in seen:
                what = f"{seen[text]!r} and {name!r} are both {text!r} once expanded"
                raise self.reader.fail(key, f"{self.where}: filters.setParamsByID: {what}")
            seen[text] = name
            pairs.append((yaml.ScalarNode(STR, text, key.start_mark, key.end_mark), value))
        by_id.value = pairs


def _by_id_node(
    reader: Reader, fields: dict[str, tuple[yaml.Node, yaml.Node]], where: str
) -> yaml.MappingNode | None:
    """A model's filters.setParamsByID mapping, if it has one."""
    filters = fields["filters"][1] if "filters" in fields else None
    if not isinstance(filters, yaml.MappingNode):
        return None
    found = reader.entries(filters, f"{where}: filters").get("setParamsByID")
    return found[1] if found is not None and isinstance(found[1], yaml.MappingNode) else None


def _check(reader: Reader, node: yaml.Node, where: str, *, pid: bool) -> None:
    """Refuse what is left of the form ``${NAME}`` in the values of ``node``: an
    unknown macro (or ``${PID}`` outside cmdStop). Keys are not expanded, nor checked
    (but setParamsByID's: ``_model``)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, yaml.ScalarNode):
            for name in MACRO.findall(item.value) if item.tag == STR else ():
                if name == "PID" and not pid:
                    raise reader.fail(item, f"{where}: ${{PID}} is for cmdStop")
                if name != "PID":
                    raise reader.fail(item, f"{where}: ${{{name}}} is not a defined macro")
            left = _ENV.search(item.value) if item.tag == STR else None
            if left:  # brought in by a variable or a macro: not expanded again
                raise reader.fail(item, f"{where}: {left.group(0)}: not expanded (in a value)")
        elif isinstance(item, yaml.SequenceNode):
            stack.extend(item.value)
        elif isinstance(item, yaml.MappingNode):
            stack.extend(v for _, v in item.value)


def _environment(reader: Reader, root: yaml.Node) -> None:
    """``${env.VAR}`` in every scalar of the file, keys too, in place: a plain scalar is
    typed again as YAML would type its new text (``ttl: ${env.TTL}`` is a number)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if "${env." in node.value:
                _variables(reader, node)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(x for pair in node.value for x in pair)


def _variables(reader: Reader, node: yaml.ScalarNode) -> None:
    node.value = _ENV.sub(lambda m: _variable(reader, node, m.group(1)), node.value)
    if node.style is None and node.tag != MERGE:
        node.tag = reader.loader.resolve(yaml.ScalarNode, node.value, (True, False))


def _variable(reader: Reader, node: yaml.Node, name: str) -> str:
    found = os.environ.get(name)
    if found is None:
        raise reader.fail(node, f"${{env.{name}}}: {name} is not set")
    if any(c in found for c in "\r\n\0"):
        raise reader.fail(node, f"${{env.{name}}}: {name}'s value holds a line break or NUL")
    return found


def _text(value: Any) -> str:
    """A macro's value in a string, as llama-swap writes it (Go's ``%v``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if value == 0:
        return "0"
    sign, digits, exponent = decimal.Decimal(repr(value)).normalize().as_tuple()
    ds = "".join(map(str, digits))
    point = len(ds) + int(exponent)
    head = "-" if sign else ""
    if not -4 <= point - 1 < 6:  # Go's %g, shortest
        mantissa = ds[0] + (f".{ds[1:]}" if len(ds) > 1 else "")
        return f"{head}{mantissa}e{'-' if point < 1 else '+'}{abs(point - 1):02d}"
    if point <= 0:
        return f"{head}0.{'0' * -point}{ds}"
    return f"{head}{ds[:point]}{'.' + ds[point:] if point < len(ds) else '0' * (point - len(ds))}"
