"""Release strategies end to end, each checked against an independent witness.

The witness is a separate process that joins the arena with plain flock calls and
stamps when it held the token; the wrapped command's processes stamp every tick of
their "GPU work" in a log of their own. A tick inside the witness's interval is two
residents at once, whatever vramlock believes about itself.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, kill_group, queued, token_free, wait_until, waiting_holder
from helpers.worker import run_worker, whats

from vramlock import procfs
from vramlock.arena.roster import STALE_TOKEN

pytestmark = pytest.mark.timeout(90)

WITNESS = textwrap.dedent(
    """
    import fcntl, os, sys, time
    arena, out, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
    want = os.open(os.path.join(arena, "want.lock"), os.O_RDONLY)
    fcntl.flock(want, fcntl.LOCK_SH)
    token = os.open(os.path.join(arena, "token.lock"), os.O_RDONLY)
    fcntl.flock(token, fcntl.LOCK_EX)
    t0 = time.monotonic()
    fcntl.flock(want, fcntl.LOCK_UN)
    open(out + ".held", "w").close()
    time.sleep(hold)
    t1 = time.monotonic()
    with open(out, "w") as f:
        f.write(f"{t0} {t1}")
    """
)

# Stands in for GPU work: stamps a tick every 2 ms; ignores the signals named.
TICKER = textwrap.dedent(
    """
    import os, signal, sys, time
    for name in sys.argv[2:]:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while True:
        os.write(log, f"{time.monotonic():.6f} {os.getpid()}\\n".encode())
        time.sleep(0.002)
    """
)


class Witness:
    def __init__(self, tmp: Path, arena: Path, hold: float, name: str = "witness") -> None:
        script = tmp / "witness.py"
        script.write_text(WITNESS)
        self.out = tmp / name
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(arena), str(self.out), str(hold)],
            start_new_session=True,
        )

    def wait_held(self, timeout: float = 30) -> None:
        wait_until(lambda: Path(f"{self.out}.held").exists(), timeout=timeout)

    def interval(self, timeout: float = 60) -> tuple[float, float]:
        self.proc.wait(timeout)
        t0, t1 = self.out.read_text().split()
        return float(t0), float(t1)


def ticks(log: Path) -> list[tuple[float, int]]:
    out = []
    if log.exists():
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:  # a process killed mid-write leaves a partial line
                out.append((float(parts[0]), int(parts[1])))
    return out


def ticks_inside(log: Path, span: tuple[float, float]) -> list[tuple[float, int]]:
    return [t for t in ticks(log) if span[0] < t[0] < span[1]]


def who_notes(arena: Path) -> list[object]:
    return [m["note"] for m in who_json(arena)]


@pytest.fixture
def ticker(tmp_path: Path) -> Path:
    path = tmp_path / "ticker.py"
    path.write_text(TICKER)
    return path


def test_restart_ends_workers_that_left_the_group(
    arena: Path, spawn: Spawn, tmp_path: Path, ticker: Path
) -> None:
    """A worker that ignores SIGTERM and left the process group (setsid) must be gone
    before anyone else is resident."""
    log = tmp_path / "ticks"
    leader = _escaping_leader(tmp_path, ticker, log, "SIGTERM")
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "restart", "--min-hold", "0",
                 "--", sys.executable, str(leader))
    )  # fmt: skip
    wait_until(lambda: len(ticks(log)) > 5)
    worker = ticks(log)[-1][1]
    witness = Witness(tmp_path, arena, hold=0.5)
    span = witness.interval()
    assert ticks_inside(log, span) == []
    assert not procfs.living(worker)
    assert job.poll() is None  # started again on its turn
    wait_until(lambda: ticks(log)[-1][1] != worker)


def test_command_exit_keeps_the_token_until_its_workers_are_gone(
    arena: Path, spawn: Spawn, tmp_path: Path, ticker: Path
) -> None:
    """The command exits, leaving a worker (that ignores SIGTERM) in its group: the
    token is not dropped while the worker runs."""
    log = tmp_path / "ticks"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--", "sh", "-c",
                 f"{sys.executable} {ticker} {log} SIGTERM & sleep 0.5; exit 7")
    )  # fmt: skip
    wait_until(lambda: len(ticks(log)) > 5)
    worker = ticks(log)[-1][1]
    witness = Witness(tmp_path, arena, hold=0.3)
    # While the worker is given its grace after SIGTERM, `who` says what holds the GPU.
    wait_until(lambda: f"command exited; ending {worker}" in str(who_notes(arena)))
    span = witness.interval()
    assert ticks_inside(log, span) == []
    assert not procfs.living(worker)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 7
    assert "the command exited and left 1 process(es) running" in err


def _kill_the_wrapper_of_a_stopped_command(
    arena: Path, spawn: Spawn, tmp_path: Path, log: Path, command: list[str]
) -> None:
    """``command`` (which ticks into ``log``) runs under --release stop; its wrapper is
    SIGKILLed while a witness member holds the token: no tick during the witness's hold,
    and the ticking worker dies."""
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "stop", "--min-hold", "0",
                 "--", *command)
    )  # fmt: skip
    wait_until(lambda: len(ticks(log)) > 5)
    worker = ticks(log)[-1][1]
    witness = Witness(tmp_path, arena, hold=1.0)
    witness.wait_held()
    os.kill(job.pid, signal.SIGKILL)
    span = witness.interval()
    assert ticks_inside(log, span) == []
    wait_until(lambda: not procfs.living(worker))
    job.wait(10)


def test_stopped_command_dies_with_its_wrapper(
    arena: Path, spawn: Spawn, tmp_path: Path, ticker: Path
) -> None:
    """--release stop: the wrapper is SIGKILLed while another member holds the token.
    The kernel resumes an orphaned stopped group (SIGHUP + SIGCONT); a command that
    ignores SIGHUP must not run again without the token."""
    log = tmp_path / "ticks"
    _kill_the_wrapper_of_a_stopped_command(
        arena, spawn, tmp_path, log, [sys.executable, str(ticker), str(log), "SIGHUP"]
    )


def test_stop_keeper_lets_the_command_go_on_after_its_turn(
    arena: Path, spawn: Spawn, tmp_path: Path, ticker: Path
) -> None:
    """The keeper of a stopped command goes away when the command is resumed."""
    log = tmp_path / "ticks"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "stop", "--min-hold", "0",
                 "--", sys.executable, str(ticker), str(log))
    )  # fmt: skip
    wait_until(lambda: len(ticks(log)) > 5)
    for round_ in range(3):
        span = Witness(tmp_path, arena, hold=0.2, name=f"w{round_}").interval()
        assert ticks_inside(log, span) == []
        count = len(ticks(log))
        wait_until(lambda n=count: len(ticks(log)) > n + 5)  # type: ignore[misc]
    # Only the command's processes are left: no keeper or sentinel lingers.
    assert procfs.descendants(job.pid) == [ticks(log)[-1][1]]
    os.kill(job.pid, signal.SIGTERM)
    job.communicate(timeout=30)
    assert job.returncode == 143


def _escaping_leader(tmp_path: Path, ticker: Path, log: Path, *ignored: str) -> Path:
    """A command whose worker leaves its session (setsid) and ticks, ignoring ``ignored``."""
    leader = tmp_path / "leader.py"
    leader.write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys, time
            subprocess.Popen([sys.executable, {str(ticker)!r}, {str(log)!r}, *{list(ignored)!r}],
                             start_new_session=True)
            time.sleep(600)
            """
        )
    )
    return leader


