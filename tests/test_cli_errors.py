"""End to end: bad input gets one clear stderr line and the documented exit status.

Exit statuses as flock(1) has them, and bad input (never a hang, a traceback, or a followed
link), for ``run`` and the command line in general; ``wait`` and the arena have their own
files, which share tests/helpers/errors.py with this one. Every case runs ``python -m
vramlock`` as a real subprocess, with XDG_RUNTIME_DIR in a temporary directory and
VRAMLOCK_ARENA unset, so nothing touches the real machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.errors import (
    BAD_DURATIONS,
    FAILING_FLOCK,
    FLOCK_FAILURES,
    OWN_FAILURE,
    SUBPROCESS_TIMEOUT,
    TOO_LONG,
    USAGE,
    ErrCli,
    expect_error,
    holding_token,
    still_held_by_us,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def err_arena(tmp_path: Path) -> Path:
    """An empty, valid arena directory (mode 0700, owned by us)."""
    path = tmp_path / "arena"
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    return path


@pytest.fixture
def err_held_token(err_arena: Path) -> Iterator[int]:
    with holding_token(err_arena) as fd:
        yield fd


# -- strategies, demand, option mixes, durations ---------------------------------------------


@pytest.mark.parametrize(
    ("options", "code", "fragments"),
    [
        (["--release", "bogus"], USAGE, ["unknown release strategy 'bogus'", "signal"]),
        (["--release", ""], USAGE, ["unknown release strategy ''"]),
        (["--demand", "bogus"], USAGE, ["unknown demand 'bogus'", "always"]),
        (["--demand", "bogus", "--release", "none"], USAGE, ["unknown demand 'bogus'"]),
        (
            ["--on-release", "true", "--release", "signal"],
            USAGE,
            ["--on-release/--on-restore need --release exec"],
        ),
        (
            ["--on-restore", "true", "--release", "none"],
            USAGE,
            ["--on-release/--on-restore need --release exec"],
        ),
        (
            ["--on-restore", "true", "--on-release", "true", "--release", "restart"],
            USAGE,
            ["--on-release/--on-restore need --release exec (--on-release alone: or restart)"],
        ),
        (["--release", "exec"], USAGE, ["--release exec needs --on-release"]),
        (
            ["--release", "exec", "--on-restore", "true"],
            USAGE,
            ["--release exec needs --on-release"],
        ),
    ],
    ids=[
        "unknown-release",
        "empty-release",
        "unknown-demand",
        "unknown-demand-release-none",
        "on-release-with-signal",
        "on-restore-with-none",
        "on-restore-with-restart",
        "exec-without-on-release",
        "exec-with-only-on-restore",
    ],
)
def test_run_bad_strategy_options(
    errcli: ErrCli,
    err_arena: Path,
    tmp_path: Path,
    options: list[str],
    code: int,
    fragments: list[str],
) -> None:
    marker = tmp_path / "ran"
    out = errcli("run", "--arena", str(err_arena), *options, "--", "touch", str(marker))
    expect_error(out, code, *fragments)
    assert not marker.exists()
    # Rejected before the arena is touched.
    assert not (err_arena / "token.lock").exists()


@pytest.mark.parametrize("value", BAD_DURATIONS)
@pytest.mark.parametrize(
    ("option", "shown"),
    [
        ("-w", "--timeout"),
        ("--timeout", "--timeout"),
        ("--min-hold", "--min-hold"),
        ("--yield-within", "--yield-within"),
    ],
)
def test_run_bad_duration(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, option: str, shown: str, value: str
) -> None:
    marker = tmp_path / "ran"
    given = [f"{option}={value}"] if option.startswith("--") else [option, value]
    out = errcli("run", "--arena", str(err_arena), *given, "--", "touch", str(marker))
    expect_error(out, USAGE, f"{shown}: bad duration {value!r}")
    assert not marker.exists()
    assert not (err_arena / "token.lock").exists()


@pytest.mark.parametrize("value", TOO_LONG, ids=["9.3e9", "2^31", "hours", "inf"])
@pytest.mark.parametrize("option", ["-w", "--min-hold", "--yield-within"])
def test_run_too_long_duration(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, option: str, value: str
) -> None:
    marker = tmp_path / "ran"
    out = errcli("run", "--arena", str(err_arena), option, value, "--", "touch", str(marker))
    expect_error(out, USAGE, f"{value!r} is too long", "at most 2147483647 s")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["run", "--arena", "{arena}", "--"], "Missing argument"),
        (["run", "--arena", "{arena}"], "Missing argument"),
        (["run", "--"], "Missing argument"),
        (["run", "--bogus", "--", "true"], "No such option: --bogus"),
        (["wait", "--bogus"], "No such option: --bogus"),
        (["who", "--bogus"], "No such option: --bogus"),
        (["who", "--arena", "{arena}", "extra"], "unexpected extra argument"),
        (["no-such-subcommand"], "No such command"),
        (["run", "-E", "300", "--arena", "{arena}", "--", "true"], "--conflict-exit-code"),
        (["run", "-E", "x", "--arena", "{arena}", "--", "true"], "--conflict-exit-code"),
        (["run", "--gpu", "-1", "--", "true"], "--gpu"),
        (["wait", "--fd", "-1", "--arena", "{arena}"], "--fd"),
        (["wait", "--fd", "abc", "--arena", "{arena}"], "--fd"),
    ],
    ids=[
        "run-no-command",
        "run-no-command-no-dashes",
        "run-only-dashes",
        "run-unknown-option",
        "wait-unknown-option",
        "who-unknown-option",
        "who-extra-argument",
        "unknown-subcommand",
        "exit-code-out-of-range",
        "exit-code-not-a-number",
        "negative-gpu",
        "negative-fd",
        "fd-not-a-number",
    ],
)
def test_usage_errors(errcli: ErrCli, err_arena: Path, args: list[str], fragment: str) -> None:
    out = errcli(*(a.format(arena=err_arena) for a in args))
    expect_error(out, USAGE, fragment)
    assert not (err_arena / "token.lock").exists()


# -- the command -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    ["/nonexistent/dir/cmd", "vramlock-no-such-command-xyz", ""],
    ids=["path", "bare-name", "empty"],
)
def test_command_not_found(errcli: ErrCli, err_arena: Path, command: str) -> None:
    out = errcli("run", "--arena", str(err_arena), "--", command, "arg")
    expect_error(out, 127, "command not found", command)
    assert not still_held_by_us(err_arena / "token.lock")


def test_command_not_executable(errcli: ErrCli, err_arena: Path, tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text('#!/bin/sh\ntouch "$1"\n')
    script.chmod(0o644)
    marker = tmp_path / "ran"
    out = errcli("run", "--arena", str(err_arena), "--", str(script), str(marker))
    expect_error(out, 126, str(script))
    assert not marker.exists()


def test_command_is_a_directory(errcli: ErrCli, err_arena: Path, tmp_path: Path) -> None:
    directory = tmp_path / "adir"
    directory.mkdir()
    out = errcli("run", "--arena", str(err_arena), "--", str(directory))
    expect_error(out, 126, str(directory), "is a directory")


def test_command_bad_executable_format(errcli: ErrCli, err_arena: Path, tmp_path: Path) -> None:
    binary = tmp_path / "garbage"
    binary.write_bytes(b"\x7fELF\x00not really an executable")
    binary.chmod(0o755)
    out = errcli("run", "--arena", str(err_arena), "--", str(binary))
    expect_error(out, 126, str(binary))


@pytest.mark.parametrize(
    ("script", "code"),
    [
        ("exit 0", 0),
        ("exit 3", 3),
        ("exit 125", 125),
        ("exit 255", 255),
        ("kill -TERM $$", 128 + 15),
        ("kill -KILL $$", 128 + 9),
        ("kill -INT $$", 128 + 2),
    ],
)
def test_child_status_passes_through(
    errcli: ErrCli, err_arena: Path, script: str, code: int
) -> None:
    out = errcli("run", "--arena", str(err_arena), "--", "sh", "-c", script)
    assert "Traceback" not in out.stderr
    assert (out.code, out.stderr) == (code, "")


# -- the token is held (-n, -w, -E) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "code"),
    [([], 1), (["-E", "7"], 7), (["-E", "0"], 0), (["--conflict-exit-code", "42"], 42)],
    ids=["default", "E7", "E0", "long-option"],
)
def test_run_nonblock_while_held(
    errcli: ErrCli,
    err_arena: Path,
    err_held_token: int,
    tmp_path: Path,
    options: list[str],
    code: int,
) -> None:
    marker = tmp_path / "ran"
    out = errcli("run", "-n", *options, "--arena", str(err_arena), "--", "touch", str(marker))
    expect_error(out, code, "token is held")
    assert out.elapsed < 10
    assert not marker.exists()
    assert still_held_by_us(err_arena / "token.lock")


@pytest.mark.parametrize(("value", "at_least"), [("0.3", 0.25), ("300ms", 0.25), ("1", 1.0)])
def test_run_timeout_while_held(
    errcli: ErrCli,
    err_arena: Path,
    err_held_token: int,
    tmp_path: Path,
    value: str,
    at_least: float,
) -> None:
    marker = tmp_path / "ran"
    out = errcli("run", "-w", value, "--arena", str(err_arena), "--", "touch", str(marker))
    expect_error(out, 1, "token not obtained within")
    assert at_least <= out.elapsed < at_least + 5
    assert not marker.exists()
    assert still_held_by_us(err_arena / "token.lock")


def test_run_timeout_with_conflict_code(
    errcli: ErrCli, err_arena: Path, err_held_token: int
) -> None:
    out = errcli("run", "-w", "0.2", "-E", "5", "--arena", str(err_arena), "--", "true")
    expect_error(out, 5, "token not obtained within 0.2 s")
    assert 0.15 <= out.elapsed < 5


@pytest.mark.parametrize("failure", FLOCK_FAILURES)
def test_run_flock_failure_is_one_line(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, failure: str
) -> None:
    errcli.env["FLOCK_ERRNO"] = failure
    marker = tmp_path / "ran"
    args = ("run", "--arena", str(err_arena), "--", "touch", str(marker))
    out = errcli(*args, python_code=FAILING_FLOCK)
    expect_error(out, OWN_FAILURE, f"cannot lock {err_arena}/", f"({failure})")
    assert not marker.exists()


# -- demo ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--seconds", "abc"], "--seconds: bad duration 'abc'"),
        (["--seconds", "9300000000"], "--seconds: '9300000000' is too long"),
        (["--members", "1"], "--members"),
        (["--members", "9"], "--members"),
    ],
)
def test_demo_errors(errcli: ErrCli, args: list[str], fragment: str) -> None:
    expect_error(errcli("demo", *args), USAGE, fragment)


# -- standard input, output and error: closed, or read by nobody -----------------------------


def _closing(fd: int) -> Callable[[], None]:
    """A preexec_fn that closes ``fd`` in the child, as ``N>&-`` does in a shell."""
    return lambda: os.close(fd)


def _lock_files_untouched(arena: Path) -> None:
    for name in ("token.lock", "want.lock"):
        if (arena / name).exists():
            assert (arena / name).read_bytes() == b"", f"{name} was written to"


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["who"], 0),
        (["arena"], 0),
        (["wait", "-n"], 0),
        (["run", "--", "sh", "-c", "echo out; echo err >&2; cat; exit 3"], 3),
    ],
    ids=["who", "arena", "wait", "run"],
)
@pytest.mark.parametrize("closed", [0, 1, 2], ids=["stdin", "stdout", "stderr"])
def test_closed_standard_descriptor(
    errcli: ErrCli, err_arena: Path, command: list[str], code: int, closed: int
) -> None:
    """A closed 0, 1 or 2 is /dev/null: no lock file takes its number, nothing crashes."""
    args = [command[0], "--arena", str(err_arena), *command[1:]]
    out = errcli(*args, preexec_fn=_closing(closed))
    assert (out.code, "Traceback" in out.stderr) == (code, False), out.stderr
    _lock_files_untouched(err_arena)
    if closed == 1:
        assert out.stderr == ("err\n" if command[0] == "run" else "")
    if closed == 2:
        assert out.stderr == ""
        assert "err" not in out.stdout


def test_closed_stderr_error_goes_nowhere(errcli: ErrCli, tmp_path: Path) -> None:
    """Not onto stdout (Python leaves sys.stderr None when 2 is closed at start)."""
    out = errcli("wait", "--arena", str(tmp_path / "nowhere"), preexec_fn=_closing(2))
    assert (out.code, out.stdout, out.stderr) == (OWN_FAILURE, "", "")


@pytest.fixture(params=["buffered", "unbuffered"])
def buffering(request: pytest.FixtureRequest, errcli: ErrCli) -> str:
    """Both ways Python may write stdout: at exit (buffered) or at once (PYTHONUNBUFFERED)."""
    errcli.env.pop("PYTHONUNBUFFERED", None)
    if request.param == "unbuffered":
        errcli.env["PYTHONUNBUFFERED"] = "1"
    return str(request.param)


def _reader_gone() -> int:
    """The writing end of a pipe whose reading end is already closed: writes say EPIPE."""
    r, w = os.pipe()
    os.close(r)
    return w


@pytest.mark.parametrize(
    "args",
    [["who", "--arena", "{arena}"], ["arena", "--arena", "{arena}"], ["--version"], ["--help"],
     ["who", "--help"], []],
    ids=["who", "arena", "version", "help", "who-help", "no-arguments"],
)  # fmt: skip
def test_stdout_reader_gone_is_not_an_error(
    errcli: ErrCli, err_arena: Path, buffering: str, args: list[str]
) -> None:
    """``vramlock who | head -1``: the reader has what it wanted; exit 0, say nothing."""
    w = _reader_gone()
    try:
        out = errcli(*(a.format(arena=err_arena) for a in args), stdout=w)
    finally:
        os.close(w)
    assert (out.code, out.stderr) == (0, "")


def test_stderr_reader_gone_keeps_the_status(errcli: ErrCli, tmp_path: Path) -> None:
    """The error line cannot be written: the exit status still says what happened."""
    w = _reader_gone()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "vramlock", "wait", "--arena", str(tmp_path / "nowhere")],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=w, text=True,
            env=errcli.env, timeout=SUBPROCESS_TIMEOUT, check=False,
        )  # fmt: skip
    finally:
        os.close(w)
    assert (proc.returncode, proc.stdout) == (OWN_FAILURE, "")


def test_run_usage_shows_the_dashes_before_the_command(errcli: ErrCli) -> None:
    out = errcli("run", "--help")
    assert (out.code, out.stderr) == (0, "")
    assert out.stdout.splitlines()[0] == "Usage: vramlock run [OPTIONS] -- COMMAND..."


def test_no_arguments_prints_help_and_succeeds(errcli: ErrCli) -> None:
    out = errcli()
    assert (out.code, out.stderr) == (0, "")
    assert out.stdout.startswith("Usage: vramlock ")
    assert "run" in out.stdout and "wait" in out.stdout


@pytest.mark.parametrize("command", ["who", "arena"])
def test_stdout_on_a_full_disk(
    errcli: ErrCli, err_arena: Path, buffering: str, command: str
) -> None:
    """``vramlock who > /dev/full``: one line saying why, vramlock's own status."""
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        out = errcli(command, "--arena", str(err_arena), stdout=full)
    finally:
        os.close(full)
    assert out.code == OWN_FAILURE
    assert out.stderr == "vramlock: cannot write the output: No space left on device\n"


