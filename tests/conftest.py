"""Shared fixtures: every test gets its own arena and runtime directory, and every
process a test starts is reaped by the end of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vramlock.procfs import proc_stat

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("VRAMLOCK_ARENA", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


@pytest.fixture
def arena(tmp_path: Path) -> Path:
    path = tmp_path / "arena"
    path.mkdir(mode=0o700)
    return path


Spawn = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start a process in its own session; SIGKILL and reap whatever is left at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(args: list[str], **kw: object) -> subprocess.Popen[str]:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc: subprocess.Popen[str] = subprocess.Popen(
            args,
            text=True,
            start_new_session=True,
            **kw,  # type: ignore[call-overload]
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        kill_group(proc)
        proc.communicate(timeout=10)


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *descendants(kid)]
    return found


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


def vramlock(*args: str) -> list[str]:
    return [sys.executable, "-m", "vramlock", *args]


def wait_until(what: Callable[[], object], timeout: float = 10.0, step: float = 0.005) -> None:
    """Poll a condition with a deadline (a check, not synchronisation by sleeping)."""
    end = time.monotonic() + timeout
    while not what():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def queued(pid: int) -> bool:
    """Is ``pid`` blocked in a flock (a "->" line of /proc/locks)?"""
    with open("/proc/locks") as f:
        return any(f" {pid} " in line and "->" in line for line in f)