def test_stop_stops_workers_that_left_the_session(
    arena: Path, spawn: Spawn, tmp_path: Path, ticker: Path
) -> None:
    """--release stop: a worker that setsid()s out of the process group is stopped too,
    and continued after its turn."""
    log = tmp_path / "ticks"
    leader = _escaping_leader(tmp_path, ticker, log)
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "stop", "--min-hold", "0",
                 "--", sys.executable, str(leader))
    )  # fmt: skip
    wait_until(lambda: len(ticks(log)) > 5)
    worker = ticks(log)[-1][1]
    assert procfs.pgrp(worker) == worker  # it did leave: a group (and session) of its own
    for round_ in range(2):
        span = Witness(tmp_path, arena, hold=0.4, name=f"w{round_}").interval()
        assert ticks_inside(log, span) == []
        count = len(ticks(log))
        wait_until(lambda n=count: len(ticks(log)) > n + 5)  # type: ignore[misc]
    assert job.poll() is None


def test_stopped_workers_that_left_the_session_die_with_the_wrapper(
    arena: Path, spawn: Spawn, tmp_path: Path, ticker: Path
) -> None:
    """The keeper's duty covers escaped workers: the wrapper is SIGKILLed while another
    member holds the token, and a worker that left the session (and ignores SIGHUP) never
    ticks again."""
    log = tmp_path / "ticks"
    leader = _escaping_leader(tmp_path, ticker, log, "SIGHUP")
    _kill_the_wrapper_of_a_stopped_command(
        arena, spawn, tmp_path, log, [sys.executable, str(leader)]
    )


