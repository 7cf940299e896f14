"""The arena and its lock files: where they are, and bad ones refused with one clear line.

An arena that is a file, a symlink, missing, unwritable, world-writable,
foreign-owned or on NFS, and a lock file that is a FIFO, a directory, a symlink or
foreign-owned, each get one stderr line and exit status 125 - never a hang, a
traceback, or a followed link. ``python -m vramlock`` runs as a real subprocess.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.errors import (
    FOREIGN_UID,
    OWN_FAILURE,
    USAGE,
    ErrCli,
    create_lock_file,
    expect_error,
    needs_root,
    still_held_by_us,
)

from vramlock.arena import directory as arena_mod
from vramlock.errors import ArenaError, UnsupportedFilesystem

pytestmark = pytest.mark.timeout(60)


# -- where the arena is ------------------------------------------------------------------------


def test_default_arena_follows_xdg_runtime_dir_and_gpu() -> None:
    runtime = os.environ["XDG_RUNTIME_DIR"]
    out = subprocess.run(vramlock("arena", "--gpu", "3"), capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    assert out.stdout.strip() == f"{runtime}/vramlock/gpu3"
    assert os.stat(f"{runtime}/vramlock/gpu3").st_mode & 0o777 == 0o700


def test_default_arenas_may_be_put_elsewhere_by_the_environment(tmp_path: Path) -> None:
    """VRAMLOCK_ARENAS_DIR (a Slurm node's arenas, say) is where the default arenas are,
    whatever XDG_RUNTIME_DIR says; made private there as anywhere."""
    env = dict(os.environ, VRAMLOCK_ARENAS_DIR=str(tmp_path / "arenas"))
    out = subprocess.run(vramlock("arena", "--gpu", "3"), capture_output=True, text=True,
                         timeout=30, env=env)  # fmt: skip
    assert (out.returncode, out.stdout, out.stderr) == (0, f"{tmp_path}/arenas/gpu3\n", "")
    assert os.stat(tmp_path / "arenas" / "gpu3").st_mode & 0o777 == 0o700
    assert not (Path(os.environ["XDG_RUNTIME_DIR"]) / "vramlock" / "gpu3").exists()


def test_arena_command_creates_the_lock_files(errcli: ErrCli, arena: Path) -> None:
    """Scripts open token.lock right after `vramlock arena` (exec 9<"$A/token.lock")."""
    out = errcli("arena", "--arena", str(arena))
    assert (out.code, out.stdout, out.stderr) == (0, f"{arena}\n", "")
    for name in ("token.lock", "want.lock"):
        st = os.lstat(arena / name)
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0
        assert not st.st_mode & stat.S_IWOTH


# -- the arena directory -----------------------------------------------------------------------


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
    errcli: ErrCli, arena: Path, tmp_path: Path, which: int
) -> None:
    link = tmp_path / "alink"
    link.symlink_to(arena, target_is_directory=True)
    marker = tmp_path / "ran"
    out = errcli(*_arena_commands(link, marker)[which])
    expect_error(out, OWN_FAILURE, str(link), "symbolic link")
    assert list(arena.iterdir()) == [], "the link's target was used"
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
def test_a_directory_that_is_not_an_arena_is_refused(
    errcli: ErrCli, tmp_path: Path, which: int
) -> None:
    """The parent of an arena (a path with its last part left off) holds other files."""
    (tmp_path / "arena").mkdir(mode=0o700)
    tmp_path.chmod(0o700)
    marker = tmp_path / "ran"
    before = sorted(os.listdir(tmp_path))
    out = errcli(*_arena_commands(tmp_path, marker)[which])
    expect_error(out, OWN_FAILURE, str(tmp_path), "is not an arena", "mkdir -m 700")
    assert sorted(os.listdir(tmp_path)) == before  # no token.lock, no members/
    assert not marker.exists()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["run", "wait", "who"])
def test_an_empty_directory_becomes_an_arena(errcli: ErrCli, arena: Path, which: int) -> None:
    marker = arena.parent / "ran"
    out = errcli(*_arena_commands(arena, marker)[which])
    assert (out.code, out.stderr) == (0, ""), out
    assert marker.exists() == (which == 0)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["run", "wait", "who"])
def test_an_arena_with_other_files_is_still_one(errcli: ErrCli, arena: Path, which: int) -> None:
    os.close(create_lock_file(arena / "token.lock"))
    (arena / "notes.txt").write_text("whatever the user keeps here\n")
    marker = arena.parent / "ran"
    out = errcli(*_arena_commands(arena, marker)[which])
    assert (out.code, out.stderr) == (0, ""), out
    assert marker.exists() == (which == 0)


def test_the_arena_command_makes_a_directory_with_other_files_an_arena(
    errcli: ErrCli, tmp_path: Path
) -> None:
    tmp_path.chmod(0o700)
    (tmp_path / "notes.txt").write_text("")
    out = errcli("arena", "--arena", str(tmp_path))
    assert (out.code, out.stdout, out.stderr) == (0, f"{tmp_path}\n", ""), out
    marker = tmp_path / "ran"
    out = errcli("run", "--arena", str(tmp_path), "--", "touch", str(marker))
    assert (out.code, out.stderr) == (0, ""), out
    assert marker.exists()


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
    needs_root("a foreign-owned arena")
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
    monkeypatch: pytest.MonkeyPatch, arena: Path, magic: int, fstype: str
) -> None:
    monkeypatch.setattr(arena_mod, "_fs_type", lambda fd: magic)
    fd = os.open(arena, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with pytest.raises(UnsupportedFilesystem) as info:
            arena_mod._check_dir(fd, str(arena), private=False)
    finally:
        os.close(fd)
    assert isinstance(info.value, ArenaError)
    assert info.value.fstype == fstype
    assert fstype in str(info.value)
    assert str(arena) in str(info.value)
    assert info.value.exit_status == OWN_FAILURE


def test_check_dir_accepts_local_filesystem(monkeypatch: pytest.MonkeyPatch, arena: Path) -> None:
    monkeypatch.setattr(arena_mod, "_fs_type", lambda fd: 0xEF53)  # ext4
    fd = os.open(arena, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = arena_mod._check_dir(fd, str(arena), private=True)
    finally:
        os.close(fd)
    assert st.st_ino == arena.stat().st_ino


_ON_NFS = """\
import sys
import vramlock.arena.directory
vramlock.arena.directory._fs_type = lambda fd: 0x6969
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
    errcli: ErrCli, arena: Path, tmp_path: Path, command: list[str]
) -> None:
    marker = tmp_path / "ran"
    args = [a.format(arena=arena, marker=marker) for a in command]
    out = errcli(*args, python_code=_ON_NFS)
    expect_error(out, OWN_FAILURE, "is on NFS", "flock is not a local advisory lock")
    assert list(arena.iterdir()) == []
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
    errcli: ErrCli, arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    fifo = arena / name
    os.mkfifo(fifo, 0o644)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(fifo), "not a regular file")
    assert out.elapsed < 10, "opening a FIFO must not block"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_is_a_directory(
    errcli: ErrCli, arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    (arena / name).mkdir()
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(arena / name), "is a directory")
    assert (arena / name).is_dir()
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_is_a_symlink_never_followed(
    errcli: ErrCli, arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    target = tmp_path / "precious.txt"
    target.write_bytes(b"keep me\n")
    target.chmod(0o600)
    past = time.time_ns() - 3_600_000_000_000
    os.utime(target, ns=(past, past))
    before = target.stat()
    link = arena / name
    link.symlink_to(target)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(arena, marker)[command])
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
    assert not still_held_by_us(target)
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_world_writable_is_refused(
    errcli: ErrCli, arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    os.close(create_lock_file(arena / name))
    (arena / name).chmod(0o666)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(arena / name), "world-writable")
    assert stat.S_IMODE((arena / name).stat().st_mode) == 0o666
    assert not marker.exists()


