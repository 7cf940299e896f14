"""End to end: bad input gets one clear stderr line and the documented exit status.

DESIGN §3 (exit statuses) and §5 (bad input: never a hang, a traceback, or a followed
link). Every case runs ``python -m vramlock`` as a real subprocess, with XDG_RUNTIME_DIR
in a temporary directory and VRAMLOCK_ARENA unset, so nothing touches the real machine.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vramlock import arena as arena_mod
from vramlock.errors import ArenaError, UnsupportedFilesystem

pytestmark = pytest.mark.timeout(60)

FOREIGN_UID = 12345
SUBPROCESS_TIMEOUT = 30.0
USAGE = 2
OWN_FAILURE = 125


@dataclass
class Outcome:
    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str
    elapsed: float


class ErrCli:
    """Runs ``python -m vramlock ARGS`` isolated from the real machine."""

    def __init__(self, tmp_path: Path) -> None:
        runtime = tmp_path / "err-runtime"
        runtime.mkdir(mode=0o700)
        runtime.chmod(0o700)
        env = dict(os.environ)
        env.pop("VRAMLOCK_ARENA", None)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        self.env = env
        self.cwd = tmp_path

    def __call__(
        self,
        *args: str,
        pass_fds: Collection[int] = (),
        preexec_fn: Callable[[], None] | None = None,
        python_code: str | None = None,
    ) -> Outcome:
        head = ["-c", python_code] if python_code is not None else ["-m", "vramlock"]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, *head, *args],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.cwd,
            timeout=SUBPROCESS_TIMEOUT,
            pass_fds=pass_fds,
            preexec_fn=preexec_fn,
            check=False,
        )
        return Outcome(
            args=args,
            code=proc.returncode,
            stdout=proc.stdout,
            stderr=proc.stderr,
            elapsed=time.monotonic() - start,
        )


def expect_error(out: Outcome, code: int, *fragments: str) -> str:
    """Exactly ``code``, and stderr is exactly one ``vramlock: `` line holding each fragment."""
    detail = f"args={out.args!r} code={out.code} stderr={out.stderr!r}"
    assert "Traceback" not in out.stderr, detail
    assert out.code == code, detail
    lines = out.stderr.splitlines()
    assert len(lines) == 1, detail
    assert out.stderr.endswith("\n"), detail
    line = lines[0]
    assert line.startswith("vramlock: "), detail
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


@pytest.fixture
def errcli(tmp_path: Path) -> ErrCli:
    return ErrCli(tmp_path)


@pytest.fixture
def err_arena(tmp_path: Path) -> Path:
    """An empty, valid arena directory (mode 0700, owned by us)."""
    path = tmp_path / "arena"
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    return path


def _create_lock_file(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.fchmod(fd, 0o644)
    return fd


@pytest.fixture
def err_held_token(err_arena: Path) -> Iterator[int]:
    """The test itself holds the arena's token (flock LOCK_EX) for the duration of the test."""
    fd = _create_lock_file(err_arena / "token.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield fd
    finally:
        os.close(fd)


def _still_held_by_us(token: Path) -> bool:
    """True when another open file description cannot take the token."""
    probe = os.open(token, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(probe)
    return False


def _needs_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (chown to another uid)")


# -- the arena directory ---------------------------------------------------------------


def _arena_commands(path: Path, marker: Path) -> list[list[str]]:
    return [
        ["run", "--arena", str(path), "--", "touch", str(marker)],
        ["wait", "--arena", str(path)],
        ["who", "--arena", str(path)],
    ]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["run", "wait", "who"])
def test_arena_is_a_regular_file(errcli: ErrCli, tmp_path: Path, which: int) -> None:
    path = tmp_path / "afile"
    path.write_text("not a directory\n")
    marker = tmp_path / "ran"
    out = errcli(*_arena_commands(path, marker)[which])
    expect_error(out, OWN_FAILURE, str(path), "is not a directory")
    assert path.read_text() == "not a directory\n"
    assert not marker.exists()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["run", "wait", "who"])