def test_a_deleted_token_lock_is_noticed_and_the_resident_steps_aside(
    arena: Path, spawn: Spawn, tmp_path: Path, ticker: Path
) -> None:
    """token.lock deleted under a resident (a /tmp cleaner): the next member creates and
    takes a new one. The resident notices within a probe, stops its command, and comes
    back through the new file once the other member is done."""
    log = tmp_path / "ticks"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "stop", "--min-hold", "0",
                 "--", sys.executable, str(ticker), str(log))
    )  # fmt: skip
    wait_until(lambda: len(ticks(log)) > 5)
    worker = ticks(log)[-1][1]
    (arena / "token.lock").unlink()
    holder = waiting_holder(spawn, arena)  # resident at once: the new file is free
    held = time.monotonic()
    wait_until(lambda: procfs.state(worker) == "T", timeout=2)
    assert time.monotonic() - held < 1.0  # within a probe (and the release)
    stopped = time.monotonic()
    time.sleep(0.5)  # the holder's turn goes on: not one tick meanwhile
    assert ticks_inside(log, (stopped, time.monotonic())) == []
    assert holder.stdin is not None
    holder.stdin.close()
    count = len(ticks(log))
    wait_until(lambda: len(ticks(log)) > count + 5)
    # Resident again on the new file: a waiter there gets it.
    got = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "10"), timeout=30)
    assert got.returncode == 0
    assert job.poll() is None


def test_who_says_when_a_member_holds_a_deleted_token_lock(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    job = spawn(vramlock("run", "--arena", str(arena), "--release", "none", "--", "sleep", "60"))
    wait_until(lambda: [m["state"] for m in who_json(arena)] == ["resident"])
    assert who_notes(arena) == [None]
    (arena / "token.lock").unlink()
    notes = [m["note"] for m in who_json(arena) if m["pid"] == job.pid]
    assert notes == [STALE_TOKEN]


UNSOLICITED = textwrap.dedent(
    """
    import os, socket, sys, time
    log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    sock = socket.socket(fileno=int(os.environ["VRAMLOCK_CONTROL_FD"]))
    sock.sendall(b"hello\\nreleased\\nrestored\\n")  # unsolicited: answers to nothing
    sock.setblocking(False)
    working, buf = True, b""
    while True:
        if working:
            os.write(log, f"{time.monotonic():.6f} {os.getpid()}\\n".encode())
        time.sleep(0.002)
        try:
            buf += sock.recv(100)
        except BlockingIOError:
            continue
        while b"\\n" in buf:
            word, buf = buf.split(b"\\n", 1)
            if word == b"release":
                end = time.monotonic() + 0.4  # a slow release: still working meanwhile
                while time.monotonic() < end:
                    os.write(log, f"{time.monotonic():.6f} {os.getpid()}\\n".encode())
                    time.sleep(0.002)
                working = False
                sock.sendall(b"released\\n")
            elif word == b"restore":
                working = True
                sock.sendall(b"restored\\n")
    """
)


def test_unsolicited_words_do_not_answer_a_request(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    log = tmp_path / "ticks"
    script = tmp_path / "child.py"
    script.write_text(UNSOLICITED)
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "signal", "--min-hold", "0",
                 "--", sys.executable, str(script), str(log))
    )  # fmt: skip
    wait_until(lambda: len(ticks(log)) > 5)
    span = Witness(tmp_path, arena, hold=0.3).interval()
    assert ticks_inside(log, span) == []
    assert job.poll() is None


