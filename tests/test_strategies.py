"""Release strategies end to end, each checked against an independent witness: each
strategy's ordinary behaviour. Their edges (a command's workers that leave its group or
session, a deleted token lock, words nobody asked for, signals) are in
test_strategies_edges.py.

The witness is a separate process that joins the arena with plain flock calls and
stamps when it held the token; the wrapped command's processes stamp every tick of
their "GPU work" in a log of their own (tests/helpers/stamps.py). A tick inside the
witness's interval is two residents at once, whatever vramlock believes about itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, kill_group, token_free, wait_until, waiting_holder
from helpers.stamps import Witness
from helpers.worker import run_worker, whats

from vramlock import procfs

pytestmark = pytest.mark.timeout(90)


def test_restart_reaps_before_dropping_the_token(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "restart", "--min-hold", "0",
                 "--", "sh", "-c", f"echo $$ >> {pids}; exec sleep 60")
    )  # fmt: skip
    wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 1)
    first = int(pids.read_text().split()[0])
    check = (
        f"import os; p={first}\n"
        "try:\n    os.kill(p, 0); print('alive')\nexcept ProcessLookupError:\n    print('gone')\n"
    )
    shell = subprocess.run(
        ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
         sys.executable, "-c", check],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert shell.stdout.strip() == "gone"
    wait_until(lambda: len(pids.read_text().split()) == 2)
    assert job.poll() is None
    assert who_json(arena)[0]["child_pid"] == int(pids.read_text().split()[1])


def test_restart_jobs_longer_than_min_hold_all_finish(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """Three restart jobs of 0.5 s each, default options: a job ended by a release gets
    a longer turn when started again, so each one finishes (none did in 45 s before)."""
    done = tmp_path / "done"
    jobs = [
        spawn(vramlock("run", "--arena", str(arena), "--release", "restart", "--name", name,
                       "--", "sh", "-c", f"sleep 0.5; echo {name} >> {done}"))
        for name in "abc"
    ]  # fmt: skip
    for job in jobs:
        _, err = job.communicate(timeout=60)
        assert job.returncode == 0, err
    # each finished; one ended by a release just after its echo echoes again when it is
    # started again (a restart job runs from its start)
    assert sorted(set(done.read_text().split())) == ["a", "b", "c"]


def test_a_released_restart_member_shows_no_stale_child(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """While a restart member is released no process of it runs: ``who`` shows none, and
    the new one as soon as it is started again."""
    pids = tmp_path / "pids"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "restart", "--min-hold", "0",
                 "--", "sh", "-c", f"echo $$ >> {pids}; exec sleep 60")
    )  # fmt: skip
    wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 1)

    def shown() -> dict[str, object]:
        return next(m for m in who_json(arena) if m["pid"] == job.pid)

    holder = waiting_holder(spawn, arena)
    wait_until(lambda: shown()["state"] == "waiting")  # released, and queued again
    wait_until(lambda: shown()["child_pid"] is None, timeout=2)
    assert holder.stdin is not None
    holder.stdin.close()
    wait_until(lambda: len(pids.read_text().split()) == 2)
    second = int(pids.read_text().split()[1])
    wait_until(lambda: shown()["child_pid"] == second, timeout=2)
    assert job.poll() is None


def test_stop_strategy_pauses_the_command(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    ticks = tmp_path / "ticks"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "stop", "--min-hold", "0",
                 "--", "sh", "-c", f"while :; do echo x >> {ticks}; sleep 0.01; done")
    )  # fmt: skip
    wait_until(lambda: ticks.exists())
    count = (
        f"import time; n=len(open({str(ticks)!r}).read()); time.sleep(0.3);"
        f" print(len(open({str(ticks)!r}).read()) - n)"
    )
    shell = subprocess.run(
        ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
         sys.executable, "-c", count],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert shell.stdout.strip() == "0"  # no tick while the other one held the GPU
    size = len(ticks.read_text())
    wait_until(lambda: len(ticks.read_text()) > size)  # continued afterwards
    assert job.poll() is None


def test_stop_catches_a_shell_between_fork_and_exec(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """A shell stopped in vfork() waits, in D, for a child that was stopped before its
    exec: it stops once that child goes on, and must not hold up the release."""
    ticks = tmp_path / "ticks"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "stop", "--min-hold", "0",
                 "--", "sh", "-c", f"while :; do echo x >> {ticks}; sleep 0.001; done")
    )  # fmt: skip
    wait_until(ticks.exists)
    for _ in range(40):
        turn = subprocess.run(
            ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
             "true"], timeout=10,
        )  # fmt: skip
        assert turn.returncode == 0
    assert job.poll() is None


def test_exec_hooks_run_in_order(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    log = tmp_path / "hooks"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0",
                 "--on-release", f"echo release $VRAMLOCK_CHILD_PID >> {log}",
                 "--on-restore", f"echo restore $VRAMLOCK_CHILD_PID >> {log}",
                 "--", "sleep", "60")
    )  # fmt: skip
    wait_until(lambda: who_json(arena) and who_json(arena)[0]["strategy"] == "exec")
    child = who_json(arena)[0]["child_pid"]
    subprocess.run(
        ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
         "true"],
        timeout=30, check=True,
    )  # fmt: skip
    wait_until(lambda: log.exists() and len(log.read_text().splitlines()) == 2)
    assert log.read_text().split() == ["release", str(child), "restore", str(child)]
    assert job.poll() is None


def test_failing_release_hook_keeps_the_command_resident(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    job = spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0", "--on-release", "exit 3",
                 "--", "sleep", "60")
    )  # fmt: skip
    wait_until(lambda: who_json(arena) and who_json(arena)[0]["state"] == "resident")
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "0.5"), timeout=30)
    assert waiter.returncode == 1
    kill_group(job)
    assert job.stderr is not None
    err = job.stderr.read()
    assert "release failed: --on-release command exited with status 3; staying resident" in err


def test_demand_child_waits_for_want(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    log = tmp_path / "log"
    env = dict(os.environ, WORKER_WANT="0")
    job = run_worker(spawn, arena, worker, log, "lazy", "--demand", "child", env=env)
    subprocess.run(vramlock("wait", "--arena", str(arena)), timeout=30, check=True)
    wait_until(lambda: whats(log, "lazy") == ["start", "release"])
    wait_until(lambda: who_json(arena)[0]["state"] == "released")
    assert token_free(arena)  # it did not come back: the child never said want
    assert job.poll() is None


def test_yield_within_ends_a_deaf_command_and_restarts_it(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    log = tmp_path / "log"
    env = dict(os.environ, WORKER_DEAF="1")
    job = run_worker(
        spawn, arena, worker, log, "deaf", "--release", "signal", "--yield-within", "0.3", env=env
    )
    started = time.monotonic()
    subprocess.run(vramlock("wait", "--arena", str(arena)), timeout=30, check=True)
    assert time.monotonic() - started >= 0.3
    wait_until(lambda: whats(log, "deaf") == ["start", "start"])  # relaunched on its turn
    assert job.poll() is None
    assert job.stderr is not None
    kill_group(job)
    assert "signal release did not finish within 0." in job.stderr.read()


def test_command_that_closes_its_channel_keeps_the_gpu(arena: Path, spawn: Spawn) -> None:
    code = (
        "import time\nfrom vramlock import child\n"
        "ctl = child.connect()\nprint('hello', flush=True)\ntime.sleep(0.3)\nctl.close()\n"
        "time.sleep(60)\n"
    )
    job = spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0", "--", sys.executable, "-c", code)
    )
    assert job.stdout is not None and job.stdout.readline().strip() == "hello"
    wait_until(lambda: who_json(arena)[0]["strategy"] == "auto:signal")
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "2"), timeout=30)
    assert waiter.returncode == 1
    assert who_json(arena)[0]["strategy"] == "auto:none"
    kill_group(job)
    assert job.stderr is not None
    assert "closed its control channel" in job.stderr.read()


def test_auto_prefers_signal_to_a_preset_for_a_command_that_says_hello(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    # Named llama-server, it gets that preset from its command line; it speaks the
    # control protocol, which knows best what to keep.
    server = tmp_path / "llama-server"
    server.write_text(
        f"#!{sys.executable}\nimport time\nfrom vramlock import child\n"
        "ctl = child.connect()\nprint('hello', flush=True)\ntime.sleep(60)\n"
    )
    server.chmod(0o755)
    job = spawn(vramlock("run", "--arena", str(arena), "--", str(server)))
    assert job.stdout is not None and job.stdout.readline().strip() == "hello"
    wait_until(lambda: who_json(arena)[0]["strategy"] == "auto:signal")
    job.send_signal(signal.SIGTERM)  # passed on; the wrapper removes the preset's slot directory
    assert job.wait(30) == 128 + signal.SIGTERM


def test_verified_release_believes_nvml_not_the_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    """With NVML, a release is done when the memory is gone: a CUDA context's worth per
    process may stay; more than that after the timeout is Unverified (the runner warns)."""
    from typing import Any, cast

    from vramlock.gpu import nvml
    from vramlock.strategies import Settings, SignalStrategy, Unverified

    held = {4242: 3 << 30, 999: 5 << 30}  # 999 is not the command's
    queries: list[object] = []

    def processes(which: object = None) -> dict[int, int]:
        queries.append(which)
        return dict(held)

    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "processes", processes)
    strategy = SignalStrategy(cast(Any, None), Settings(gpus=(0,), verify_timeout=0.2))

    def ours(pid: int) -> bool:
        return pid in (4242, 4243)

    with pytest.raises(Unverified, match="NVML still shows 3072 MiB held by the command"):
        strategy.verify_gone(ours, keep_bytes=768 << 20)
    held[4242] = 500 << 20  # only its context left
    queries.clear()
    strategy.verify_gone(ours, keep_bytes=768 << 20)
    assert queries == [(0,)]  # free already: one NVML query on the handoff path, no polling
    with pytest.raises(Unverified):  # a checkpoint leaves nothing at all
        strategy.verify_gone(lambda pid: pid == 4242, keep_bytes=0)


def test_a_process_of_the_command_is_told_without_a_scan_of_every_process(
    tmp_path: Path,
) -> None:
    """Child.owns (for NVML's pids, at a release): the command, a worker that left its
    group, not the wrapper's own helpers, not a process that is no descendant."""
    from vramlock.command.process import Child

    pids = tmp_path / "pids"
    script = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{w.pid}}\\n')\n"
        "time.sleep(60)\n"
    )
    child = Child([sys.executable, "-c", script], dict(os.environ), ())
    try:
        wait_until(lambda: pids.exists() and pids.read_text().endswith("\n"))
        worker = int(pids.read_text())
        assert procfs.pgrp(worker) != child.pid  # it left the group
        assert child.owns(child.pid) and child.owns(worker)
        assert not child.owns(os.getppid()) and not child.owns(1)
        child.ignored.add(worker)
        assert not child.owns(worker)
    finally:
        child.ignored.clear()
        child.end_all(0.5)
        child.close()