def test_arena_symlink_to_directory_is_refused_not_followed(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, which: int
) -> None:
    link = tmp_path / "alink"
    link.symlink_to(err_arena, target_is_directory=True)
    marker = tmp_path / "ran"
    out = errcli(*_arena_commands(link, marker)[which])
    expect_error(out, OWN_FAILURE, str(link), "symbolic link")
    assert list(err_arena.iterdir()) == [], "the link's target was used"
    assert link.is_symlink()
    assert not marker.exists()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["run", "wait", "who"])
def test_arena_missing_is_never_created(errcli: ErrCli, tmp_path: Path, which: int) -> None:
    path = tmp_path / "no-such-arena"
    marker = tmp_path / "ran"
    out = errcli(*_arena_commands(path, marker)[which])
    expect_error(out, OWN_FAILURE, str(path), "does not exist")
    assert not os.path.lexists(path)
    assert not marker.exists()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["run", "wait", "who"])
def test_arena_world_writable_is_refused(errcli: ErrCli, tmp_path: Path, which: int) -> None:
    path = tmp_path / "open-arena"
    path.mkdir()
    path.chmod(0o777)
    marker = tmp_path / "ran"
    out = errcli(*_arena_commands(path, marker)[which])
    expect_error(out, OWN_FAILURE, str(path), "world-writable")
    assert list(path.iterdir()) == []
    assert not marker.exists()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["run", "wait", "who"])
def test_arena_foreign_owned_is_refused(errcli: ErrCli, tmp_path: Path, which: int) -> None:
    _needs_root("a foreign-owned arena")
    path = tmp_path / "their-arena"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    os.chown(path, FOREIGN_UID, FOREIGN_UID)
    marker = tmp_path / "ran"
    out = errcli(*_arena_commands(path, marker)[which])
    expect_error(out, OWN_FAILURE, str(path), f"owned by uid {FOREIGN_UID}")
    assert list(path.iterdir()) == []
    assert not marker.exists()


_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE = 1
_CAP_DAC_READ_SEARCH = 2


def _without_dac_override() -> Callable[[], None] | None:
    """A preexec_fn that makes a root child obey file modes; None when we are not root.

    Root ignores directory permissions through CAP_DAC_OVERRIDE. Dropping it (and
    CAP_DAC_READ_SEARCH) from the bounding set before exec leaves the child uid 0 (so it
    can still read the root-owned interpreter) but subject to the mode bits.
    """
    if os.geteuid() != 0:
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def drop() -> None:
        for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
            if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop


@pytest.fixture
def err_unwritable_arena(errcli: ErrCli, tmp_path: Path) -> tuple[Path, Callable[[], None] | None]:
    """A mode-0500 arena without lock files, and how to run a child that cannot write it."""
    path = tmp_path / "readonly-arena"
    path.mkdir(mode=0o700)
    path.chmod(0o500)
    drop = _without_dac_override()
    probe = (
        "import sys\ntry:\n    open(sys.argv[1], 'x').close()\nexcept OSError:\n    sys.exit(7)\n"
    )
    try:
        out = errcli(str(path / "probe"), preexec_fn=drop, python_code=probe)
    except subprocess.SubprocessError as err:
        pytest.skip(f"cannot drop root's CAP_DAC_OVERRIDE here: {err}")
    if out.code != 7:
        path.chmod(0o700)
        pytest.skip(f"a mode-0500 directory is writable here (probe exit {out.code})")
    return path, drop


@pytest.mark.parametrize("command", ["run", "wait"])
def test_arena_unwritable_without_lock_files(
    errcli: ErrCli,
    err_unwritable_arena: tuple[Path, Callable[[], None] | None],
    tmp_path: Path,
    command: str,
) -> None:
    path, drop = err_unwritable_arena
    marker = tmp_path / "ran"
    args = ["--arena", str(path)]
    if command == "run":
        args += ["--", "touch", str(marker)]
    out = errcli(command, *args, preexec_fn=drop)
    expect_error(out, OWN_FAILURE, str(path / "token.lock"), "cannot be created")
    assert list(path.iterdir()) == []
    assert not marker.exists()


