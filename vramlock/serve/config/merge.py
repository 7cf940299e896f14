"""``--config-dir``: configuration files merged, as llama-swap's ``-config-dir``.

The sources: the ``--config`` file (if given), then the ``*.yaml`` and ``*.yml`` files
directly in the directory, in sorted order (no subdirectory). Each one's top-level
mapping is merged into the first: a key one source has is kept; mappings of a shared key
merge, lists are joined, equal scalars agree and a null one yields to the other; a
different scalar, or a list against a mapping, is a conflict. Under ``models``,
``groups``, ``profiles``, ``selectors``, ``peers``, ``matrix`` and their places under
``routing.router.settings``, each entry is one thing (a model, a peer...): two sources
naming the same one is an error. Every error names the file and line it comes from.
"""

from __future__ import annotations

import os

import yaml

from .macros import parse
from .reader import NULL, ConfigError, Reader, read_config_text

IDENTITY = frozenset(
    {"models", "groups", "profiles", "selectors", "peers", "matrix",
     "routing.router.settings.groups", "routing.router.settings.matrix"}
)  # fmt: skip


def sources(path: str | None, directory: str) -> list[str]:
    """The files to merge, in order."""
    try:
        with os.scandir(directory) as found:
            files = sorted(os.path.join(directory, e.name) for e in found
                           if e.name.endswith((".yaml", ".yml"))
                           and not e.is_dir(follow_symlinks=False))  # fmt: skip
    except OSError as err:
        raise ConfigError(directory, None, f"cannot read the directory: {err.strerror}") from None
    if path is not None:
        same = next((f for f in files if os.path.abspath(f) == os.path.abspath(path)), None)
        if same is not None:
            raise ConfigError(path, None, f"is also in --config-dir {directory}: give it once")
    out = ([path] if path is not None else []) + files
    if not out:
        raise ConfigError(directory, None, "no configuration files (*.yaml, *.yml) in it")
    return out


def merged_root(reader: Reader, path: str | None, directory: str) -> yaml.MappingNode:
    """The sources' top-level mappings, merged into one (its nodes keep their files)."""
    merged: yaml.MappingNode | None = None
    for source in sources(path, directory):
        root = parse(reader, read_config_text(source), source)
        if not root.value:
            continue  # empty, or comments only
        if merged is None:
            merged = root
        else:
            _mapping(reader, merged, root, "")
    if merged is None:
        return reader.root("", path or directory)
    return merged


def _mapping(reader: Reader, dst: yaml.MappingNode, src: yaml.MappingNode, path: str) -> None:
    found = {key.value: i for i, (key, _) in enumerate(dst.value)}
    for key, value in src.value:
        at = found.get(key.value)
        if at is None:
            dst.value.append((key, value))
            found[key.value] = len(dst.value) - 1
            continue
        child = f"{path}.{key.value}" if path else str(key.value)
        mine = dst.value[at][1]
        if child in IDENTITY:
            _identity(reader, mine, value, child, key.value)
        else:
            dst.value[at] = (dst.value[at][0], _value(reader, mine, value, child))


def _identity(reader: Reader, dst: yaml.Node, src: yaml.Node, path: str, what: str) -> None:
    if not isinstance(dst, yaml.MappingNode) or not isinstance(src, yaml.MappingNode):
        raise reader.fail(src, f"conflict at {path}: each source must give a mapping")
    names = {key.value for key, _ in dst.value}
    for key, value in src.value:
        if key.value in names:
            raise reader.fail(key, f"{what}: {key.value!r} is already in another source")
        dst.value.append((key, value))


def _value(reader: Reader, dst: yaml.Node, src: yaml.Node, path: str) -> yaml.Node:
    if isinstance(dst, yaml.MappingNode) and isinstance(src, yaml.MappingNode):
        _mapping(reader, dst, src, path)
        return dst
    if isinstance(dst, yaml.SequenceNode) and isinstance(src, yaml.SequenceNode):
        dst.value = dst.value + src.value
        return dst
    if _null(dst):
        return src
    if _null(src):
        return dst
    if isinstance(dst, yaml.ScalarNode) and isinstance(src, yaml.ScalarNode):
        if dst.value == src.value and dst.tag == src.tag:
            return dst
        raise reader.fail(src, f"conflict at {path}: a different value than another source's")
    raise reader.fail(src, f"conflict at {path}: a mapping, a list or a value, unlike another"
                           " source's")  # fmt: skip


def _null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == NULL and node.value == ""
