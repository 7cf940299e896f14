"""The man pages in man/ must match the command line: every command and option, every
default, nothing stale.

The command tree comes from the CLI itself (``typer.main.get_command``), so adding, renaming
or removing a command or an option, or changing a default, fails here until man/ says the
same. man/ is laid out as a manual tree (man1/, man7/), as it is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main
from typer.core import TyperGroup

from vramlock.cli.app import app
from vramlock.cli.common import parse_duration
from vramlock.cli.who import COLUMNS
from vramlock.run import options, scheduler

MAN = Path(__file__).resolve().parent.parent / "man"
OVERVIEW = MAN / "man1" / "vramlock.1"
# How strategies and demands work, out of vramlock-run(1) to keep that page to its options.
STRATEGIES = MAN / "man7" / "vramlock-strategies.7"

# Added by click/typer to every command; documented, but not required.
HELP_OPTS = frozenset({"-h", "--help"})
# typer's own root options; required in vramlock.1 only.
COMPLETION_PARAMS = frozenset({"install_completion", "show_completion"})

REQUIRED_SECTIONS = (
    "NAME",
    "SYNOPSIS",
    "DESCRIPTION",
    "OPTIONS",
    "EXIT STATUS",
    "ENVIRONMENT",
    "FILES",
    "EXAMPLES",
    "SEE ALSO",
)

# roff escapes that change fonts or print nothing: \fB \fI \fR \fP \f(CW \f[CB] \& \% \: \c
_ROFF_ESCAPES = re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)|\\[&%:c]")
_OPTION_TOKEN = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def _root() -> TyperGroup:
    command = typer.main.get_command(app)
    assert isinstance(command, TyperGroup), type(command)
    return command


COMMANDS = sorted(_root().commands)


def _options(name: str | None) -> list[str]:
    """Every spelling of every option of a subcommand (None: of the root command)."""
    root = _root()
    command = root if name is None else root.commands[name]
    found: list[str] = []
    for param in command.params:
        if param.param_type_name != "option":
            continue
        if name is not None and param.name in COMPLETION_PARAMS:
            continue
        found += [o for o in (*param.opts, *param.secondary_opts) if o not in HELP_OPTS]
    return found


def _page(name: str | None) -> Path:
    return OVERVIEW if name is None else MAN / "man1" / f"vramlock-{name}.1"


def _normalise(line: str) -> str:
    """A roff source line as text: '\\-' is '-', font changes and zero-width escapes go."""
    line = line.split('\\"', 1)[0]  # a comment to the end of the line
    return _ROFF_ESCAPES.sub("", line.replace("\\-", "-"))


def _lines(page: Path) -> list[str]:
    """The page's lines, without comment lines, normalised."""
    raw = page.read_text(encoding="utf-8").splitlines()
    return [_normalise(ln) for ln in raw if not ln.startswith(('.\\"', "'\\\""))]