@pytest.mark.parametrize("name", LOCK_NAMES)
@pytest.mark.parametrize("command", COMMAND_IDS)
def test_lock_file_foreign_owned_is_refused(
    errcli: ErrCli, arena: Path, tmp_path: Path, name: str, command: str
) -> None:
    needs_root("a foreign-owned lock file")
    os.close(create_lock_file(arena / name))
    os.chown(arena / name, FOREIGN_UID, FOREIGN_UID)
    marker = tmp_path / "ran"
    out = errcli(*_lock_commands(arena, marker)[command])
    expect_error(out, OWN_FAILURE, str(arena / name), f"owned by uid {FOREIGN_UID}")
    assert (arena / name).stat().st_uid == FOREIGN_UID
    assert not marker.exists()


# -- who, and the arena command --------------------------------------------------------------


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
    ],
)
def test_arena_command_errors(
    errcli: ErrCli, tmp_path: Path, args: list[str], code: int, fragment: str
) -> None:
    (tmp_path / "plain-file").write_text("")
    paths = {"missing": str(tmp_path / "nowhere"), "file": str(tmp_path / "plain-file")}
    out = errcli(*(a.format(**paths) for a in args))
    expect_error(out, code, fragment)
    assert not (tmp_path / "nowhere").exists()


def test_every_file_of_an_arena_marks_a_directory_as_one() -> None:
    """A directory holding only the budget's or the journal's files is an arena: the
    refusal of a mistyped path must not refuse an arena whose token.lock is not made yet."""
    from vramlock.arena import directory
    from vramlock.arena.budget import BUDGET, CAPACITY, QUEUE

    assert {BUDGET, CAPACITY, QUEUE, directory.JOURNAL} <= directory._ARENA_NAMES
