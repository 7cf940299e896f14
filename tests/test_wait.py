"""``vramlock wait``: queue for the GPU, from a shell; every exit status, end to end.

Real processes throughout (``python -m vramlock wait``): the token held by the test, a
descriptor passed in (``--fd``), flock failing or interrupted (injected in the child),
a storm of signals while it is blocked in the kernel.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.errors import (
    BAD_DURATIONS,
    FAILING_FLOCK,
    FLOCK_FAILURES,
    OWN_FAILURE,
    TOO_LONG,
    USAGE,
    ErrCli,
    create_lock_file,
    expect_error,
    holding_token,
    still_held_by_us,
)
from helpers.processes import Spawn, wait_until

from vramlock import procfs
from vramlock.arena import lockfd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def held_token(arena: Path) -> Iterator[int]:
    with holding_token(arena) as fd:
        yield fd


# -- durations and the token held (-n, -w, -E) --------------------------------------------------


@pytest.mark.parametrize("value", BAD_DURATIONS)
@pytest.mark.parametrize("option", ["-w", "--timeout"])
def test_wait_bad_duration(errcli: ErrCli, arena: Path, option: str, value: str) -> None:
    out = errcli("wait", "--arena", str(arena), option, value)
    expect_error(out, USAGE, f"--timeout: bad duration {value!r}")


@pytest.mark.parametrize("value", TOO_LONG, ids=["9.3e9", "2^31", "hours", "inf"])
def test_wait_too_long_timeout(errcli: ErrCli, arena: Path, value: str) -> None:
    """setitimer cannot take it (it overflowed with a traceback): a usage error."""
    out = errcli("wait", "--arena", str(arena), "-w", value)
    expect_error(out, USAGE, f"--timeout: {value!r} is too long", "at most 2147483647 s")


def test_library_timeout_beyond_any_timer_is_forever(arena: Path) -> None:
    """Through the API, where no usage error can be given, such a timeout waits forever."""
    fd = create_lock_file(arena / "token.lock")
    try:
        assert lockfd.lock_within(fd, exclusive=True, timeout=9.3e9)
    finally:
        os.close(fd)


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
    arena: Path,
    held_token: int,
    options: list[str],
    code: int,
    fragment: str,
) -> None:
    out = errcli("wait", *options, "--arena", str(arena))
    expect_error(out, code, fragment)
    if "-w" in options:
        assert 0.15 <= out.elapsed < 5
    else:
        assert out.elapsed < 10
    assert still_held_by_us(arena / "token.lock")


def test_wait_nonblock_when_free_succeeds(errcli: ErrCli, arena: Path) -> None:
    out = errcli("wait", "-n", "--arena", str(arena))
    assert (out.code, out.stderr) == (0, "")
    assert not still_held_by_us(arena / "token.lock")


# -- --fd: the caller's descriptor ------------------------------------------------------------


def _free_descriptor() -> int:
    """A descriptor number that is not open here (and so not in the child either)."""
    for fd in range(9, 4096):
        try:
            os.fstat(fd)
        except OSError as err:
            if err.errno == errno.EBADF:
                return fd
    raise AssertionError("no free descriptor")


def test_wait_fd_not_open(errcli: ErrCli, arena: Path) -> None:
    fd = _free_descriptor()
    out = errcli("wait", "--fd", str(fd), "--arena", str(arena))
    expect_error(out, USAGE, f"--fd {fd}", "token.lock")
    assert not still_held_by_us(arena / "token.lock")


def test_wait_fd_of_another_file(errcli: ErrCli, arena: Path, tmp_path: Path) -> None:
    fd = create_lock_file(tmp_path / "other.lock")
    try:
        out = errcli("wait", "--fd", str(fd), "--arena", str(arena), pass_fds=(fd,))
        expect_error(out, USAGE, f"--fd {fd}", "token.lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody locked it through our fd
    finally:
        os.close(fd)
    assert not still_held_by_us(arena / "token.lock")


def test_wait_fd_of_another_arenas_token(errcli: ErrCli, arena: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-arena"
    other.mkdir(mode=0o700)
    fd = create_lock_file(other / "token.lock")
    try:
        out = errcli("wait", "--fd", str(fd), "--arena", str(arena), pass_fds=(fd,))
        expect_error(out, USAGE, f"--fd {fd}", str(arena / "token.lock"))
    finally:
        os.close(fd)
    assert not still_held_by_us(other / "token.lock")


def test_wait_fd_of_the_token_keeps_it_held(errcli: ErrCli, arena: Path) -> None:
    """The control case for the two above: the right descriptor works, and stays locked."""
    fd = create_lock_file(arena / "token.lock")
    try:
        out = errcli("wait", "--fd", str(fd), "--arena", str(arena), pass_fds=(fd,))
        assert (out.code, out.stderr) == (0, "")
        assert still_held_by_us(arena / "token.lock")
    finally:
        os.close(fd)
    assert not still_held_by_us(arena / "token.lock")


def test_wait_fd_while_held_elsewhere(errcli: ErrCli, arena: Path, held_token: int) -> None:
    fd = os.open(arena / "token.lock", os.O_RDWR | os.O_CLOEXEC)
    try:
        out = errcli(
            "wait", "-n", "-E", "4", "--fd", str(fd), "--arena", str(arena), pass_fds=(fd,)
        )
        expect_error(out, 4, "token is held")
    finally:
        os.close(fd)


def test_wait_fd_too_large(errcli: ErrCli, arena: Path) -> None:
    """Larger than a C int (it overflowed with a traceback)."""
    out = errcli("wait", "--fd", "2147483648", "--arena", str(arena))
    expect_error(out, USAGE, "--fd", "2147483648")
    assert not (arena / "token.lock").exists()


def test_wait_fd_opened_with_o_path(errcli: ErrCli, arena: Path) -> None:
    """An O_PATH descriptor names token.lock but cannot be locked (flock says EBADF)."""
    os.close(create_lock_file(arena / "token.lock"))
    fd = os.open(arena / "token.lock", os.O_PATH | os.O_CLOEXEC)
    try:
        out = errcli("wait", "--fd", str(fd), "--arena", str(arena), pass_fds=(fd,))
        expect_error(out, USAGE, f"--fd {fd}: opened with O_PATH", "token.lock")
    finally:
        os.close(fd)
    assert not still_held_by_us(arena / "token.lock")


def test_wait_fd_keeps_the_shell_resident(arena: Path) -> None:
    script = (
        f'{sys.executable} -m vramlock arena --arena "{arena}" >/dev/null || exit 9\n'
        f'exec 9<"{arena}/token.lock"\n'
        f'{sys.executable} -m vramlock wait --arena "{arena}" --fd 9 || exit 10\n'
        f'flock -n -x "{arena}/token.lock" true && exit 11\n'
        "exec 9<&-\n"
        f'flock -n -x "{arena}/token.lock" true || exit 12\n'
    )
    result = subprocess.run(["bash", "-c", script], timeout=30)
    assert result.returncode == 0


# -- --free ----------------------------------------------------------------------------------


def test_wait_free_asks_nobody_to_leave(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    log = tmp_path / "hooks"
    spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0",
                 "--on-release", f"echo release >> {log}", "--on-restore", f"echo restore >> {log}",
                 "--", "sleep", "60")
    )  # fmt: skip
    wait_until(lambda: (arena / "token.lock").exists() and still_held_by_us(arena / "token.lock"))
    passive = subprocess.run(
        vramlock("wait", "--arena", str(arena), "--free", "-w", "0.5"), timeout=30
    )
    assert passive.returncode == 1
    assert not log.exists()
    # The control: a waiter that wants the GPU is let in, by a release.
    active = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "20"), timeout=30)
    assert active.returncode == 0
    assert log.read_text().split()[:1] == ["release"]


# -- flock failing, interrupted --------------------------------------------------------------

WAIT_FORMS = {"blocking": [], "n": ["-n"], "w": ["-w", "5"], "free": ["--free"]}


@pytest.mark.parametrize("form", WAIT_FORMS)
@pytest.mark.parametrize("failure", FLOCK_FAILURES)
def test_wait_flock_failure_is_one_line(
    errcli: ErrCli, arena: Path, failure: str, form: str
) -> None:
    """Only EAGAIN/EACCES/EWOULDBLOCK mean "held"; any other errno is an error, not a wait."""
    errcli.env["FLOCK_ERRNO"] = failure
    out = errcli("wait", *WAIT_FORMS[form], "--arena", str(arena), python_code=FAILING_FLOCK)
    first = "token.lock" if form == "free" else "want.lock"  # --free does not take want.lock
    strerror = os.strerror(getattr(errno, failure))
    expect_error(out, OWN_FAILURE, f"cannot lock {arena / first}: {strerror} ({failure})")
    assert out.stdout == "1\n"  # one flock call failed, and nothing was tried after it
    assert not still_held_by_us(arena / "token.lock")


@pytest.mark.parametrize("form", WAIT_FORMS)
def test_wait_retries_eintr(errcli: ErrCli, arena: Path, form: str) -> None:
    """EINTR from flock is a signal whose handler returned: wait on, never an error."""
    errcli.env.update(FLOCK_ERRNO="EINTR", FLOCK_FAILURES="50")
    out = errcli("wait", *WAIT_FORMS[form], "--arena", str(arena), python_code=FAILING_FLOCK)
    assert (out.code, out.stdout, out.stderr) == (0, "50\n", "")


def _blocked_on_token(pid: int, token: Path) -> bool:
    st = os.stat(token)
    entries = procfs.parse_proc_locks(procfs.read_proc_locks(), st.st_dev, st.st_ino)
    return any(e.pid == pid and e.blocked for e in entries)


def test_signal_storm_does_not_end_a_blocked_wait(arena: Path, spawn: Spawn) -> None:
    """`vramlock run` forwards USR1, USR2 and WINCH to its command's process group, where a
    script's `vramlock wait` may be: each interrupts the blocked flock, which goes on."""
    token = arena / "token.lock"
    with holding_token(arena):
        job = spawn(vramlock("wait", "--arena", str(arena)))
        wait_until(lambda: _blocked_on_token(job.pid, token))
        sent = 0
        storm_end = time.monotonic() + 0.5
        while time.monotonic() < storm_end:
            for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH):
                os.kill(job.pid, signum)
                sent += 1
        assert job.poll() is None, f"ended by the storm: {job.communicate()}"
        assert _blocked_on_token(job.pid, token), "lost its place in the kernel's queue"
    out, err = job.communicate(timeout=30)  # the token is free now
    assert (job.returncode, out, err) == (0, "", "")
    assert sent > 1000