# A name that would recolour the terminal, start a line of its own, ring the bell and turn
# the rest of the line around, were it written as it is.
HOSTILE = "x\x1b[31m\nEVIL\x07\u202e"


def _no_raw_controls(line: str) -> bool:
    return all(c.isprintable() for c in line)


@pytest.mark.parametrize(
    "args",
    [
        ["who", "--arena", f"/nonexistent/{HOSTILE}"],
        ["wait", "-n", "--arena", f"/nonexistent/{HOSTILE}"],
        ["run", "--arena", "{arena}", "--", f"/no/such/{HOSTILE}"],
        ["run", "--arena", "{arena}", "--", HOSTILE],
        ["run", "--arena", "{arena}", "--release", HOSTILE, "--", "true"],
        ["run", "--arena", "{arena}", "--demand", HOSTILE, "--", "true"],
        ["run", "--arena", "{arena}", "--min-hold", HOSTILE, "--", "true"],
        ["run", f"--bogus{HOSTILE}"],
        [f"bogus{HOSTILE}"],
    ],
    ids=[
        "who-arena",
        "wait-arena",
        "command-path",
        "command",
        "release",
        "demand",
        "duration",
        "option",
        "subcommand",
    ],
)
def test_hostile_names_are_escaped(errcli: ErrCli, err_arena: Path, args: list[str]) -> None:
    """What the user gave (a path, a command, a name) reaches stderr escaped: one line, no
    raw control character, escape sequence or bidi override."""
    out = errcli(*(a.replace("{arena}", str(err_arena)) for a in args))
    detail = f"args={out.args!r} code={out.code} stderr={out.stderr!r}"
    assert out.code not in (0, 1) and "Traceback" not in out.stderr, detail
    lines = out.stderr.split("\n")
    assert len(lines) == 2 and lines[1] == "", detail  # one line, ended by its newline
    assert lines[0].startswith("vramlock: ") and "EVIL" in lines[0], detail
    assert _no_raw_controls(lines[0]), detail