def test_checkpoint_is_refused_where_the_driver_cannot(arena: Path) -> None:
    from vramlock.gpu import cuda

    if cuda.has_checkpoint_api():
        pytest.skip("this machine's driver has the checkpoint API")
    out = subprocess.run(
        vramlock("run", "--arena", str(arena), "--release", "checkpoint", "--", "true"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 125
    assert out.stderr.startswith("vramlock: --release checkpoint cannot be used here: ")
    assert out.stderr.count("\n") == 1


EXITS_WHILE_RELEASED = textwrap.dedent(
    """
    import os, socket, time
    sock = socket.socket(fileno=int(os.environ["VRAMLOCK_CONTROL_FD"]))
    sock.sendall(b"hello\\n")
    buf = b""
    while b"release\\n" not in buf:
        buf += sock.recv(100)
    sock.sendall(b"released\\n")
    time.sleep(0.5)  # its wrapper is queued for the token again by now
    os._exit(3)
    """
)


def test_a_released_command_that_exits_is_seen_while_queued(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """The wrapper blocks in the kernel's queue for the token; the command's exit must end
    that wait at once, not when the token comes back."""
    script = tmp_path / "child.py"
    script.write_text(EXITS_WHILE_RELEASED)
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "signal", "--min-hold", "0",
                 "--", sys.executable, str(script))
    )  # fmt: skip
    wait_until(lambda: who_json(arena) and who_json(arena)[0]["strategy"] == "signal")
    witness = Witness(tmp_path, arena, hold=20)
    witness.wait_held()
    started = time.monotonic()
    _, err = job.communicate(timeout=15)
    assert job.returncode == 3, err
    assert time.monotonic() - started < 5  # not the witness's 20 s
    assert witness.proc.poll() is None
    witness.proc.kill()
    witness.proc.wait(10)
