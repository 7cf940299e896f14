"""What ``--release swap`` refuses, or tries and cannot do, against the fake driver of
test_swap.py: a program it cannot swap keeps the GPU (one line says why, the waiting
member gets the token once the command is done); a release that fails is tried again
and given up; a restore without memory gives the GPU back and queues again.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.processes import Spawn, wait_until
from helpers.swap_rig import (
    Rig,
    during,
    kept_the_gpu,
    let_go,
    read_line,
    resumed,
    swap_marks,
    take_turn,
)

from vramlock.strategies.swap import Hub

pytestmark = swap_marks()


@pytest.mark.parametrize(
    ("what", "why"),
    [
        ("managed", "it uses managed memory"),
        ("export", "it shares GPU memory with another process (exported handle)"),
    ],
)
def test_what_cannot_be_swapped_is_refused_and_the_program_keeps_the_gpu(
    rig: Rig, spawn: Spawn, what: str, why: str
) -> None:
    job = rig.run(spawn, "2", what)
    assert read_line(job) == ["ready"]
    said = kept_the_gpu(rig, spawn, job)
    assert f"cannot be swapped: {why}; it was left running" in said
    assert "holding the GPU until it exits" in said


def test_legacy_cuda_ipc_fails_with_a_line_saying_what_to_do(rig: Rig, spawn: Spawn) -> None:
    # The driver's legacy IPC refuses memory the library made with the virtual memory
    # management API (the fake does as the driver does): the program gets the error,
    # and the user is told why and what to use instead.
    job = rig.run(spawn, "2", "ipc")
    out, err = job.communicate(timeout=60)
    assert job.returncode == 4, (out, err)  # swap_prog's own exit on a CUDA error
    assert "swap_prog: cuIpcGetMemHandle" in err, err
    hint = [line for line in err.splitlines() if line.startswith("vramlock-swap: ")]
    assert len(hint) == 1, err
    assert "cuIpcGetMemHandle: invalid argument: legacy CUDA IPC cannot share" in hint[0]
    assert "--release checkpoint" in hint[0]


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("LD_PRELOAD", "uses CUDA without the swap library"),
        ("VRAMLOCK_SWAP_SOCKET", "uses CUDA without the swap library"),
        ("", "cannot be swapped: it closed its connection to vramlock"),
    ],
    ids=["LD_PRELOAD", "VRAMLOCK_SWAP_SOCKET", "closes-its-socket"],
)
def test_a_process_that_lost_the_library_is_refused_and_the_command_keeps_the_gpu(
    rig: Rig, spawn: Spawn, how: str, why: str
) -> None:
    # The program is exec'd by the system call itself (as Go's runtime execs), without
    # LD_PRELOAD or the socket's name, as a setuid program or an environment scrub
    # would: it runs on the driver with no library to release it, or a library that
    # cannot reach its run. Or the program closes every socket it has, its connection
    # to vramlock among them: it can no longer be asked.
    env = f"{rig.fakes.raw_exec} {how} --" if how else "SWAP_PROG_CLOSE_SOCKETS=1"
    refused_and_kept(rig, spawn, [], env, why)


def test_a_process_whose_connection_ended_is_refused_though_its_library_is_set_up(
    rig: Rig, spawn: Spawn
) -> None:
    # The program shuts down every socket it has once it is ready: its library, set up
    # and given the run's socket, sees its connection end while the command holds the
    # token, and lets its GPU calls go on. It is no process still starting (which joins
    # released): a release would leave it running on the GPU in the next member's turn.
    why = "uses CUDA without the swap library"
    refused_and_kept(rig, spawn, [], "SWAP_PROG_CLOSE_SOCKETS=shutdown", why)


def test_a_process_whose_library_could_not_mark_its_set_up_is_refused_when_its_connection_ends(
    rig: Rig, spawn: Spawn
) -> None:
    # As in test_a_process_whose_connection_ended_is_refused_though_its_library_is_set_up,
    # the program's library, set up and joined, sees its connection end and runs on the
    # command's token; but its set-up mark could not be made (the process had no
    # descriptor left when the library's constructor ran: memfd_create failed). Without
    # the mark it looks like a program still starting; it is not one, and a release must
    # not leave it running in the next member's turn: refused, the command keeps the GPU.
    go = rig.tmp / "go"
    env = dict(rig.env, SLOW_INIT_FILL_FDS="300", SWAP_PROG_START_AFTER=str(go),
               SWAP_PROG_CLOSE_SOCKETS="shutdown")  # fmt: skip
    program = str(rig.fakes.linked_program)
    job = rig.command(spawn, "sh", "-c", f"ulimit -n 64 && exec {program} 2", env=env)
    assert read_line(job) == ["waiting"]
    time.sleep(0.5)  # its descriptors are back
    go.touch()
    assert read_line(job) == ["ready"]
    time.sleep(0.3)  # its connection has ended: it runs on the command's token
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held"
    time.sleep(0.5)
    left = let_go(holder)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert not rig.between(int(held[1]), left), err
    assert int(held[2]) == 0, held  # the command's memory was off the GPU
    assert "uses CUDA without the swap library" in err, err


def refused_and_kept(rig: Rig, spawn: Spawn, before: list[str], env: str, why: str) -> None:
    """``before vramlock run --release swap -- sh -c "ENV swap_prog 2"``, a member queued
    meanwhile: the release is refused (one line, saying ``why``), and the member gets the
    token only once the command is done."""
    job = spawn(
        [*before, *vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release",
                            "swap", "--", "sh", "-c", f"{env} {rig.fakes.program} 2")],
        env=rig.env,
    )  # fmt: skip
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)  # queues; the command cannot let it in
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    lines = [line for line in err.splitlines() if not line.startswith("vramlock-swap: ")]
    assert len(lines) == 1, err
    assert why in lines[0] and "holding the GPU until it exits" in lines[0]
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())  # only once the command was done


def test_a_process_whose_memory_map_cannot_be_read_cannot_be_verified(tmp_path: Path) -> None:
    # A setuid or non-dumpable program's /proc/PID/maps is closed to others of its uid:
    # it cannot be told from a program without CUDA, so a release must not let it by.
    # The wrapper's side runs as a user of its own (root reads every process's maps),
    # in a child of the test: no interpreter needs starting as that user.
    hub = Hub(str(tmp_path / "control"), str(tmp_path / "lib.so"))
    try:
        found = [_unverified_as_nobody(hub, dumpable) for dumpable in (True, False)]
    finally:
        hub.close()
    assert found[0] == "None"  # readable, no driver: not a CUDA process
    assert "cannot be verified: its memory map cannot be read" in found[1], found


def _unverified_as_nobody(hub: Hub, dumpable: bool) -> str:
    """What ``hub.unverified`` says, as an unprivileged user, of a process of that user
    that is ``dumpable`` or not."""
    answer_r, answer_w = os.pipe()
    checker = os.fork()
    if checker == 0:  # pragma: no cover - the child's work comes back through the pipe
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            ready_r, ready_w = os.pipe()
            hold_r, hold_w = os.pipe()
            target = os.fork()
            if target == 0:
                for fd in (answer_w, ready_r, hold_w):
                    os.close(fd)
                # PR_SET_DUMPABLE, either way: a change of uid leaves a process not
                # dumpable, and its children.
                ctypes.CDLL(None).prctl(4, int(dumpable), 0, 0, 0)
                os.write(ready_w, b"x")
                os.read(hold_r, 1)  # until the checker is done
                os._exit(0)
            os.read(ready_r, 1)
            os.write(answer_w, repr(hub.unverified([target])).encode())
        finally:
            os._exit(0)
    os.close(answer_w)
    with os.fdopen(answer_r) as answer:
        said = answer.read()
    os.waitpid(checker, 0)
    return said


@pytest.mark.parametrize(
    "short", ["FAKE_CUDA_FULL", "FAKE_CUDA_STACK_FULL"], ids=["memory", "stack"]
)
def test_a_restore_without_memory_gives_the_gpu_back_and_queues_again(
    rig: Rig, spawn: Spawn, short: str
) -> None:
    """Whether the memory or the context's stack (set back before the program runs) finds
    no room."""
    full, stop = rig.tmp / "full", rig.tmp / "stop"
    env = {**rig.env, short: str(full), "SWAP_PROG_STOP": str(stop), "SWAP_PROG_STACK": "4096"}
    job = rig.run(spawn, "60", env=env)
    assert read_line(job) == ["ready"]
    turn = take_turn(rig, spawn)
    full.touch()  # somebody outside the arena took the GPU's memory...
    # ...so the restore after the next turn fails: the member gives the token back rather
    # than hold it with a program that cannot run (the waiter gets it), and tries again.
    second = take_turn(rig, spawn)
    third = take_turn(rig, spawn)
    gone = time.monotonic_ns()
    full.unlink()
    wait_until(resumed(rig, len(rig.launches())))
    assert third.phys == (0, 0)
    assert not [s for s, _ in rig.launches() if second.start <= s <= gone]
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert "could not be restored" in err and "queueing again" in err
    step = "creating and mapping" if short == "FAKE_CUDA_FULL" else "setting the stack limit back"
    assert f"could not be restored ({step}: out of memory)" in err, err
    assert not during(rig.launches(), [turn, second, third])


def test_a_release_that_keeps_failing_is_given_up_and_the_program_keeps_the_gpu(
    rig: Rig, spawn: Spawn
) -> None:
    # No host memory to pin: each release fails, the member stays resident and tries
    # again a second later; three in a row, and swap is given up as refused (one line),
    # rather than keep the waiter waiting for a release that cannot come.
    host_full = rig.tmp / "host-full"
    host_full.touch()
    job = rig.run(spawn, "12", env=dict(rig.env, FAKE_CUDA_HOST_FULL=str(host_full)))
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)  # queues; the command cannot let it in
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2] == "done"  # it ran on, contents intact
    assert err.count("vramlock-swap: ") == 3, err  # the library's own word on each try
    lines = [line for line in err.splitlines() if line.startswith("vramlock: ")]
    assert len(lines) == 2, err  # the first failure, then giving up
    assert "release failed" in lines[0] and "pinning host memory" in lines[0]
    assert "could not be swapped out 3 times in a row" in lines[1]
    assert lines[1].endswith("holding the GPU until it exits")
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())  # only once the command was done


def _meminfo(path: Path, available_kib: int) -> None:
    """A /proc/meminfo for the swap library (VRAMLOCK_SWAP_MEMINFO): a 16 GiB host."""
    path.write_text(f"MemTotal: 16777216 kB\nMemFree: 10240 kB\n"
                    f"MemAvailable: {available_kib} kB\nBuffers: 0 kB\n")  # fmt: skip


def test_a_release_is_refused_the_host_memory_it_would_pin_short_of(rig: Rig, spawn: Spawn) -> None:
    # 512 MiB available on a 16 GiB host, under the 1 GiB kept free: pinning the copy
    # could wake the OOM killer, so the release fails with the reason and the program
    # keeps its GPU memory; three in a row, and swap is given up (the waiter waits).
    meminfo = rig.tmp / "meminfo"
    _meminfo(meminfo, 512 << 10)
    job = rig.run(spawn, "12", env=dict(rig.env, VRAMLOCK_SWAP_MEMINFO=str(meminfo)))
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2] == "done"  # it ran on, contents intact
    lines = [line for line in err.splitlines() if line.startswith("vramlock: ")]
    assert len(lines) == 2, err
    why = (
        r"release failed.*host memory: the release needs \d+ MiB pinned, "
        r"MemAvailable is 512 MiB \(1\.0 GiB is kept free\)"
    )
    assert re.search(why, lines[0]), lines
    assert "could not be swapped out 3 times in a row" in lines[1]
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())  # only once the command was done
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(10) == 0

    # Once pinned, a copy is kept for the next release: that one pins nothing new, and
    # goes ahead however short the host is.
    stop = rig.tmp / "stop"
    _meminfo(meminfo, 8 << 20)  # 8 GiB available: the first release pins its copies
    env = dict(rig.env, VRAMLOCK_SWAP_MEMINFO=str(meminfo), SWAP_PROG_STOP=str(stop))
    job = rig.run(spawn, "60", env=env)
    assert read_line(job) == ["ready"]
    first = take_turn(rig, spawn)
    wait_until(resumed(rig, len(rig.launches())))
    _meminfo(meminfo, 512 << 10)  # now short: but the copies are kept, nothing new is pinned
    second = take_turn(rig, spawn)
    assert first.phys == second.phys == (0, 0)  # released both times
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert "release failed" not in err, err
    assert not during(rig.launches(), [first, second])


def test_no_release_while_a_cuda_graph_is_being_captured(rig: Rig, spawn: Spawn) -> None:
    capture, stop = rig.tmp / "capture", rig.tmp / "stop"
    env = dict(rig.env, SWAP_PROG_CAPTURE=str(capture), SWAP_PROG_STOP=str(stop))
    job = rig.run(spawn, "60", env=env)
    assert read_line(job) == ["ready"]
    capture.touch()
    assert read_line(job) == ["capturing"]
    holder = rig.holder(spawn)
    # Synchronizing now would invalidate the program's graph: the release fails, and
    # the member stays resident and tries again.
    assert job.stderr is not None
    warning = job.stderr.readline()
    assert "release failed" in warning and "a CUDA graph is being captured" in warning
    ended = time.monotonic_ns()
    capture.unlink()
    assert read_line(job) == ["captured"]
    held = read_line(holder)
    assert held[0] == "held" and int(held[1]) > ended and int(held[2]) == 0
    assert holder.stdin is not None
    holder.stdin.close()
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