def test_command_that_cannot_be_signalled_keeps_the_gpu_and_says_so(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """EPERM (a setuid program) under restart: a clear error, no hang, the token kept."""
    inject = (
        "import errno, os, sys\n"
        "def killpg(pgid, sig):\n"
        "    raise PermissionError(errno.EPERM, 'Operation not permitted')\n"
        "os.killpg = killpg\n"
        "from vramlock.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    job = spawn(
        [sys.executable, "-c", inject, "run", "--arena", str(arena), "--release", "restart",
         "--min-hold", "0", "--", "sleep", "60"]
    )  # fmt: skip
    wait_until(lambda: (arena / "token.lock").exists())
    time.sleep(0.3)
    waiter = subprocess.run(
        vramlock("wait", "--arena", str(arena), "-w", "1.5"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert waiter.returncode == 1  # the GPU was kept: the command could not be ended
    assert job.poll() is None  # and the wrapper is not stuck in a wait without end
    kill_group(job)
    _, err = job.communicate(timeout=10)
    lines = [ln for ln in err.splitlines() if "cannot signal" in ln]
    assert len(lines) == 1, err  # said once, not every retry
    assert lines[0].startswith("vramlock: release failed: cannot signal the command's process")


def test_two_quick_sigterms_to_a_waiting_run(arena: Path, spawn: Spawn) -> None:
    holder = spawn(["flock", "-x", str(arena / "token.lock"), "sleep", "60"])
    wait_until(lambda: (arena / "token.lock").exists())
    for gap in range(12):  # the second one lands at a different point of the cleanup
        job = spawn(vramlock("run", "--arena", str(arena), "--", "true"))
        wait_until(lambda j=job: queued(j.pid))  # type: ignore[misc]
        os.kill(job.pid, signal.SIGTERM)
        time.sleep(gap * 0.0005)
        os.kill(job.pid, signal.SIGTERM)
        _, err = job.communicate(timeout=30)
        # -15: the second one landed as the interpreter was exiting (handlers reset by then);
        # a shell reports both as 143.
        assert job.returncode in (143, -signal.SIGTERM), (gap, err)
        assert "Traceback" not in err
        assert err == ""
    assert holder.poll() is None


def test_a_diagnostic_never_ends_the_wrapper(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    """A warn callback that raises (a closed stderr) must not kill the wrapper."""
    code = (
        "import sys\n"
        "from vramlock.run.options import RunOptions\n"
        "from vramlock.run.runner import run\n"
        "def warn(message):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        f"opts = RunOptions(command=['sleep', '2'], arena={str(arena)!r}, min_hold=0.0,\n"
        "    on_release='exit 3', warn=warn)\n"
        "sys.exit(run(opts))\n"
    )
    job = spawn([sys.executable, "-c", code])
    wait_until(lambda: (arena / "token.lock").exists())
    time.sleep(0.3)
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "0.5"), timeout=30)
    assert waiter.returncode == 1
    _, err = job.communicate(timeout=30)
    assert job.returncode == 0, err


def test_signals_wait_for_the_restore_where_the_strategy_defers_them(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """A checkpointed process that runs its exit path fails its CUDA calls and cannot be
    restored (seen with a CUDA llama-server), so checkpoint keeps signals until the
    restore. Here the mechanism alone, with exec marked as deferring: the command's
    SIGTERM trap does not run while the test holds the token, and runs after on_restore."""
    log = tmp_path / "log"
    script = (
        f"trap 'echo term >> {log}; exit 0' TERM; echo start >> {log}; while :; do sleep 0.05; done"
    )
    code = (
        "import sys\n"
        "from vramlock.strategies.exec import ExecStrategy\n"
        "ExecStrategy.defers_signals = True\n"
        "from vramlock.run.options import RunOptions\n"
        "from vramlock.run.runner import run\n"
        f"opts = RunOptions(command=['sh', '-c', {script!r}], arena={str(arena)!r},\n"
        f"    min_hold=0.0, release='exec', on_release='echo release >> {log}',\n"
        f"    on_restore='echo restore >> {log}')\n"
        "sys.exit(run(opts))\n"
    )
    job = spawn([sys.executable, "-c", code])
    wait_until(lambda: log.exists() and log.read_text() == "start\n")
    holder = waiting_holder(spawn, arena)
    job.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert log.read_text() == "start\nrelease\n"  # the trap has not run without the token
    assert holder.stdin is not None
    holder.stdin.close()
    assert job.wait(30) == 0
    assert log.read_text() == "start\nrelease\nrestore\nterm\n"


def test_auto_says_once_that_the_command_cannot_release(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """Events, not clocks: the command holds the GPU until the test ends it, the first
    waiter stays until the warning has come, and a second one is given a second of probes
    in which no other warning may come."""
    up = tmp_path / "up"
    command = ["sh", "-c", f"echo > {up}; exec cat > /dev/null"]  # ends when stdin does
    job = spawn(vramlock("run", "--arena", str(arena), "--", *command), stdin=subprocess.PIPE)
    wait_until(up.exists)  # the command runs, so its wrapper holds the token
    first = spawn(vramlock("wait", "--arena", str(arena)))
    assert job.stderr is not None and job.stdin is not None
    ready, _, _ = select.select([job.stderr], [], [], 30)
    assert ready, "no warning within 30 s of somebody waiting"
    assert "--release auto found no way to release it" in job.stderr.readline()
    kill_group(first)
    again = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "1"), timeout=30)
    assert again.returncode == 1  # the command still holds the GPU: it was asked, not ended
    job.stdin.close()
    assert job.wait(30) == 0
    assert job.stderr.read() == ""  # and no second warning


# -- each strategy's ordinary behaviour ---------------------------------------------


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
    assert sorted(done.read_text().split()) == ["a", "b", "c"]


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