# -- the front door: fast.py's table is the typer commands' ----------------------------------


def _typer_options(word: str) -> dict[str, tuple[tuple[str, ...], str, object]]:
    """dest -> (spellings, kind, default) of a typer command's options, in fast.py's terms."""
    import typer.main

    from vramlock.cli import fast
    from vramlock.cli.app import app

    command = typer.main.get_command(app).commands[word]  # type: ignore[attr-defined]
    found = {}
    for p in command.params:
        if p.param_type_name != "option":
            continue
        if p.is_flag:
            kind = fast.FLAG
        elif type(p.type).__name__ == "IntRange" and (p.type.min, p.type.max) == (0, 255):
            kind = fast.CODE
        else:
            kind = fast.TEXT if repr(p.type) == "STRING" else repr(p.type)
        found[p.name] = ((*p.opts, *p.secondary_opts), kind, p.default)
    return found


@pytest.mark.parametrize("word", ["run", "who"])
def test_the_fast_table_is_the_typer_commands(word: str) -> None:
    import typer.main

    from vramlock.cli import fast
    from vramlock.cli.app import app

    table = {o.dest: (o.names, o.kind, o.default) for o in fast.TABLE[word]}
    assert table == _typer_options(word)
    command = typer.main.get_command(app).commands[word]  # type: ignore[attr-defined]
    arguments = [(p.name, p.nargs) for p in command.params if p.param_type_name == "argument"]
    # fast.py reads run's command as everything from the first word that is no option.
    assert arguments == ([("command", -1)] if word == "run" else [])
    assert command.context_settings.get("allow_interspersed_args", True) is (word != "run")


