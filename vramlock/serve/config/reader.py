"""Reading the configuration file: its text (bounded, regular files only) and its YAML
node tree, walked so that every error names its line."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable
from typing import Any

import yaml

from ...errors import UsageError

Duration = Callable[[str, str], float]

# The largest file read: llama-swap's configurations are a few KiB; a link to
# /dev/zero or a log file named by mistake must not fill the memory.
MAX_BYTES = 4 << 20
# The most values one value of the file may hold (metadata, setParams, a list...),
# each use of an alias counting again.
MAX_VALUES = 100_000
MERGE = "tag:yaml.org,2002:merge"
NULL = "tag:yaml.org,2002:null"


class ConfigError(UsageError):
    """The configuration file cannot be used: ``FILE:LINE: what is wrong``."""

    def __init__(self, path: str, line: int | None, what: str) -> None:
        super().__init__(f"{path}:{line}: {what}" if line else f"{path}: {what}")
        self.path, self.line, self.what = path, line, what


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def read_config_text(path: str) -> str:
    """The text of the configuration file ``path``: a regular file of at most
    ``MAX_BYTES``, UTF-8. It never blocks (a FIFO is refused, not waited on), so it may
    run on any thread. ConfigError if it cannot be used."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer; O_NOCTTY: a
        # terminal named by mistake must not become serve's.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        raise ConfigError(path, None, f"cannot read it: {err.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
            raise ConfigError(path, None, f"cannot read it: {kind}, not a regular file")
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise ConfigError(path, None, f"cannot read it: {err.strerror}") from None
    finally:
        os.close(fd)
    if size > MAX_BYTES:
        raise ConfigError(path, None, f"cannot read it: larger than {MAX_BYTES >> 20} MiB")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(path, None, "cannot read it: not UTF-8 text") from None