def _sections(page: Path) -> dict[str, list[str]]:
    """Lines under each .SH heading (the heading without quotes, upper case)."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in _lines(page):
        if line.startswith(".SH"):
            current = sections.setdefault(line[3:].strip().strip('"').upper(), [])
        else:
            current.append(line)
    return sections


def _tags(lines: list[str]) -> list[str]:
    """The tag lines of .TP paragraphs (the line after each .TP)."""
    return [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.split()[:1] == [".TP"]]


def _mentions(text: str, word: str) -> bool:
    """Does ``word`` occur as a whole word (an option: not inside a longer option)?"""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def _text(lines: list[str]) -> str:
    return "\n".join(lines)


def test_the_cli_has_commands() -> None:
    assert COMMANDS, "no subcommands found in vramlock.cli.app"
    assert _options(None), "no root options found in vramlock.cli.app"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_a_page(name: str) -> None:
    assert _page(name).is_file(), f"missing man page {_page(name)}"


@pytest.mark.parametrize("name", [None, *COMMANDS], ids=["vramlock", *COMMANDS])
def test_every_option_is_documented(name: str | None) -> None:
    page = _page(name)
    assert page.is_file(), f"missing man page {page}"
    sections = _sections(page)
    options = _text(sections.get("OPTIONS", []))
    tags = _text(_tags(sections.get("OPTIONS", [])))
    missing = [o for o in _options(name) if not _mentions(options, o)]
    assert not missing, f"{page.name}: OPTIONS does not document {missing}"
    untagged = [o for o in _options(name) if not _mentions(tags, o)]
    assert not untagged, f"{page.name}: no .TP entry in OPTIONS for {untagged}"


@pytest.mark.parametrize("name", [None, *COMMANDS], ids=["vramlock", *COMMANDS])
def test_no_stale_options(name: str | None) -> None:
    page = _page(name)
    if not page.is_file():
        pytest.skip(f"missing man page {page} (reported by another test)")
    real = set(_options(name)) | HELP_OPTS
    tags = _tags(_sections(page).get("OPTIONS", []))
    stale = sorted({t for tag in tags for t in _OPTION_TOKEN.findall(tag)} - real)
    assert not stale, f"{page.name}: OPTIONS documents options the CLI lacks: {stale}"


@pytest.mark.parametrize("name", COMMANDS)
def test_overview_lists_every_command(name: str) -> None:
    sections = _sections(OVERVIEW)
    listed = _text(_tags(sections.get("COMMANDS", [])))
    assert _mentions(listed, name), f"vramlock.1: COMMANDS has no entry for {name!r}"
    assert _mentions(_text(_lines(OVERVIEW)), f"vramlock-{name}"), (
        f"vramlock.1 does not refer to vramlock-{name}(1)"
    )


PAGES = [OVERVIEW, STRATEGIES, *map(_page, COMMANDS)]


def test_no_stale_pages() -> None:
    expected = set(PAGES)
    pages = {p for p in MAN.rglob("*") if p.is_file()}
    assert not pages - expected, f"man pages for no command: {sorted(pages - expected)}"


_REFERENCE = re.compile(r"^\.BR (vramlock[\w-]*) \((\d)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_references_name_pages_that_exist(page: Path) -> None:
    """Every vramlock page a page refers to (``.BR vramlock-run (1)``) is in man/."""
    refs = [m.groups() for m in map(_REFERENCE.match, _lines(page)) if m]
    missing = [f"{n}({s})" for n, s in refs if not (MAN / f"man{s}" / f"{n}.{s}").is_file()]
    assert not missing, f"{page.name} refers to pages that do not exist: {missing}"


def test_run_page_refers_to_the_strategies_page() -> None:
    see_also = _text(_sections(_page("run"))["SEE ALSO"])
    assert _mentions(see_also, "vramlock-strategies"), "vramlock-run.1: SEE ALSO lacks it"


@pytest.mark.parametrize("name", [None, *COMMANDS], ids=["vramlock", *COMMANDS])
def test_page_structure(name: str | None) -> None:
    page = _page(name)
    if not page.is_file():
        pytest.skip(f"missing man page {page} (reported by another test)")
    title = next((ln.split() for ln in _lines(page) if ln.startswith(".TH")), [])
    assert title[1:3] == [page.stem.upper(), "1"], f"{page.name}: bad .TH line {title}"
    sections = _sections(page)
    missing = [s for s in REQUIRED_SECTIONS if s not in sections]
    assert not missing, f"{page.name}: missing sections {missing}"
    name_line = _text(sections["NAME"]).strip()
    assert name_line.startswith(f"{page.stem} - "), f"{page.name}: NAME is {name_line!r}"


def test_strategies_page_structure() -> None:
    title = next((ln.split() for ln in _lines(STRATEGIES) if ln.startswith(".TH")), [])
    assert title[1:3] == [STRATEGIES.stem.upper(), "7"], f"bad .TH line {title}"
    sections = _sections(STRATEGIES)
    assert {"NAME", "DESCRIPTION", "SEE ALSO"} <= set(sections), sorted(sections)
    assert _text(sections["NAME"]).strip().startswith(f"{STRATEGIES.stem} - ")


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_renders_without_warnings(page: Path) -> None:
    if not page.is_file():
        pytest.skip(f"missing man page {page} (reported by another test)")
    done = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z", str(page)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0 and not done.stderr, f"{page.name}: {done.stderr}"


# -- defaults: the page states what the code does --------------------------------------------

# Options whose parameter default is None because the real one is applied further in; their
# help text says "(default X)", and X must be the code's value.
APPLIED_DEFAULTS = {
    ("run", "--idle"): options.DEFAULT_IDLE,
    ("run", "--ready-within"): options.DEFAULT_READY_WITHIN,
}
_HELP_DEFAULT = re.compile(r"\(default (\S+?)\)")


def _entry(name: str | None, option: str) -> str:
    """The OPTIONS entry of ``option``: its .TP tag to the next option's tag, as one line."""
    lines = _sections(_page(name)).get("OPTIONS", [])
    start = None
    for i, line in enumerate(lines[:-1]):
        if line.split()[:1] != [".TP"]:
            continue
        tag_options = _OPTION_TOKEN.findall(lines[i + 1])
        if start is not None and tag_options:
            return " ".join(lines[start:i])
        if start is None and option in tag_options:
            start = i
    assert start is not None, f"{_page(name).name}: no entry for {option}"
    return " ".join(lines[start:])


