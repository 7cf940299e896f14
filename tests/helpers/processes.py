"""Starting, holding and reaping processes, and waiting with deadlines."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vramlock.procfs import descendants, proc_stat, read_proc_locks

Spawn = Callable[..., "subprocess.Popen[str]"]


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process and everything it started, then reap it.

    ``vramlock run`` puts its command in a process group of its own, so the
    descendants are found through /proc and killed one by one as well.
    """
    pids = [*descendants(proc.pid), proc.pid]
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait(10)
    # Dead means exited (a zombie at most), and only then are its locks gone.
    wait_until(lambda: all(_state(pid) in ("Z", "X", None) for pid in pids))


def _state(pid: int) -> str | None:
    fields = proc_stat(pid)
    return fields[0] if fields else None


def wait_until(what: Callable[[], object], timeout: float = 10.0, step: float = 0.005) -> None:
    """Poll a condition with a deadline (a check, not synchronisation by sleeping)."""
    end = time.monotonic() + timeout
    while not what():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def queued(pid: int) -> bool:
    """Is ``pid`` blocked in a flock (a "->" line of /proc/locks)?"""
    return any(f" {pid} " in line and "->" in line for line in read_proc_locks().splitlines())


def hold(spawn: Spawn, path: Path, mode: str = "-x") -> subprocess.Popen[str]:
    """A flock(1) process holding ``path`` until killed; returns once it holds it."""
    proc = spawn(["flock", mode, str(path), "sh", "-c", "echo held; exec sleep 60"])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def waiting_holder(spawn: Spawn, arena: Path) -> subprocess.Popen[str]:
    """flock(1) as a waiter (want.lock shared, then token.lock), holding the token until its
    stdin is closed; returns once it holds it. Residents see it waiting, as any member."""
    proc = spawn(
        ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
         "sh", "-c", "echo held; read line"],
        stdin=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def token_free(arena: Path) -> bool:
    """Could a flock(1) take the token at once?"""
    probe = subprocess.run(["flock", "-n", "-x", str(arena / "token.lock"), "true"], timeout=10)
    return probe.returncode == 0


def sigint_default() -> None:
    """preexec_fn: SIGINT's default action in the child, for a test that sends it. Where
    the shell that started the tests ignores SIGINT (a background job), the child inherits
    SIG_IGN, and Python then installs no KeyboardInterrupt: Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


_UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc")


@functools.cache
def _own_pid_namespace() -> tuple[str, ...] | None:
    for prefix in (_UNSHARE, (*_UNSHARE, "--user", "--map-root-user")):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
    return None


def own_pid_namespace() -> list[str]:
    """A prefix that runs a command in a pid namespace of its own, where only the
    command's own processes are made: on a host that starts processes all the time (a
    test machine) something is woken by every new pid, on a quiet one (a GPU server)
    nothing is. Skips the test where no pid namespace can be made here."""
    prefix = _own_pid_namespace()
    if prefix is None:
        pytest.skip("no pid namespace can be made here (unshare)")
    return [*prefix, "--"]
