"""The house's rules, pinned: they held only where a test checked them.

- no import cycle among the package's modules (imports for type checking count);
- no function or method over 60 lines, no class over 400;
- no hand-written source file over 800 lines.

Each rule reads the tree as it is: the code's own imports and definitions, through ``ast``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vramlock"
# Every hand-written Python file of the repository.
PYTHON = ("vramlock", "tests", "bench", "tools")
MAX_FUNCTION = 60
MAX_CLASS = 400
MAX_FILE = 800
# Files a program writes: the PTX of the digest kernel, embedded as a C string.
GENERATED = {"vramlock/gpu/swap/digest_ptx.h"}


def python_files() -> Iterator[Path]:
    for top in PYTHON:
        yield from sorted((ROOT / top).rglob("*.py"))
    yield ROOT / "hatch_build.py"


def source_files() -> Iterator[Path]:
    yield from python_files()
    for pattern in ("*.c", "*.h", "*.html", "*.sh"):
        yield from sorted(ROOT.glob(f"vramlock/**/{pattern}"))
        yield from sorted(ROOT.glob(f"tests/**/{pattern}"))
        yield from sorted(ROOT.glob(f"bench/**/{pattern}"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_hand_written_file_is_over_800_lines() -> None:
    long = {}
    for path in source_files():
        if rel(path) in GENERATED or "__pycache__" in path.parts:
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE:
            long[rel(path)] = lines
    assert long == {}, f"files over {MAX_FILE} lines: split them by what they do"


def test_no_function_over_60_lines_and_no_class_over_400() -> None:
    over = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert node.end_lineno is not None
                # A definition's lines run from its first decorator to its last line.
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1
                most = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                if lines > most:
                    over.append(f"{rel(path)}:{node.lineno} {node.name}: {lines} > {most}")
    assert over == [], "\n".join(over)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import at any depth, those for type checking too: a module that names
    another's types knows it as much as one that calls it."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph() -> dict[str, set[str]]:
    """The package's modules, each with the package modules it imports."""
    files = {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                start = node.module or ""
                start = f"{base}.{start}".strip(".") if node.level else start
                # ``from a import b``: the module a.b where there is one, else a's name b.
                targets = [
                    f"{start}.{alias.name}" if f"{start}.{alias.name}" in files else start
                    for alias in node.names
                ]
            for target in targets:
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_the_package_s_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The rule above can fail: a loop through three modules is found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
