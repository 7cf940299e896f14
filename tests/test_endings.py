"""Every ending signal ends ``vramlock run`` within a second or two, whatever it is doing:
queued for the token as it comes back, waiting for a server to be ready, waiting on a
hook that hangs. The witnesses are the wrapper's exit and the command's processes, seen
in /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.engines import MakeEngine, wrap
from helpers.net import free_port
from helpers.processes import Spawn, queued, wait_until, waiting_holder

from vramlock import procfs

pytestmark = pytest.mark.timeout(120)

# Ended within this (the signal passed on, the command's exit seen, the tokens dropped).
PROMPT = 3.0


def ended_within(job: subprocess.Popen[str], seconds: float = PROMPT) -> int:
    started = time.monotonic()
    try:
        job.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds} s after the signal") from None
    assert time.monotonic() - started < seconds
    return job.returncode


def test_restart_members_told_to_end_together_both_end(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """Two restart members handing the token back and forth, SIGTERMed at once: the one
    queued as the token comes back must not start its command again and keep it."""
    for round_ in range(6):
        pids = tmp_path / f"pids{round_}"
        jobs = [
            spawn(vramlock("run", "--arena", str(arena), "--release", "restart",
                           "--min-hold", "0", "--", "sh", "-c",
                           f"echo $$ >> {pids}; exec sleep 600"))
            for _ in range(2)
        ]  # fmt: skip
        # Both have started their command at least once: they are taking turns.
        wait_until(lambda p=pids: p.exists() and len(p.read_text().split()) >= 3)  # type: ignore[misc]
        time.sleep(round_ * 0.013)
        for job in jobs:
            os.kill(job.pid, signal.SIGTERM)
        for job in jobs:
            assert ended_within(job) == 128 + signal.SIGTERM, job.communicate()
        assert [p for p in map(int, pids.read_text().split()) if procfs.living(p)] == []


def test_sigquit_to_a_waiting_run_is_131(arena: Path, spawn: Spawn) -> None:
    holder = waiting_holder(spawn, arena)
    job = spawn(vramlock("run", "--arena", str(arena), "--", "true"))
    wait_until(lambda: queued(job.pid))
    os.kill(job.pid, signal.SIGQUIT)
    assert ended_within(job) == 128 + signal.SIGQUIT
    _, err = job.communicate()
    assert err == ""
    assert holder.poll() is None


def test_ending_while_the_server_loads_behind_listen(
    arena: Path, spawn: Spawn, engine: MakeEngine
) -> None:
    """Clients are held until the server answers /health; an ending signal meanwhile
    is passed on at once, not after the server is ready."""
    eng = engine("llama-server", loading="60")
    job = spawn(
        vramlock("run", "--arena", str(arena), "--demand", "listen", "--listen",
                 str(free_port()), "--upstream", str(eng.port), "--", *eng.argv),
        env=dict(os.environ, **eng.env),
    )  # fmt: skip
    wait_until(lambda: eng.count("req GET /health") >= 2)  # loading: 503 meanwhile
    os.kill(job.pid, signal.SIGTERM)
    assert ended_within(job) == 0  # the fake's own status on SIGTERM
    assert eng.count("exit") == 1


def test_ending_while_a_restore_url_hangs(arena: Path, spawn: Spawn, engine: MakeEngine) -> None:
    """--on-restore-url names something that takes the request and never answers."""
    eng = engine("generic")
    with socket.create_server(("127.0.0.1", 0)) as mute:  # never accepts: never answers
        job = wrap(spawn, arena, eng, "--on-release-url", f"http://127.0.0.1:{eng.port}/off",
                   "--on-restore-url", f"http://127.0.0.1:{mute.getsockname()[1]}/on")  # fmt: skip
        holder = waiting_holder(spawn, arena)
        assert holder.stdin is not None
        wait_until(lambda: eng.count("req POST /off") == 1)
        holder.stdin.close()  # the token goes back: the restore hangs
        wait_until(lambda: who_json(arena)[0]["state"] == "restoring")
        os.kill(job.pid, signal.SIGTERM)
        assert ended_within(job) == 0  # the fake's own status on SIGTERM
    assert eng.count("exit") == 1


def test_ending_while_a_release_hook_runs(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    """--release exec: the wrapper told to end while its --on-release command runs."""
    started = tmp_path / "hook"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0", "--on-release",
                 f"touch {started}; exec sleep 60", "--", sys.executable, "-c",
                 "import time; time.sleep(600)")
    )  # fmt: skip
    wait_until(lambda: (arena / "token.lock").exists())
    time.sleep(0.2)
    waiter = spawn(vramlock("wait", "--arena", str(arena), "-w", "30"))
    wait_until(started.exists)
    os.kill(job.pid, signal.SIGTERM)
    assert ended_within(job) == 128 + signal.SIGTERM
    assert waiter.wait(10) == 0


# A command that ignores SIGTERM and says its pid once it does.
_DEAF = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_restart_command_deaf_to_sigterm_is_killed_after_yield_within(
    arena: Path, spawn: Spawn
) -> None:
    """Told to end, a command that ignores SIGTERM gets --yield-within to exit, then
    SIGKILL: the wrapper ends, and with it the command and its hold on the token."""
    job = spawn(vramlock("run", "--arena", str(arena), "--release", "restart",
                         "--yield-within", "1", "--", sys.executable, "-c", _DEAF))  # fmt: skip
    assert job.stdout is not None
    pid = int(job.stdout.readline())
    os.kill(job.pid, signal.SIGTERM)
    assert ended_within(job, 1 + PROMPT) == 128 + signal.SIGKILL
    assert not procfs.living(pid)
    _, err = job.communicate()
    assert "did not end within 1 s of SIGTERM; killing it" in err


def test_a_command_deaf_to_sigterm_is_killed_after_10_s_by_default(
    arena: Path, spawn: Spawn
) -> None:
    """Any strategy (auto finds none for this one): SIGKILL 10 s after SIGTERM."""
    job = spawn(vramlock("run", "--arena", str(arena), "--", sys.executable, "-c", _DEAF))
    assert job.stdout is not None
    pid = int(job.stdout.readline())
    os.kill(job.pid, signal.SIGTERM)
    started = time.monotonic()
    assert ended_within(job, 10 + PROMPT) == 128 + signal.SIGKILL
    assert time.monotonic() - started > 9.5
    assert not procfs.living(pid)
