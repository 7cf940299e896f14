"""The front door: ``who`` and ``run`` in their common forms, parsed without typer.

typer and click cost several times the interpreter's own start-up, and shell scripts call
``who`` and ``run`` in loops. An argument list that this parser understands whole (the
command word, options from ``TABLE`` spelled exactly, then for ``run`` the command) is
handled here; anything else (``--help``, a bad value, an unknown or clustered option,
shell completion) goes to the typer app, so that every message and exit status is typer's.
``TABLE`` must say what the typer commands say: tests/test_cli_errors.py checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import Any

FLAG, TEXT, CODE = "flag", "text", "code"  # no value; any string; an exit status 0-255


class Opt:
    """One option: the parameter it sets, its spellings, what it takes, its default."""

    __slots__ = ("default", "dest", "kind", "names")

    def __init__(
        self, dest: str, names: tuple[str, ...], kind: str = TEXT, default: Any = None
    ) -> None:
        self.dest = dest
        self.names = names
        self.kind = kind
        self.default = default

    def __repr__(self) -> str:
        return f"Opt({self.dest!r}, {self.names!r}, {self.kind!r}, {self.default!r})"


def _text(dest: str, default: str | None = None) -> Opt:
    return Opt(dest, ("--" + dest.replace("_", "-"),), TEXT, default)


_WHERE = (_text("arena"), _text("gpu"))
_QUEUE = (
    Opt("nonblock", ("-n", "--nonblock"), FLAG, False),
    Opt("wait", ("-w", "--timeout")),
    Opt("conflict_exit_code", ("-E", "--conflict-exit-code"), CODE, 1),
)
# run's other options: a value each, None when not given.
_RUN_TEXT = (
    "name", "listen", "upstream", "idle", "ready_within", "ready_url", "on_release",
    "on_restore", "preset", "on_release_url", "on_restore_url", "yield_within", "release_within",
    "vram",
)  # fmt: skip
TABLE: dict[str, tuple[Opt, ...]] = {
    "run": (
        *_QUEUE,
        *_WHERE,
        _text("release", "auto"),
        _text("demand", "always"),
        _text("min_hold", "100ms"),
        *map(_text, _RUN_TEXT),
    ),
    "who": (
        *_WHERE,
        Opt("as_json", ("--json",), FLAG, False),
        Opt("watch", ("--watch",), FLAG, False),
    ),
}

# Set by a shell asking for completions: typer's business.
_COMPLETE = "_VRAMLOCK_COMPLETE"


def _value(opt: Opt, given: str) -> Any:
    """The option's value from ``given``, or None where typer must judge it."""
    if opt.kind == CODE:
        return int(given) if given.isascii() and given.isdigit() and int(given) <= 255 else None
    return None if given.startswith("-") else given  # "--name --json": typer decides


def _options(word: str, argv: Sequence[str]) -> tuple[dict[str, Any], list[str]] | None:
    """The values of ``word``'s options in ``argv`` and what follows them, or None."""
    by_name = {name: opt for opt in TABLE[word] for name in opt.names}
    values = {opt.dest: opt.default for opt in TABLE[word]}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return values, list(argv[i + 1 :])
        if not arg.startswith("-") or arg == "-":
            return values, list(argv[i:])
        name, eq, attached = arg.partition("=")
        opt = by_name.get(name)
        if opt is None or (opt.kind == FLAG and eq) or (eq and not name.startswith("--")):
            return None
        if opt.kind == FLAG:
            values[opt.dest] = True
            i += 1
            continue
        if not eq and i + 1 == len(argv):
            return None
        value = _value(opt, attached if eq else argv[i + 1])
        if value is None:
            return None
        values[opt.dest] = value
        i += 1 if eq else 2
    return values, []


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> Callable[[], int] | None:
    """What to do for ``argv``, if this parser understands it whole; None: ask typer."""
    if not argv or argv[0] not in TABLE or _COMPLETE in environ:
        return None
    parsed = _options(argv[0], argv[1:])
    if parsed is None:
        return None
    values, rest = parsed
    if argv[0] == "who":
        return None if rest else lambda: _who(values)
    return (lambda: _run(rest, values)) if rest else None


def _who(values: dict[str, Any]) -> int:
    from .who import who

    who(**values)
    return 0


def _run(command: list[str], values: dict[str, Any]) -> int:
    from .run import run

    return run(command=command, **values)
