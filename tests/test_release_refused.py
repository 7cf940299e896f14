"""Every release has a deadline, whatever asks the command to release: its control
channel (``signal``), a hook (``exec``), a server (``http``). Past ``--release-within``
the release is refused with the reason, the command stays resident, it is said once,
``who`` shows it, and a waiter is told (and waits on).

Witnesses: the test's own waiter (``vramlock wait``, its exit status and stderr), the
command's own log or pid file, a socket the test listens on, ``who``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, kill_group, queued, wait_until
from helpers.worker import run_worker, whats

from vramlock import procfs

pytestmark = pytest.mark.timeout(90)


def _note(arena: Path, name: str) -> str:
    rows = [r for r in who_json(arena) if r["name"] == name]
    return (rows[0]["note"] or "") if rows else ""


def _told(name: str, pid: int, why: str) -> str:
    return f"vramlock: the resident {name} (pid {pid}) could not release: {why}; still waiting"


def _refused(why: str) -> str:
    return f"vramlock: release refused: {why}; staying resident"


def test_a_deaf_signal_command_has_its_release_refused_and_the_waiter_told(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    """The release waited for ever for a `released` that never came, the waiter too."""
    log = tmp_path / "log"
    env = dict(os.environ, WORKER_DEAF="1")
    job = run_worker(spawn, arena, worker, log, "deaf", "--name", "deaf", "--release", "signal",
                     "--release-within", "0.3", env=env)  # fmt: skip
    (child,) = procfs.children(job.pid)
    waiter = spawn(vramlock("wait", "--arena", str(arena), "-w", "30"))
    assert waiter.stderr is not None
    brief = f"process {child} did not answer in 0.3 s"
    assert waiter.stderr.readline().rstrip("\n") == _told("deaf", job.pid, brief)
    assert _note(arena, "deaf") == f"release refused: {brief}"
    assert queued(waiter.pid) and waiter.poll() is None  # it waits on
    assert whats(log, "deaf") == ["start"]  # resident all along, never ended
    job.send_signal(signal.SIGTERM)  # passed on: the worker ends, the token goes
    _, err = job.communicate(timeout=30)
    assert waiter.wait(30) == 0
    assert waiter.stderr.read() == ""  # said once
    within = "did not answer the release within 0.3 s (--release-within)"
    said = _refused(f"process {child} of the command {within}")
    assert err.splitlines().count(said) == 1, err
    assert "Traceback" not in err


def test_a_release_hook_that_never_ends_is_killed_and_the_release_refused(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """An --on-release command that never ended held the release, and the waiter, for ever."""
    hook, log = tmp_path / "hook.pid", tmp_path / "log"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--name", "job", "--min-hold", "0",
                 "--release-within", "0.3", "--on-release", f"echo $$ > {hook}; exec sleep 60",
                 "--on-restore", f"echo restored >> {log}", "--", "sleep", "60")
    )  # fmt: skip
    wait_until(lambda: who_json(arena) and who_json(arena)[0]["state"] == "resident")
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "3"),
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert waiter.returncode == 1
    brief = "--on-release did not answer in 0.3 s"
    assert waiter.stderr.splitlines().count(_told("job", job.pid, brief)) == 1, waiter.stderr
    assert _note(arena, "job") == f"release refused: {brief}"
    assert procfs.state(int(hook.read_text())) in (None, "Z")  # the hook was ended
    assert "restored" in log.read_text().split()  # and the command restored
    assert job.poll() is None
    kill_group(job)
    assert job.stderr is not None
    err = job.stderr.read()
    said = _refused(
        "the --on-release command did not answer the release within 0.3 s (--release-within)"
    )
    assert err.splitlines().count(said) == 1, err


@pytest.fixture
def silent() -> Iterator[int]:
    """A port where connections are taken (by the kernel) and never answered."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def test_a_server_that_never_answers_the_release_has_it_refused(
    arena: Path, spawn: Spawn, silent: int
) -> None:
    """--on-release-url to a server that never answers waited its own 120 s, then failed."""
    job = spawn(
        vramlock("run", "--arena", str(arena), "--name", "srv", "--min-hold", "0",
                 "--release", "http", "--release-within", "0.3",
                 "--on-release-url", f"http://127.0.0.1:{silent}/release",
                 "--", sys.executable, "-c", "import time; time.sleep(60)")
    )  # fmt: skip
    wait_until(lambda: who_json(arena) and who_json(arena)[0]["state"] == "resident")
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "3"),
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert waiter.returncode == 1
    brief = "http did not answer in 0.3 s"
    assert waiter.stderr.splitlines().count(_told("srv", job.pid, brief)) == 1, waiter.stderr
    assert _note(arena, "srv") == f"release refused: {brief}"
    assert job.poll() is None
    kill_group(job)
    assert job.stderr is not None
    err = job.stderr.read()
    said = _refused("http did not answer the release within 0.3 s (--release-within)")
    assert err.splitlines().count(said) == 1, err
