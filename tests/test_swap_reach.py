"""The swap library reaches its ``vramlock run`` from where a command's process may be,
and adds nothing where it cannot: against the fake driver of test_swap.py.

A process that dropped its privileges cannot open the run's private socket directory, one
with a /tmp of its own does not see it, one that used up its descriptors cannot make a
socket: each reaches the run all the same (its abstract socket, a socket kept from the
start) and is swapped as any other. One that can reach neither socket (a mount and a
network namespace of its own) runs without swap under ``auto``, holding the GPU as under
``none``, and ends before its GPU work under ``--release swap``: never a GPU call blocked
for good. The witnesses are the fake driver's launch log and physical-memory file against
a member the test owns, and the time the command takes beside ``--release none``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.commands import who_json
from helpers.processes import Spawn, wait_until
from helpers.swap_rig import Rig, during, let_go, read_line, swap_marks, swap_turns, take_turn

from vramlock.gpu import swap

pytestmark = swap_marks()

NOBODY = 65534
# The run's socket directory, hidden in the command's own mount namespace by a tmpfs
# mounted over it: what a private /tmp (bubblewrap, PrivateTmp, a container) does to it.
# (Nothing to hide without one: --release none.)
OWN_TMP = (
    'if [ "$VRAMLOCK_SWAP_SOCKET" ]; then mount -t tmpfs none "${VRAMLOCK_SWAP_SOCKET%/*}"'
    ' || exit; fi; exec "$@"'
)


def _may_unshare(*flags: str) -> bool:
    try:
        done = subprocess.run(["unshare", *flags, "sh", "-c", "mount -t tmpfs none /mnt"],
                              capture_output=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def own_tmp(*flags: str) -> list[str]:
    """A command prefix: the program runs in a mount namespace of its own (``-m``; ``-n``
    a network namespace too) where the run's socket directory is empty."""
    if not _may_unshare("-m", *flags):
        pytest.skip(f"unshare -m {' '.join(flags)} with a tmpfs is not permitted here")
    return ["unshare", "-m", *flags, "sh", "-c", OWN_TMP, "sh"]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can read and write (the stop file of a program run as
    nobody)."""
    path = Path(tempfile.mkdtemp(prefix="vramlock-reach-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def swapped_in_turns(rig: Rig, spawn: Spawn, command: list[str], env: dict[str, str]) -> None:
    """``vramlock run --release swap -- COMMAND`` (swap_prog, ending once STOP exists) is
    swapped out for three turns of the test's member: no launch and no physical memory
    during any, its contents intact, nothing said."""
    stop = Path(env["SWAP_PROG_STOP"])
    job = rig.command(spawn, *command, env=env)
    assert read_line(job) == ["ready"]
    out, err = swap_turns(rig, spawn, job, stop, 3)
    assert out.split()[-2] == "done"
    assert err == ""


def test_a_process_that_dropped_its_privileges_is_swapped(
    rig: Rig, spawn: Spawn, shared_dir: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping privileges needs root")
    env = dict(rig.env, SWAP_PROG_SETUID=str(NOBODY), SWAP_PROG_STOP=str(shared_dir / "stop"))
    swapped_in_turns(rig, spawn, [str(rig.fakes.program), "60"], env)


def test_a_process_with_a_tmp_of_its_own_is_swapped(rig: Rig, spawn: Spawn) -> None:
    env = dict(rig.env, SWAP_PROG_STOP=str(rig.tmp / "stop"))
    swapped_in_turns(rig, spawn, [*own_tmp(), str(rig.fakes.program), "60"], env)


def test_a_process_out_of_descriptors_is_swapped(rig: Rig, spawn: Spawn) -> None:
    env = dict(rig.env, SWAP_PROG_FILL_FDS="1", SWAP_PROG_STOP=str(rig.tmp / "stop"))
    command = ["sh", "-c", 'ulimit -n 256 && exec "$@"', "sh", str(rig.fakes.program), "60"]
    swapped_in_turns(rig, spawn, command, env)


def timed_run(rig: Rig, spawn: Spawn, release: str | None) -> tuple[float, str, int]:
    """swap_prog for 3 s, unreachable (``own_tmp("-n")``), under ``release`` (None: the
    default, auto), while the test's member queues once it is ready: how long the run
    took, its stderr, and when the member got the token (monotonic ns)."""
    command = [*own_tmp("-n"), str(rig.fakes.program), "3"]
    started = time.monotonic()
    job = rig.command(spawn, *command, release=release or "auto")
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    out, err = job.communicate(timeout=60)
    took = time.monotonic() - started
    assert job.returncode == 0, (out, err)
    assert out.split()[-2] == "done"
    held = read_line(holder)
    assert held[0] == "held", held
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(10) == 0
    return took, err, int(held[1])


def test_auto_runs_a_process_it_cannot_reach_as_none_would(rig: Rig, spawn: Spawn) -> None:
    swap.library_path()  # built now, where it has to be: not timed
    plain, _, _ = timed_run(rig, spawn, "none")
    rig.launch_log.unlink()
    took, err, held = timed_run(rig, spawn, None)
    launches = rig.launches()
    assert launches and held > max(end for _, end in launches)  # the member waited it out
    assert took < plain + 1.5, (took, plain)  # nothing blocked
    lines = err.splitlines()
    assert len(lines) == 1, err  # said once, with the cause
    assert "could not reach vramlock run (No such file or directory)" in lines[0]
    assert "keeps it until it exits" in lines[0]


def test_swap_ends_a_process_it_cannot_reach_before_its_gpu_work(rig: Rig, spawn: Spawn) -> None:
    started = time.monotonic()
    job = rig.command(spawn, *own_tmp("-n"), str(rig.fakes.program), "3")
    out, err = job.communicate(timeout=60)
    assert job.returncode == 1, (out, err)
    assert time.monotonic() - started < 3  # before the program's 3 s of work
    assert rig.launches() == []  # no GPU work at all
    assert int(rig.phys.read_text()) == 0
    (line,) = err.splitlines()
    assert "cannot reach vramlock run (" in line and "No such file or directory" in line
    assert "--release swap cannot release this process, so it ends before its GPU work" in line
    assert "Traceback" not in err


def test_a_process_that_cannot_reach_its_run_while_released_waits_for_the_turn(
    rig: Rig, spawn: Spawn
) -> None:
    # The command's first program joined and is swapped out under auto while the test's
    # member holds the token; then a second one starts that can reach no socket. It
    # waits for the command's turn, runs without swap then, and the next member waits
    # for the command to end: the release by swap is refused, naming it.
    stop, start, trace = rig.tmp / "stop", rig.tmp / "start", rig.tmp / "trace"
    second = " ".join(own_tmp("-n")).replace(OWN_TMP, f"'{OWN_TMP}'")
    text = (
        f'"$1" 60 & SWAP_PROG_START_AFTER={start} VRAMLOCK_SWAP_DEBUG=1'
        f' {second} "$1" 2 2>{trace}; wait'
    )
    job = rig.command(spawn, "sh", "-c", text, "sh", str(rig.fakes.program),
                      release="auto", env=dict(rig.env, SWAP_PROG_STOP=str(stop)))  # fmt: skip
    assert sorted([read_line(job), read_line(job)]) == [["ready"], ["waiting"]]
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held" and int(held[2]) == 0  # swapped out
    start.touch()
    wait_until(lambda: "cannot reach vramlock run" in trace.read_text())
    time.sleep(0.3)  # its chance to run in the member's turn
    left = let_go(holder)
    assert not rig.between(int(held[1]), left)  # nothing ran in the turn
    assert read_line(job) == ["ready"]  # the second, on the command's turn
    # It says ready before its first launch: that launch, when it comes, is after the turn.
    wait_until(lambda: any(s > int(held[1]) for s, _ in rig.launches()))
    assert min(s for s, _ in rig.launches() if s > int(held[1])) > left
    holder = rig.holder(spawn)  # the command keeps the GPU until it ends
    assert read_line(job)[0] == "done"  # the second's 2 s
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    held = read_line(holder)
    assert held[0] == "held" and int(held[1]) > max(e for _, e in rig.launches())
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "could not reach vramlock run (No such file or directory)" in lines[0]
    assert lines[0].endswith("holding the GPU until it exits")
    assert holder.stdin is not None
    holder.stdin.close()


def test_auto_releases_a_process_it_cannot_reach_its_next_way(rig: Rig, spawn: Spawn) -> None:
    # The driver can checkpoint: the next way after swap finds work in the command.
    states = rig.tmp / "checkpoint"
    states.mkdir()
    rig.env.update(LD_LIBRARY_PATH=str(rig.fakes.checkpoint_directory),
                   FAKE_CUDA_CKPT_DIR=str(states))  # fmt: skip
    stop = rig.tmp / "stop"
    env = dict(rig.env, SWAP_PROG_STOP=str(stop))
    job = rig.command(spawn, *own_tmp("-n"), str(rig.fakes.program), "60", release="auto", env=env)
    assert read_line(job) == ["ready"]
    turn = take_turn(rig, spawn)
    assert not during(rig.launches(), [turn])  # (the fake checkpoint keeps its bytes)
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2] == "done"
    (line,) = err.splitlines()
    assert "could not reach vramlock run (No such file or directory)" in line
    assert line.endswith("--release auto uses checkpoint")


def test_who_shows_why_auto_could_not_swap_a_process(rig: Rig, spawn: Spawn) -> None:
    """auto fell back, saying the cause once on stderr; who showed no cause at all."""
    stop = rig.tmp / "stop"
    env = dict(rig.env, SWAP_PROG_STOP=str(stop))
    job = rig.command(spawn, *own_tmp("-n"), str(rig.fakes.program), "60", release="auto", env=env)
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    cause = "could not reach vramlock run (No such file or directory)"

    def note() -> str:
        rows = [r for r in who_json(rig.arena) if r["pid"] == job.pid]
        return (rows[0]["note"] or "") if rows else ""

    wait_until(lambda: cause in note())
    assert note().startswith("process ") and note().endswith(cause)
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert read_line(holder)[0] == "held"
    assert holder.stdin is not None
    holder.stdin.close()
    assert err.count(cause) == 1, err