def _stated_defaults() -> list[tuple[str | None, str, str]]:
    """(command, option, default) for every option with a default: the parameter's, or
    the one its help text states."""
    found = []
    for name in [None, *COMMANDS]:
        command = _root() if name is None else _root().commands[name]
        for param in command.params:
            if param.param_type_name != "option" or getattr(param, "is_flag", False):
                continue
            if param.default is not None:
                found.append((name, param.opts[-1], str(param.default)))
            elif m := _HELP_DEFAULT.search(getattr(param, "help", None) or ""):
                found.append((name, param.opts[-1], m.group(1)))
    return found


DEFAULTS = _stated_defaults()


def test_defaults_are_found() -> None:
    assert ("run", "--min-hold", "100ms") in DEFAULTS  # the walk sees parameter defaults
    assert ("run", "--idle", "300ms") in DEFAULTS  # and the ones help states


@pytest.mark.parametrize(
    ("name", "option", "default"), DEFAULTS, ids=[f"{n} {o}" for n, o, _ in DEFAULTS]
)
def test_every_default_is_stated(name: str | None, option: str, default: str) -> None:
    entry = _entry(name, option)
    assert f"The default is {default}." in entry, (
        f"{_page(name).name}: {option} does not say 'The default is {default}.'"
    )


@pytest.mark.parametrize(("key", "value"), APPLIED_DEFAULTS.items(), ids=str)
def test_help_defaults_are_the_code_s(key: tuple[str, str], value: float) -> None:
    stated = {(n, o): d for n, o, d in DEFAULTS}
    assert key in stated, f"{key}: the help text states no default"
    assert parse_duration(stated[key], key[1]) == value


def test_every_help_default_is_pinned() -> None:
    """A default that help states but the parameter does not hold must be in APPLIED_DEFAULTS."""
    root = _root()
    unpinned = [
        (name, param.opts[-1])
        for name in COMMANDS
        for param in root.commands[name].params
        if param.default is None
        and _HELP_DEFAULT.search(getattr(param, "help", None) or "")
        and (name, param.opts[-1]) not in APPLIED_DEFAULTS
    ]
    assert not unpinned, f"help states defaults the tests do not check: {unpinned}"


def test_overview_states_the_probe_interval() -> None:
    text = " ".join(_lines(OVERVIEW))
    assert f"at least every {scheduler.PROBE_INTERVAL * 1000:g}\\ ms" in text
    assert f"({scheduler.PROBE_INTERVAL_NO_HINT * 1000:g}\\ ms without inotify)" in text


def test_who_example_has_every_column() -> None:
    example = _sections(_page("who"))["EXAMPLES"]
    header = next(line for line in example if line.startswith("STATE "))
    assert tuple(header.split()) == COLUMNS


def test_run_page_keeps_to_its_options() -> None:
    """flock(1)'s shape: how strategies, demands and budgets work is vramlock-strategies(7)'s."""
    lines = _page("run").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"vramlock-run.1 has {len(lines)} lines; move mechanisms out"


def test_overview_refers_to_every_page() -> None:
    see_also = _text(_sections(OVERVIEW)["SEE ALSO"])
    missing = [p.stem for p in PAGES if p != OVERVIEW and not _mentions(see_also, p.stem)]
    assert not missing, f"vramlock.1: SEE ALSO lacks {missing}"
