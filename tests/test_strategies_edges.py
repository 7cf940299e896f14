"""Release strategies at their edges, each checked against an independent witness: a
command's workers that leave its process group or session, a wrapper killed while its
command is stopped, a token lock deleted under a resident, words nobody asked for, and
signals to the run while it waits or restores.

The witness is a separate process that joins the arena with plain flock calls and
stamps when it held the token; the wrapped command's processes stamp every tick of
their "GPU work" in a log of their own (tests/helpers/stamps.py). A tick inside the
witness's interval is two residents at once, whatever vramlock believes about itself.
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
from helpers.processes import Spawn, kill_group, queued, wait_until, waiting_holder
from helpers.stamps import TICKER, Witness, ticks, ticks_inside

from vramlock import procfs
from vramlock.arena.roster import STALE_TOKEN

pytestmark = pytest.mark.timeout(90)


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
