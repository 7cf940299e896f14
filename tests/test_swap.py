"""``--release swap`` against a fake driver: no GPU needed.

tests/fake_cuda/fake_libcuda.c (with its parts) is a libcuda.so.1 whose device memory is
host memory (see its header): a "kernel" runs on the CPU and logs each launch with its
times, and the physical memory it holds is written to a file at every change. The
program (tests/fake_cuda/swap_prog.c) finds the driver as the CUDA runtime does,
allocates in every way the library handles, and checks its memory's contents as
it goes. The other member is a process the test owns, holding the token itself;
its times, the fake's launch log and its physical-memory file are the witnesses.

Here: releases and restores that work, and the gate that keeps a released program off
the GPU. What fails before the command is in test_swap_setup.py, what a release refuses
or cannot do in test_swap_refused.py, the processes that fork, exec or slip past the
library in test_swap_exec.py, and the run's own side (its hub, its end) in
test_swap_run.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, wait_until
from helpers.serve import call
from helpers.swap_rig import Rig, ask, read_line, swap_marks, swap_turns, take_turn, turns_then_stop

from vramlock.procfs import descendants

pytestmark = swap_marks()


def test_the_program_runs_on_the_fake_driver_alone(rig: Rig) -> None:
    """The baseline: without vramlock, the program and the fake agree (every failure
    below is the swap library's)."""
    done = subprocess.run([str(rig.fakes.program), "0.3"], env=rig.env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done
    assert done.stdout.split()[-2] == "done" and int(rig.phys.read_text()) == 0


@pytest.mark.parametrize("aliases", [False, True], ids=["exported", "aliased"])
def test_contents_survive_swaps_memory_is_gone_and_the_gate_holds(
    rig: Rig, spawn: Spawn, aliases: bool
) -> None:
    stop = rig.tmp / "stop"
    env = dict(rig.env, SWAP_PROG_STOP=str(stop))
    if aliases:  # the driver hands out cuLaunchKernel at an address dlsym never gives
        env["FAKE_CUDA_ALIASES"] = "1"
    job = rig.run(spawn, "60", env=env)
    assert read_line(job) == ["ready"]
    # The program checks a buffer after every round, and all of them at the end.
    out, err = swap_turns(rig, spawn, job, stop, 5)
    assert out.split()[-2] == "done"
    assert int(rig.phys.read_text()) == 0  # it freed everything: nothing leaked
    assert err == ""  # nothing said on the happy path


@pytest.mark.parametrize("lowered", [True, False], ids=["lowered", "kept"])
def test_a_released_context_s_stack_is_lowered_and_set_back_before_the_program_runs(
    rig: Rig, spawn: Spawn, lowered: bool
) -> None:
    """Most of what a released context keeps is its stack: a release lowers the limit, a
    restore sets the program's back before it launches again. The witness is the fake
    driver's log of every change of the limit; the program reads its own after each round
    (it exits 3 on another value). VRAMLOCK_SWAP_STACK=0 leaves the stack alone."""
    stop = rig.tmp / "stop"
    env = dict(rig.env, SWAP_PROG_STOP=str(stop), SWAP_PROG_STACK="4096")
    if not lowered:
        env["VRAMLOCK_SWAP_STACK"] = "0"
    job = rig.run(spawn, "60", env=env)
    assert read_line(job) == ["ready"]
    turns, _, _ = turns_then_stop(rig, spawn, job, stop, 3)
    stacks = rig.launches("stack")  # (when, bytes)

    def limit_at(ns: int) -> int:
        return [limit for at, limit in stacks if at <= ns][-1]

    for turn in turns:  # the whole turn, from the member taking the token to letting go
        assert [limit_at(turn.start), limit_at(turn.end)] == (
            [16, 16] if lowered else [4096, 4096]
        ), (turn, stacks)
    assert {limit_at(start) for start, _ in rig.launches()} == {4096}, stacks
    assert len(stacks) == (1 + 2 * len(turns) if lowered else 1), stacks


def test_a_process_joining_while_released_waits_for_its_turn(rig: Rig, spawn: Spawn) -> None:
    go = rig.tmp / "go"
    env = dict(rig.env, SWAP_PROG_START_AFTER=str(go))
    job = rig.run(spawn, "1", env=env)
    assert read_line(job) == ["waiting"]
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held"
    go.touch()  # CUDA starts now, while the test's member holds the token
    time.sleep(0.5)
    assert rig.launches() == [] and int(rig.phys.read_text()) == 0
    assert holder.stdin is not None
    holder.stdin.close()
    left = read_line(holder)
    assert holder.wait(10) == 0
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert min(s for s, _ in rig.launches()) > int(left[1])


def test_the_users_preload_is_kept(rig: Rig, spawn: Spawn) -> None:
    out_file = rig.tmp / "user"
    env = dict(rig.env, LD_PRELOAD=str(rig.fakes.user_preload), USER_PRELOAD_OUT=str(out_file))
    job = rig.run(spawn, "1", env=env)
    assert read_line(job) == ["ready"]
    turn = take_turn(rig, spawn)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    # Theirs ran in the program (and in vramlock, which has it too: nothing to count
    # there), and its RTLD_NEXT found libc's nanosleep.
    assert max(map(int, out_file.read_text().split())) > 0
    assert turn.phys == (0, 0)  # and ours swapped


def test_every_cuda_process_of_the_command_is_swapped(rig: Rig, spawn: Spawn) -> None:
    stop = rig.tmp / "stop"
    prog = str(rig.fakes.program)
    env = dict(rig.env, SWAP_PROG_STOP=str(stop))
    job = rig.command(spawn, "sh", "-c", f"{prog} 60 & {prog} 60; wait $!", env=env)
    assert read_line(job) == ["ready"] and read_line(job) == ["ready"]
    out, _ = swap_turns(rig, spawn, job, stop, 3)  # both processes' memory was gone
    assert out.split().count("done") == 2  # each checked every buffer at its end


def test_threads_racing_the_releases_never_touch_memory_that_is_gone(
    rig: Rig, spawn: Spawn
) -> None:
    stop = rig.tmp / "stop"
    job = rig.run(spawn, "60", env=dict(rig.env, SWAP_PROG_THREADS="3", SWAP_PROG_STOP=str(stop)))
    assert read_line(job) == ["ready"]
    # A wrong int, or a touch of unmapped memory (SIGSEGV), ends the program early.
    out, _ = swap_turns(rig, spawn, job, stop, 8)
    assert int(out.split()[out.split().index("worked") + 1]) > 0
    assert int(rig.phys.read_text()) == 0


def test_a_long_temporary_directory_still_gets_a_socket(rig: Rig, spawn: Spawn) -> None:
    long_tmp = rig.tmp / ("t" * 90)
    long_tmp.mkdir()
    stop = rig.tmp / "stop"
    job = rig.run(spawn, "60", env=dict(rig.env, TMPDIR=str(long_tmp), SWAP_PROG_STOP=str(stop)))
    assert read_line(job) == ["ready"]
    swap_turns(rig, spawn, job, stop, 1)


def small_allocs(out: str) -> float:
    words = out.split()
    return float(words[words.index("s_small_allocs") + 1])


def test_many_small_allocations_stay_fast(rig: Rig, spawn: Spawn) -> None:
    # 160,000 live 256-byte allocations: the tables must not grow quadratic (11 s once,
    # against 0.14 s on the bare driver).
    env = dict(rig.env, SWAP_PROG_SMALL="160000")
    bare = subprocess.run([str(rig.fakes.program), "0"], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert bare.returncode == 0, bare
    job = rig.run(spawn, "0", env=env)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert small_allocs(out) < 2 * small_allocs(bare.stdout) + 0.5, (out, bare.stdout)


def test_two_idle_servers_behind_their_proxies_take_turns(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    """Two servers idle between requests, as inference servers are (no CUDA call in
    flight when a release comes), each under ``--demand listen`` and swap in one arena:
    each request to the released one is answered once it is swapped back in, with its
    memory's contents checked by the program, and the fake driver's accounting (a file
    per program) shows the other one's memory gone meanwhile."""
    ports, phys = [], []
    for i in range(2):
        listen, upstream = free_ports(2)
        phys.append(tmp_path / f"phys{i}")
        env = dict(rig.env, FAKE_CUDA_PHYS=str(phys[i]), SWAP_PROG_LISTEN=str(upstream))
        spawn(vramlock("run", "--arena", str(rig.arena), "--demand", "listen",
                       "--listen", str(listen), "--upstream", str(upstream),
                       "--ready-url", "/health", "--min-hold", "0", "--idle", "50ms",
                       "--release", "swap", "--", str(rig.fakes.program), "100"),
              env=env)  # fmt: skip
        ports.append(listen)
    for port in ports:
        wait_until(lambda: accepts(port))  # noqa: B023
    for k in range(16):
        i = k % 2
        status, _, body = call(ports[i], "POST", "/work", {})
        assert (status, body) == (200, f"round {k // 2 + 1}\n".encode())  # checked by the program
        if k:  # the other one was released for it: nothing of it left on the "GPU"
            assert int(phys[1 - i].read_text()) == 0
        assert int(phys[i].read_text()) > 0


def test_the_library_s_threads_take_none_of_the_program_s_signals(rig: Rig, spawn: Spawn) -> None:
    # A program that takes SIGTERM with sigwait blocks it in its threads once it has
    # started; the library's threads (the connection's, the one that prepares host copies)
    # came before and must not take it for the program: with no thread of its own left
    # to take it, a SIGTERM would end the program at once, whatever it meant to do.
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release", "swap",
                    "--", str(rig.fakes.delta_program), "8")  # fmt: skip
    job = spawn(argv, env=rig.env, stdin=subprocess.PIPE)
    assert read_line(job) == ["ready"]
    (program,) = descendants(job.pid)
    wait_until(lambda: rig.launches("register"), timeout=30)  # the preparer runs too
    assert job.stdin is not None
    assert ask(job, "block") == ["blocked"]
    os.kill(program, signal.SIGTERM)
    assert ask(job, "sigwait") == ["sigterm"]
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0