# -- NFS and friends (statfs cannot be faked end to end; patch the one probe) ----------------


@pytest.mark.parametrize(("magic", "fstype"), sorted(arena_mod._REMOTE_FS.items()))
def test_check_dir_refuses_remote_filesystems(
    monkeypatch: pytest.MonkeyPatch, err_arena: Path, magic: int, fstype: str
) -> None:
    monkeypatch.setattr(arena_mod, "_fs_type", lambda fd: magic)
    fd = os.open(err_arena, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with pytest.raises(UnsupportedFilesystem) as info:
            arena_mod._check_dir(fd, str(err_arena), private=False)
    finally:
        os.close(fd)
    assert isinstance(info.value, ArenaError)
    assert info.value.fstype == fstype
    assert fstype in str(info.value)
    assert str(err_arena) in str(info.value)
    assert info.value.exit_status == OWN_FAILURE


def test_check_dir_accepts_local_filesystem(
    monkeypatch: pytest.MonkeyPatch, err_arena: Path
) -> None:
    monkeypatch.setattr(arena_mod, "_fs_type", lambda fd: 0xEF53)  # ext4
    fd = os.open(err_arena, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = arena_mod._check_dir(fd, str(err_arena), private=True)
    finally:
        os.close(fd)
    assert st.st_ino == err_arena.stat().st_ino


_ON_NFS = """\
import sys
import vramlock.arena
vramlock.arena._fs_type = lambda fd: 0x6969
from vramlock.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--arena", "{arena}", "--", "touch", "{marker}"],
        ["wait", "--arena", "{arena}"],
        ["wait", "-n", "--arena", "{arena}"],
        ["who", "--arena", "{arena}"],
        ["run", "--", "touch", "{marker}"],  # the default arena, created then checked
        ["wait"],
    ],
    ids=["run", "wait", "wait-n", "who", "run-default-arena", "wait-default-arena"],
)
def test_arena_on_nfs_end_to_end(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, command: list[str]
) -> None:
    marker = tmp_path / "ran"
    args = [a.format(arena=err_arena, marker=marker) for a in command]
    out = errcli(*args, python_code=_ON_NFS)
    expect_error(out, OWN_FAILURE, "is on NFS", "flock is not a local advisory lock")
    assert list(err_arena.iterdir()) == []
    assert not marker.exists()


# -- the lock files --------------------------------------------------------------------------

LOCK_NAMES = ["token.lock", "want.lock"]


def _lock_commands(arena: Path, marker: Path) -> dict[str, list[str]]:
    return {
        "run": ["run", "--arena", str(arena), "--", "touch", str(marker)],
        "run-n": ["run", "-n", "--arena", str(arena), "--", "touch", str(marker)],
        "wait": ["wait", "--arena", str(arena)],
        "wait-w": ["wait", "-w", "5", "--arena", str(arena)],
    }


COMMAND_IDS = ["run", "run-n", "wait", "wait-w"]


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_is_a_fifo(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    fifo = err_arena / name
    os.mkfifo(fifo, 0o644)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(err_arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(fifo), "not a regular file")
    assert out.elapsed < 10, "opening a FIFO must not block"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_is_a_directory(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    (err_arena / name).mkdir()
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(err_arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(err_arena / name), "is a directory")
    assert (err_arena / name).is_dir()
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_is_a_symlink_never_followed(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    target = tmp_path / "precious.txt"
    target.write_bytes(b"keep me\n")
    target.chmod(0o600)
    past = time.time_ns() - 3_600_000_000_000
    os.utime(target, ns=(past, past))
    before = target.stat()
    link = err_arena / name
    link.symlink_to(target)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(err_arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(link), "symbolic link")
    assert link.is_symlink()
    assert os.readlink(link) == str(target)
    after = target.stat()
    assert target.read_bytes() == b"keep me\n"
    assert (after.st_mode, after.st_size, after.st_mtime_ns, after.st_uid) == (
        before.st_mode,
        before.st_size,
        before.st_mtime_ns,
        before.st_uid,
    )
    assert not _still_held_by_us(target)
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_world_writable_is_refused(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    os.close(_create_lock_file(err_arena / name))
    (err_arena / name).chmod(0o666)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(err_arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(err_arena / name), "world-writable")
    assert stat.S_IMODE((err_arena / name).stat().st_mode) == 0o666
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_foreign_owned_is_refused(
    errcli: ErrCli, err_arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    _needs_root("a foreign-owned lock file")
    os.close(_create_lock_file(err_arena / name))
    os.chown(err_arena / name, FOREIGN_UID, FOREIGN_UID)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(err_arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(err_arena / name), f"owned by uid {FOREIGN_UID}")
    assert (err_arena / name).stat().st_uid == FOREIGN_UID
    assert not marker.exists()


# -- strategies, demand, option mixes, durations ---------------------------------------------


@pytest.mark.parametrize(
    ("options", "code", "fragments"),
    [
        (["--release", "bogus"], OWN_FAILURE, ["unknown release strategy 'bogus'", "signal"]),
        (["--release", ""], OWN_FAILURE, ["unknown release strategy ''"]),
        (["--demand", "bogus"], OWN_FAILURE, ["unknown demand 'bogus'", "always"]),
        (["--demand", "bogus", "--release", "none"], OWN_FAILURE, ["unknown demand 'bogus'"]),
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


BAD_DURATIONS = ["abc", "-1", "1x", "", "1.5.5", "5 sec"]


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


@pytest.mark.parametrize("value", BAD_DURATIONS)
@pytest.mark.parametrize("option", ["-w", "--timeout"])
def test_wait_bad_duration(errcli: ErrCli, err_arena: Path, option: str, value: str) -> None:
    out = errcli("wait", "--arena", str(err_arena), option, value)
    expect_error(out, USAGE, f"--timeout: bad duration {value!r}")


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
    assert not _still_held_by_us(err_arena / "token.lock")


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
    assert _still_held_by_us(err_arena / "token.lock")


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
    assert _still_held_by_us(err_arena / "token.lock")


def test_run_timeout_with_conflict_code(
    errcli: ErrCli, err_arena: Path, err_held_token: int
) -> None:
    out = errcli("run", "-w", "0.2", "-E", "5", "--arena", str(err_arena), "--", "true")
    expect_error(out, 5, "token not obtained within 0.2 s")
    assert 0.15 <= out.elapsed < 5


@pytest.mark.parametrize(
    ("options", "code", "fragment"),
    [
        (["-n"], 1, "token is held"),
        (["-n", "-E", "9"], 9, "token is held"),
        (["-n", "--free"], 1, "token is held"),
        (["-w", "0.2"], 1, "token not obtained within 0.2 s"),
        (["-w", "0.2", "-E", "9"], 9, "token not obtained within 0.2 s"),
        (["-w", "0.2", "--free"], 1, "token not obtained within 0.2 s"),
    ],
    ids=["n", "n-E9", "n-free", "w", "w-E9", "w-free"],
)
def test_wait_while_held(
    errcli: ErrCli,
    err_arena: Path,
    err_held_token: int,
    options: list[str],
    code: int,
    fragment: str,
) -> None:
    out = errcli("wait", *options, "--arena", str(err_arena))
    expect_error(out, code, fragment)
    if "-w" in options:
        assert 0.15 <= out.elapsed < 5
    else:
        assert out.elapsed < 10
    assert _still_held_by_us(err_arena / "token.lock")


def test_wait_nonblock_when_free_succeeds(errcli: ErrCli, err_arena: Path) -> None:
    out = errcli("wait", "-n", "--arena", str(err_arena))
    assert (out.code, out.stderr) == (0, "")
    assert not _still_held_by_us(err_arena / "token.lock")


# -- wait --fd ------------------------------------------------------------------------------


def _free_descriptor() -> int:
    """A descriptor number that is not open here (and so not in the child either)."""
    for fd in range(9, 4096):
        try:
            os.fstat(fd)
        except OSError as err:
            if err.errno == errno.EBADF:
                return fd
    raise AssertionError("no free descriptor")


def test_wait_fd_not_open(errcli: ErrCli, err_arena: Path) -> None:
    fd = _free_descriptor()
    out = errcli("wait", "--fd", str(fd), "--arena", str(err_arena))
    expect_error(out, USAGE, f"--fd {fd}", "token.lock")
    assert not _still_held_by_us(err_arena / "token.lock")


def test_wait_fd_of_another_file(errcli: ErrCli, err_arena: Path, tmp_path: Path) -> None:
    fd = _create_lock_file(tmp_path / "other.lock")
    try:
        out = errcli("wait", "--fd", str(fd), "--arena", str(err_arena), pass_fds=(fd,))
        expect_error(out, USAGE, f"--fd {fd}", "token.lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody locked it through our fd
    finally:
        os.close(fd)
    assert not _still_held_by_us(err_arena / "token.lock")


def test_wait_fd_of_another_arenas_token(errcli: ErrCli, err_arena: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-arena"
    other.mkdir(mode=0o700)
    fd = _create_lock_file(other / "token.lock")
    try:
        out = errcli("wait", "--fd", str(fd), "--arena", str(err_arena), pass_fds=(fd,))
        expect_error(out, USAGE, f"--fd {fd}", str(err_arena / "token.lock"))
    finally:
        os.close(fd)
    assert not _still_held_by_us(other / "token.lock")


def test_wait_fd_of_the_token_keeps_it_held(errcli: ErrCli, err_arena: Path) -> None:
    """The control case for the two above: the right descriptor works, and stays locked."""
    fd = _create_lock_file(err_arena / "token.lock")
    try:
        out = errcli("wait", "--fd", str(fd), "--arena", str(err_arena), pass_fds=(fd,))
        assert (out.code, out.stderr) == (0, "")
        assert _still_held_by_us(err_arena / "token.lock")
    finally:
        os.close(fd)
    assert not _still_held_by_us(err_arena / "token.lock")


def test_wait_fd_while_held_elsewhere(errcli: ErrCli, err_arena: Path, err_held_token: int) -> None:
    fd = os.open(err_arena / "token.lock", os.O_RDWR | os.O_CLOEXEC)
    try:
        out = errcli(
            "wait", "-n", "-E", "4", "--fd", str(fd), "--arena", str(err_arena), pass_fds=(fd,)
        )
        expect_error(out, 4, "token is held")
    finally:
        os.close(fd)


# -- who ----------------------------------------------------------------------------------------


def test_who_missing_arena(errcli: ErrCli, tmp_path: Path) -> None:
    path = tmp_path / "nowhere"
    for extra in ([], ["--json"]):
        out = errcli("who", "--arena", str(path), *extra)
        expect_error(out, OWN_FAILURE, str(path), "does not exist")
        assert out.stdout == ""
    assert not os.path.lexists(path)


def test_who_missing_arena_from_environment(errcli: ErrCli, tmp_path: Path) -> None:
    path = tmp_path / "nowhere"
    errcli.env["VRAMLOCK_ARENA"] = str(path)
    out = errcli("who")
    expect_error(out, OWN_FAILURE, str(path), "does not exist")
    assert not os.path.lexists(path)


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (["arena", "--arena", "{missing}"], OWN_FAILURE, "does not exist"),
        (["arena", "--arena", "{file}"], OWN_FAILURE, "is not a directory"),
        (["arena", "--gpu", "-1"], USAGE, "--gpu"),
        (["demo", "--seconds", "abc"], USAGE, "--seconds: bad duration 'abc'"),
        (["demo", "--members", "1"], USAGE, "--members"),
        (["demo", "--members", "9"], USAGE, "--members"),
    ],
)
def test_arena_and_demo_errors(
    errcli: ErrCli, tmp_path: Path, args: list[str], code: int, fragment: str
) -> None:
    (tmp_path / "plain-file").write_text("")
    paths = {"missing": str(tmp_path / "nowhere"), "file": str(tmp_path / "plain-file")}
    out = errcli(*(a.format(**paths) for a in args))
    expect_error(out, code, fragment)
    assert not (tmp_path / "nowhere").exists()