FAST_FORMS = [
    ["who"],
    ["who", "--arena", "/a", "--json"],
    ["who", "--gpu=0,1", "--watch", "--arena="],
    ["run", "--", "true"],
    ["run", "-n", "-E", "3", "--arena=/a", "--name", "n", "true", "-x", "--json"],
    ["run", "-w", "5", "--release", "none", "--min-hold=1s", "--", "a", "--", "b"],
    ["run", "--vram", "6G", "--demand", "listen", "--listen", "8081", "--upstream", "8080", "c"],
    ["run", "--conflict-exit-code", "007", "-", "x"],
]


@pytest.mark.parametrize("argv", FAST_FORMS, ids=" ".join)
def test_the_fast_parser_passes_what_typer_passes(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vramlock.cli import fast
    from vramlock.cli import run as run_module
    from vramlock.cli import who as who_module
    from vramlock.cli.app import run_app

    calls: list[dict[str, object]] = []

    def record(**kwargs: object) -> int:
        calls.append(kwargs)
        return 0

    monkeypatch.setattr(run_module, "run", record)
    monkeypatch.setattr(who_module, "who", record)
    call = fast.parse(argv, {})
    assert call is not None, "fast.py should take this form itself"
    assert call() == 0 and run_app(argv) == 0
    assert calls[0] == calls[1]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--version"],
        ["wait", "-n"],
        ["who", "-h"],
        ["who", "--help"],
        ["who", "extra"],
        ["who", "--json=1"],
        ["who", "--arena"],
        ["who", "--bogus"],
        ["run"],
        ["run", "--"],
        ["run", "-nw5", "--", "true"],
        ["run", "-w5", "--", "true"],
        ["run", "-E", "300", "--", "true"],
        ["run", "-E", "x", "--", "true"],
        ["run", "-E=3", "--", "true"],
        ["run", "--gpu", "-1", "--", "true"],
        ["run", "--name", "--", "true"],
        ["run", "--bogus", "--", "true"],
        ["run", "--help"],
    ],
    ids=lambda argv: " ".join(argv) or "nothing",
)
def test_the_fast_parser_leaves_the_rest_to_typer(argv: list[str]) -> None:
    from vramlock.cli import fast

    assert fast.parse(argv, {}) is None


