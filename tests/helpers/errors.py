"""Running ``python -m vramlock`` isolated from the real machine, and checking its one
line of error and its exit status."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

FOREIGN_UID = 12345


SUBPROCESS_TIMEOUT = 30.0


USAGE = 2


OWN_FAILURE = 125


@dataclass
class Outcome:
    """What one ``python -m vramlock`` run did: its status, output and wall time."""

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
        stdout: int = subprocess.PIPE,
    ) -> Outcome:
        head = ["-c", python_code] if python_code is not None else ["-m", "vramlock"]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, *head, *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
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
            stdout=proc.stdout or "",
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


def create_lock_file(path: Path) -> int:
    """Open (creating) ``path`` as vramlock does a lock file, mode 0644."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.fchmod(fd, 0o644)
    return fd


@contextmanager
def holding_token(arena: Path) -> Iterator[int]:
    """The test itself holds the arena's token (flock LOCK_EX) inside the block."""
    fd = create_lock_file(arena / "token.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield fd
    finally:
        os.close(fd)


def still_held_by_us(token: Path) -> bool:
    """True when another open file description cannot take the token."""
    probe = os.open(token, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(probe)
    return False


def needs_root(what: str) -> None:
    """Skip the test unless it runs as root (``what`` says what needs it)."""
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (chown to another uid)")


# Runs ``vramlock ARGS`` with fcntl.flock failing with errno $FLOCK_ERRNO, for the first
# $FLOCK_FAILURES lock requests (all of them when unset); at exit it prints how many failed.
FAILING_FLOCK = """\
import atexit, errno, fcntl, os, sys

real = fcntl.flock
code = getattr(errno, os.environ["FLOCK_ERRNO"])
limit = int(os.environ.get("FLOCK_FAILURES", "-1"))


class Failing:  # an instance, not a function: portalocker keeps flock in a class attribute
    failed = 0

    def __call__(self, fd, op):
        if op & (fcntl.LOCK_SH | fcntl.LOCK_EX) and Failing.failed != limit:
            Failing.failed += 1
            raise OSError(code, os.strerror(code))
        return real(fd, op)


fcntl.flock = Failing()
atexit.register(lambda: print(Failing.failed))
from vramlock.cli import main
main(sys.argv[1:])
"""


# Neither "somebody holds it" nor EINTR: each must end in one line and status 125.
FLOCK_FAILURES = ["ENOLCK", "EIO", "EBADF", "EINVAL"]


BAD_DURATIONS = ["abc", "-1", "1x", "", "1.5.5", "5 sec"]


# Longer than any timer can be set for (setitimer overflowed): a usage error, not a traceback.
TOO_LONG = ["9300000000", "2147483648", "600000h", "9" * 400]