class Reader:
    """Walks the YAML node tree, so that every error can name its line."""

    def __init__(self, path: str, duration: Duration) -> None:
        self.path = path
        self.duration = duration
        self.warnings: list[str] = []
        self.loader: Any = None

    def fail(self, node: yaml.Node | None, what: str) -> ConfigError:
        if node is None:
            return ConfigError(self.path, None, what)
        return ConfigError(self._file(node), node.start_mark.line + 1, what)

    def warn(self, node: yaml.Node, what: str) -> None:
        self.warnings.append(f"{self._file(node)}:{node.start_mark.line + 1}: {what}")

    def _file(self, node: yaml.Node) -> str:
        """The file ``node`` is in (several, merged: ``--config-dir``)."""
        name = node.start_mark.name
        return name if isinstance(name, str) and not name.startswith("<") else self.path

    def check_keys(
        self,
        entries: dict[str, tuple[yaml.Node, yaml.Node]],
        known: frozenset[str],
        ignored: dict[str, str],
        where: str,
    ) -> None:
        """One warning for each key of ``entries`` (name -> (key node, value node)) that is
        llama-swap's but means nothing here (``ignored``: why), or that nobody knows."""
        for name, (key, _) in entries.items():
            if name in ignored:
                self.warn(key, f"{where}{name} ignored: {ignored[name]}")
            elif name not in known:
                self.warn(key, f"{where}unknown key {name} ignored")

    def root(self, text: str, path: str | None = None) -> yaml.MappingNode:
        """The top-level mapping of the file ``path`` (by default the reader's), of text
        ``text`` (an empty file: an empty mapping, as llama-swap reads it)."""
        path = path or self.path
        try:
            self.loader = yaml.SafeLoader(text)
            self.loader.name = path  # its nodes' marks name their file
            node = self.loader.get_single_node()
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            line = None if mark is None else mark.line + 1
            raise ConfigError(path, line, f"not valid YAML: {err.problem or err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(path, None, f"not valid YAML: {err}") from None
        except RecursionError:
            raise ConfigError(path, None, "not valid YAML: nested too deep") from None
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == NULL):
            mark = yaml.Mark(path, 0, 0, 0, None, None)  # type: ignore[arg-type]
            return yaml.MappingNode("tag:yaml.org,2002:map", [], mark, mark)
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, "the file must be a mapping (models:, macros:, ...)")
        return node

    def value(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            self._bounded(node)
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            raise self.fail(node, f"not valid YAML: {err}") from None

    def _bounded(self, node: yaml.Node) -> None:
        """Refuse a value of more than ``MAX_VALUES`` values, counted as they are used:
        YAML aliases make a few lines name billions (aliases of aliases), which would
        be walked, copied and listed each time."""
        left, stack = MAX_VALUES, [node]
        while stack:
            item = stack.pop()
            left -= 1
            if left < 0:
                raise self.fail(node, f"a value of more than {MAX_VALUES} values"
                                      " (aliases of aliases?)")  # fmt: skip
            if isinstance(item, yaml.SequenceNode):
                stack.extend(item.value)
            elif isinstance(item, yaml.MappingNode):
                stack.extend(v for pair in item.value for v in pair)

    def pairs(self, node: yaml.Node, what: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        """A mapping's entries (name, key node, value node), YAML merge keys (``<<:
        *anchor``) merged in: a key of the mapping's own wins over a merged one."""
        if isinstance(node, yaml.ScalarNode) and node.tag == NULL:
            return []  # a key left empty (its entries commented out): none, as llama-swap
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{what} must be a mapping")
        merged = any(key.tag == MERGE for key, _ in node.value)
        out: dict[str, tuple[str, yaml.Node, yaml.Node]] = {}
        for key, value in node.value:
            if key.tag == MERGE:
                continue
            name = self._name(key, what)
            if name in out:
                raise self.fail(key, f"{what}: {name!r} appears twice")
            out[name] = (name, key, value)
        if merged:
            self._bounded(node)
            try:
                self.loader.flatten_mapping(node)
            except yaml.YAMLError as err:
                raise self.fail(node, f"{what}: {getattr(err, 'problem', None) or err}") from None
            # Flattened: the merged entries first, the mapping's own last; the last wins.
            found = {self._name(key, what): (key, value) for key, value in node.value}
            node.value = list(found.values())  # read again: no merge keys, no duplicates
            out = {name: (name, key, value) for name, (key, value) in found.items()}
        return list(out.values())

    def _name(self, key: yaml.Node, what: str) -> str:
        name = self.value(key)
        if not isinstance(name, str | int) or isinstance(name, bool):
            raise self.fail(key, f"{what}: a key must be a name")
        return str(name)

    def entries(self, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """``pairs`` as a mapping: name -> (key node, value node)."""
        return {name: (key, value) for name, key, value in self.pairs(node, what)}

    def keyed(
        self, node: yaml.Node, what: str, known: frozenset[str]
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """``entries``, with a warning for each key that is not ``known``."""
        entries = self.entries(node, what)
        self.check_keys(entries, known, {}, f"{what}: ")
        return entries

    def text(self, node: yaml.Node, what: str) -> str:
        value = self.value(node)
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise self.fail(node, f"{what} must be a string")
        return str(value)

    def number(self, node: yaml.Node, what: str, low: float) -> float:
        value = self.value(node)
        if (not isinstance(value, int | float) or isinstance(value, bool) or not value >= low
                or not math.isfinite(value)):  # fmt: skip
            raise self.fail(node, f"{what} must be a number of seconds, at least {low:g}")
        return float(value)

    def whole(self, node: yaml.Node, what: str) -> int:
        value = self.value(node)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(node, f"{what} must be a whole number")
        return value

    def port(self, node: yaml.Node) -> int:
        value = self.value(node)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
            raise self.fail(node, "startPort must be a port number (1-65535)")
        return value

    def flag(self, node: yaml.Node, what: str) -> bool:
        value = self.value(node)
        if not isinstance(value, bool):
            raise self.fail(node, f"{what} must be true or false")
        return value

    def strings(self, node: yaml.Node, what: str) -> list[str]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, f"{what} must be a list")
        return [self.text(item, what) for item in node.value]

    def params(self, node: yaml.Node, where: str) -> dict[str, Any]:
        """A mapping of values (setParams, metadata...)."""
        value = self.value(node)
        if not isinstance(value, dict):
            raise self.fail(node, f"{where}: parameters must be a mapping")
        return value

    def seconds(self, node: yaml.Node, what: str) -> str:
        """A duration as ``vramlock run`` takes it (checked here): 2, 0.5, 250ms, 2m."""
        text = self.text(node, what)
        try:
            self.duration(text, what)
        except UsageError as err:
            raise self.fail(node, str(err)) from None
        return text

    def size(self, node: yaml.Node, what: str) -> str:
        """A memory size as ``vramlock run --vram`` takes it (checked here): 6G, 512M."""
        from ...arena.budget import parse_size

        text = self.text(node, what)
        try:
            parse_size(text, what)
        except UsageError as err:
            raise self.fail(node, str(err)) from None
        return text