def test_completion_is_left_to_typer() -> None:
    from vramlock.cli import fast

    assert fast.parse(["who"], {"_VRAMLOCK_COMPLETE": "bash_complete"}) is None


# -- a new user's first hour -----------------------------------------------------------------


def test_a_missing_arena_says_how_to_make_one(errcli: ErrCli, tmp_path: Path) -> None:
    path = tmp_path / "my arena"
    out = errcli("who", "--arena", str(path))
    expect_error(out, OWN_FAILURE, f"arena {path}: does not exist (an arena is a directory"
                 f" you make: mkdir -m 700 '{path}')")  # fmt: skip
    assert not path.exists()


@pytest.mark.parametrize("command", ["who", "stats"])
def test_a_system_directory_is_never_offered_as_an_arena(errcli: ErrCli, command: str) -> None:
    out = errcli(command, "--arena", "/etc")
    line = expect_error(out, OWN_FAILURE, "arena /etc: is not an arena")
    assert "vramlock arena --arena /etc" not in line and "--arena /etc" not in line
    assert "mkdir -m 700" in line


def test_the_parent_of_an_arena_names_it(errcli: ErrCli, tmp_path: Path) -> None:
    """A path with its last part left off: the arena below is named."""
    parent = tmp_path / "team"
    (parent / "gpu0").mkdir(parents=True, mode=0o700)
    (parent / "gpu0" / "token.lock").touch()
    (parent / "notes.txt").touch()
    parent.chmod(0o700)
    out = errcli("who", "--arena", str(parent))
    expect_error(out, OWN_FAILURE, f"arena {parent}: is not an arena", f"--arena {parent}/gpu0?")


def test_ui_without_its_extra_says_what_to_install(errcli: ErrCli, err_arena: Path) -> None:
    # aiohttp made unimportable, as where the serve extra is not installed; vramlock is not
    # on the package index, so the hint names what is.
    code = "import sys; sys.modules['aiohttp'] = None; from vramlock.cli import main; main()"
    out = errcli("ui", "--arena", str(err_arena), python_code=code)
    expect_error(out, OWN_FAILURE, "vramlock ui needs aiohttp: pip install aiohttp")
    assert out.stderr.count("\n") == 1


def test_the_gpu_tests_say_first_that_there_is_no_gpu(tmp_path: Path) -> None:
    from helpers import gpu

    assert gpu._gpu_ready(tmp_path) == "there is none here (no /dev/nvidia*)"
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    assert gpu._gpu_ready(tmp_path) != "there is none here (no /dev/nvidia*)"
    if not Path("/dev/nvidia0").exists():  # this machine: the mark says so
        assert (
            gpu.gpu.kwargs["reason"] == "needs an NVIDIA GPU: there is none here (no /dev/nvidia*)"
        )
