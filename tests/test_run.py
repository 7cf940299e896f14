"""``vramlock run`` / ``wait`` / ``who`` end to end, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, kill_group, queued, token_free, wait_until
from helpers.worker import events, run_worker, whats

pytestmark = pytest.mark.timeout(90)


def test_sleep_serialises_with_another_run(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    stamp = tmp_path / "stamps"
    job = f"echo start $(date +%s.%N) >> {stamp}; sleep 0.4; echo end $(date +%s.%N) >> {stamp}"
    a = spawn(vramlock("run", "--arena", str(arena), "--", "sh", "-c", job))
    wait_until(lambda: stamp.exists())
    b = spawn(vramlock("run", "--arena", str(arena), "--", "sh", "-c", job))
    assert a.wait(30) == 0 and b.wait(30) == 0
    lines = [ln.split() for ln in stamp.read_text().splitlines()]
    assert [w for w, _ in lines] == ["start", "end", "start", "end"]
    assert float(lines[1][1]) <= float(lines[2][1])


def test_shell_script_and_flock1_contention(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    """`none` (the default for a plain script) holds until exit; flock(1) waits for it."""
    order = tmp_path / "order"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\necho working\nsleep 0.5\necho script >> {order}\n")
    script.chmod(0o755)
    job = spawn(vramlock("run", "--arena", str(arena), "--name", "script", "--", str(script)))
    assert job.stdout is not None and job.stdout.readline().strip() == "working"
    rows = who_json(arena)
    assert rows[0]["name"] == "script" and rows[0]["strategy"] == "auto:none"
    shell = subprocess.run(
        ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
         "sh", "-c", f"echo shell >> {order}"],
        timeout=30,
    )  # fmt: skip
    assert shell.returncode == 0
    assert job.wait(10) == 0  # the script was never interrupted
    assert order.read_text().split() == ["script", "shell"]


def test_python_child_steps_aside_for_flock1(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    log = tmp_path / "log"
    job = run_worker(spawn, arena, worker, log, "py")
    assert who_json(arena)[0]["strategy"] == "auto:signal"
    shell = subprocess.run(
        ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
         "sh", "-c", "echo $(cat /proc/uptime) >/dev/null; echo shell-got-it"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert shell.stdout.strip() == "shell-got-it"
    wait_until(lambda: whats(log, "py") == ["start", "release", "restore"])
    assert job.poll() is None
    job.send_signal(signal.SIGTERM)
    assert job.wait(10) == 128 + signal.SIGTERM


def test_two_cooperative_runs_take_turns(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    log = tmp_path / "log"
    for name in ("a", "b"):
        spawn(
            vramlock("run", "--arena", str(arena), "--release", "signal", "--min-hold", "50ms",
                     "--name", name, "--", sys.executable, str(worker), str(log), name)
        )  # fmt: skip
    wait_until(lambda: min(whats(log, n).count("restore") for n in "ab") >= 3)
    # Residency intervals never overlap: start/restore opens one, release closes it.
    holder = None
    for _, name, what in events(log):
        if what in ("start", "restore"):
            assert holder is None, f"{name} became resident while {holder} was"
            holder = name
        elif what == "release":
            assert holder == name
            holder = None


def test_members_told_to_end_together_do_not_pass_the_gpu_back_and_forth(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    """Both wrappers get SIGTERM; each command takes 1.5 s to exit, obeying requests
    meanwhile. The resident one keeps the GPU for its exit, then the other is restored
    to act on the signal: no release after the signal, where there used to be one per
    --min-hold."""
    log = tmp_path / "log"
    env = dict(os.environ, WORKER_LINGER="1.5")
    run = vramlock("run", "--arena", str(arena), "--release", "signal", "--min-hold", "0.3")
    jobs = [
        spawn([*run, "--name", name, "--", sys.executable, str(worker), str(log), name], env=env)
        for name in "ab"
    ]
    wait_until(lambda: min(whats(log, n).count("restore") for n in "ab") >= 1)
    signalled = time.monotonic()
    for job in jobs:
        job.send_signal(signal.SIGTERM)
    for job in jobs:
        assert job.wait(30) == 0
    after = [(n, w) for t, n, w in events(log) if t > signalled]
    # A release asked for just before the signal may be said after it; no other comes.
    assert [w for _, w in after if w == "release"] in ([], ["release"]), after
    assert sorted(n for n, w in after if w == "exit") == ["a", "b"]


def test_a_command_slow_to_end_still_yields_within_its_bound(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    """Told to end, a command keeps the GPU for its exit - but no longer than
    --yield-within, as a busy one."""
    log = tmp_path / "log"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "signal", "--min-hold", "0",
                 "--yield-within", "0.5", "--", sys.executable, str(worker), str(log), "a"),
        env=dict(os.environ, WORKER_LINGER="60"),
    )  # fmt: skip
    wait_until(lambda: whats(log, "a") == ["start"])
    job.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    started = time.monotonic()
    got = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "10"), timeout=30)
    assert got.returncode == 0
    assert 0.3 < time.monotonic() - started < 5
    assert whats(log, "a")[:2] == ["start", "release"]


def test_sigkilled_runner_leaves_token_with_child(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    marker = tmp_path / "child-started"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--", "sh", "-c",
                 f"touch {marker}; sleep 1.5; echo done")
    )  # fmt: skip
    wait_until(marker.exists)
    job.send_signal(signal.SIGKILL)
    job.wait(10)
    # The command is still running and still resident: the token is held.
    assert not token_free(arena)
    wait_ = subprocess.run(vramlock("wait", "--arena", str(arena), "-n"), timeout=30)
    assert wait_.returncode == 1
    wait_until(lambda: token_free(arena), timeout=10)


def test_signals_are_forwarded_to_the_command(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    got = tmp_path / "got"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--", "sh", "-c",
                 f"trap 'echo usr1 >> {got}' USR1; trap 'echo term >> {got}; exit 7' TERM;"
                 f" echo ready; while :; do sleep 0.01; done")
    )  # fmt: skip
    assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    job.send_signal(signal.SIGUSR1)
    wait_until(lambda: got.exists() and "usr1" in got.read_text())
    job.send_signal(signal.SIGTERM)
    assert job.wait(10) == 7
    assert got.read_text().split() == ["usr1", "term"]
    assert token_free(arena)


def test_demo_runs_without_a_gpu() -> None:
    out = subprocess.run(vramlock("demo", "--seconds", "3"), capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "token -> " in out.stdout
    assert "handoffs in 3 s between 3 programs" in out.stdout
    assert "median handoff" in out.stdout


def test_script_without_shebang_runs_with_sh(arena: Path, tmp_path: Path) -> None:
    script = tmp_path / "plain"
    script.write_text("echo from-sh\nexit 4\n")
    script.chmod(0o755)
    out = subprocess.run(
        vramlock("run", "--arena", str(arena), "--", str(script)),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert (out.returncode, out.stdout, out.stderr) == (4, "from-sh\n", "")


def _in_pty(args: list[str], keys: bytes, expect: bytes) -> tuple[int, bytes]:
    """Run ``args`` as the foreground job of a new terminal; type ``keys`` once ``expect``
    is on the screen. Returns the exit status and everything the terminal showed."""
    import fcntl
    import pty
    import select
    import termios

    master, slave = pty.openpty()

    def controlling_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        args, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=controlling_terminal,
    )  # fmt: skip
    os.close(slave)
    seen, typed = b"", False
    end = time.monotonic() + 30
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break  # the terminal was hung up: everybody left
                if not chunk:
                    break
                seen += chunk
            if not typed and expect in seen:
                os.write(master, keys)
                typed = True
            if proc.poll() is not None and not ready:
                break
        return proc.wait(10), seen
    finally:
        if proc.poll() is None:
            kill_group(proc)  # type: ignore[arg-type]
        os.close(master)


def test_command_owns_the_terminal(arena: Path) -> None:
    """In a terminal the command can read it, and gets Ctrl-C itself."""
    code, seen = _in_pty(
        vramlock("run", "--arena", str(arena), "--", "sh", "-c",
                 "echo ready; read line; echo got-$line; exit 5"),
        b"hello\n", b"ready",
    )  # fmt: skip
    assert b"got-hello" in seen
    assert code == 5
    code, seen = _in_pty(
        vramlock("run", "--arena", str(arena), "--", sys.executable, "-c",
                 "import time; print('ready', flush=True); time.sleep(30)"),
        b"\x03", b"ready",
    )  # fmt: skip
    assert code == 128 + signal.SIGINT or code == 1, seen  # Python exits 1 after KeyboardInterrupt
    assert b"KeyboardInterrupt" in seen


def test_a_waiter_that_does_not_ring_is_still_noticed(
    arena: Path, spawn: Spawn, tmp_path: Path, worker: Path
) -> None:
    """Both files opened before want.lock is taken: no inotify hint, only the probe interval."""
    log = tmp_path / "log"
    run_worker(spawn, arena, worker, log, "holder")
    quiet = (
        "import fcntl, os, time\n"
        f"w = os.open({str(arena / 'want.lock')!r}, os.O_RDONLY)\n"
        f"t = os.open({str(arena / 'token.lock')!r}, os.O_RDONLY)\n"
        "start = time.monotonic()\n"
        "fcntl.flock(w, fcntl.LOCK_SH)\n"
        "fcntl.flock(t, fcntl.LOCK_EX)\n"
        "print(time.monotonic() - start)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", quiet], capture_output=True, text=True, timeout=30, check=True
    )
    assert float(out.stdout) < 5.0
    assert "release" in whats(log, "holder")


def test_run_survives_forwardable_signals_while_it_waits(arena: Path, spawn: Spawn) -> None:
    """USR1/USR2/WINCH are for the command: before it starts they must not end the wait."""
    holder = spawn(["flock", "-x", str(arena / "token.lock"), "sleep", "1"])
    wait_until(lambda: (arena / "token.lock").exists())
    job = spawn(vramlock("run", "--arena", str(arena), "--", "true"))
    wait_until(lambda: queued(job.pid))
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH):
        os.kill(job.pid, sig)
    _, err = job.communicate(timeout=30)
    assert (job.returncode, err) == (0, "")
    holder.wait(10)


def test_gpu_option_shows_the_command_that_gpu_alone(tmp_path: Path) -> None:
    """--gpu N: the arena of GPU N, and CUDA_VISIBLE_DEVICES for the command (by number in
    PCI bus order here, where NVML cannot name it by UUID)."""
    out = subprocess.run(
        vramlock("run", "--gpu", "3", "--", "sh", "-c",
                 'echo "$VRAMLOCK_ARENA $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER"'),
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()  # fmt: skip
    assert out[0].endswith("/gpu3")
    if out[1].startswith("GPU-"):  # a machine with NVML names it by UUID
        assert out[1:] == [out[1]]
    else:
        assert out[1:] == ["3", "PCI_BUS_ID"]
