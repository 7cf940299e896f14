"""The man pages in man/ must match the command line: every command and option, nothing stale.

The command tree comes from the CLI itself (``typer.main.get_command``), so adding, renaming
or removing a command or an option fails here until man/ says the same.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main
from typer.core import TyperGroup

import vramlock.cli

MAN = Path(__file__).resolve().parent.parent / "man"
OVERVIEW = MAN / "vramlock.1"

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
    command = typer.main.get_command(vramlock.cli.app)
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
    return OVERVIEW if name is None else MAN / f"vramlock-{name}.1"


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


def test_no_stale_pages() -> None:
    expected = {OVERVIEW.name} | {_page(name).name for name in COMMANDS}
    pages = {p.name for p in MAN.glob("*.1")}
    assert not pages - expected, f"man pages for no command: {sorted(pages - expected)}"


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


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
@pytest.mark.parametrize("name", [None, *COMMANDS], ids=["vramlock", *COMMANDS])
def test_page_renders_without_warnings(name: str | None) -> None:
    page = _page(name)
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
