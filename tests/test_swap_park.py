"""A released swapped member is parked: its CUDA contexts leave the GPU too.

The fake driver built with the checkpoint API (``Fakes.checkpoint_directory``) keeps
each process's checkpoint state in a file of ``FAKE_CUDA_CKPT_DIR`` (named after its
pid: 0 running, 1 locked, 2 checkpointed) and logs each lock, checkpoint, restore and
unlock with its time and pid; while the program is locked or checkpointed its
launches, allocations and copies block, as on the driver. Those, the program's own
check of its memory's contents, and the test's own member holding the token are the
witnesses; never vramlock's view of itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.budget import FAKE_NVML
from helpers.commands import vramlock
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, token_free, wait_until
from helpers.serve import call
from helpers.swap_rig import (
    Fakes,
    Rig,
    build_fakes,
    let_go,
    make_rig,
    read_line,
    stopped_stray,
    swap_marks,
)

from vramlock import procfs
from vramlock.procfs import descendants

pytestmark = swap_marks()

RUNNING, CHECKPOINTED = "0", "2"
FAKE_NVML_TOTAL = 80 << 30  # tests/fake_nvml's one GPU


@pytest.fixture(scope="session")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Fakes:
    return build_fakes(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture
def rig(fakes: Fakes, arena: Path, tmp_path: Path) -> Rig:
    """The fake driver that can checkpoint, for the program and for vramlock alike."""
    rig = make_rig(fakes, arena, tmp_path)
    states = tmp_path / "checkpoint"
    states.mkdir()
    rig.env.update(LD_LIBRARY_PATH=str(fakes.checkpoint_directory), FAKE_CUDA_CKPT_DIR=str(states))
    return rig


def state(rig: Rig, pid: int) -> str | None:
    """The fake driver's checkpoint state of ``pid`` (None: it never made a context)."""
    path = Path(rig.env["FAKE_CUDA_CKPT_DIR"]) / str(pid)
    return path.read_text().strip() if path.exists() else None


def calls(rig: Rig, what: str, pid: int) -> list[int]:
    """When the checkpoint API's ``what`` (lock, checkpoint, restore, unlock) was done
    to ``pid``, in monotonic ns."""
    return [ns for ns, target in rig.launches(what) if target == pid]


def server(
    rig: Rig, spawn: Spawn, park_after: str, *, listen: bool = False, **env: str
) -> tuple[subprocess.Popen[str], int, int]:
    """The program as a server idle between requests, under swap: the run, the
    program's pid and the port its clients use (``listen``: vramlock's proxy's, with
    ``--demand listen``; else the program's own, and the run queues again at once after
    each release)."""
    port, upstream = free_ports(2)
    env = dict(rig.env, SWAP_PROG_LISTEN=str(upstream), VRAMLOCK_PARK_AFTER=park_after, **env)
    demand = ["--demand", "listen", "--listen", str(port), "--upstream", str(upstream),
              "--ready-url", "/health", "--idle", "50ms"]  # fmt: skip
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release", "swap",
                 *(demand if listen else []), "--", str(rig.fakes.program), "60"),
        env=env,
    )  # fmt: skip
    wait_until(lambda: accepts(upstream))
    (program,) = descendants(job.pid)
    assert state(rig, program) == RUNNING
    return job, program, port if listen else upstream


def server_and_worker(
    rig: Rig, spawn: Spawn, stop: Path, **env: str
) -> tuple[subprocess.Popen[str], int, int, int]:
    """Two CUDA processes under one swapped run (parked after 0.3 s released): a server
    and a worker, both ended by ``stop``. The run, the server's port, the server's and the
    worker's pids."""
    (port,) = free_ports(1)
    env = dict(rig.env, VRAMLOCK_PARK_AFTER="0.3", SWAP_PROG_STOP=str(stop), **env)
    script = '"$0" 60 & SWAP_PROG_LISTEN=$1 "$0" 60; wait'
    job = rig.command(spawn, "sh", "-c", script, str(rig.fakes.program), str(port), env=env)
    wait_until(lambda: accepts(port))
    wait_until(lambda: len(descendants(job.pid)) == 3)
    _, *programs = descendants(job.pid)
    listening = f"SWAP_PROG_LISTEN={port}".encode()
    (server_pid,) = [p for p in programs if listening in Path(f"/proc/{p}/environ").read_bytes()]
    (worker,) = [p for p in programs if p != server_pid]
    return job, port, server_pid, worker


def locking(rig: Rig, start: int, end: int) -> tuple[int, int]:
    """The host memory the fake driver saw unlocked, then locked, between ``start`` and
    ``end`` (monotonic ns): bytes each."""
    unlocked, locked = (sum(n for _, n in rig.between(start, end, what))
                        for what in ("unregister", "register"))  # fmt: skip
    return unlocked, locked


def round_trip(port: int) -> bytes:
    """One request of GPU work: the program's answer, after it checked its memory."""
    status, _, body = call(port, "POST", "/work", {})
    assert status == 200, body
    return body


@pytest.mark.parametrize("listen", [False, True], ids=["always", "listen"])
def test_a_released_server_is_parked_and_comes_back_whole(
    rig: Rig, spawn: Spawn, listen: bool
) -> None:
    """Released half a second, the server's context leaves the "GPU" while the test's
    member holds the token (``always``: while vramlock waits in the queue for it); its
    request meanwhile waits, and is answered once the context, then the memory, are
    back."""
    stop = rig.tmp / "stop"
    job, program, port = server(rig, spawn, "0.5", listen=listen, SWAP_PROG_STOP=str(stop))
    assert round_trip(port) == b"round 1\n"
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[:1] == ["held"] and int(held[2]) == 0  # its memory left the "GPU"
    wait_until(lambda: state(rig, program) == CHECKPOINTED, timeout=10)
    (locked,), (checkpointed,) = calls(rig, "lock", program), calls(rig, "checkpoint", program)
    assert int(held[1]) < locked < checkpointed
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(round_trip, port)
        time.sleep(0.5)
        assert not answer.done() and not token_free(rig.arena)
        left = let_go(holder)
        assert answer.result(30) == b"round 2\n"  # its contents, checked by the program
    (restored,), (unlocked,) = calls(rig, "restore", program), calls(rig, "unlock", program)
    assert left < restored < unlocked
    assert state(rig, program) == RUNNING and int(rig.phys.read_text()) > 0
    # Its host copies were unlocked before the checkpoint (the driver's restore would
    # lock them again, slowly), and locked again after the unlock, before it ran.
    first_run = min(s for s, _ in rig.launches() if s > unlocked)
    unpinned, _ = locking(rig, int(held[1]), locked)
    assert unpinned > 0 and locking(rig, int(held[1]), restored) == (unpinned, 0)
    assert locking(rig, unlocked, first_run) == (0, unpinned)
    # Its context was back before its memory: nothing of it waited on the driver (a
    # restore of its memory while it was checkpointed would have, for good).
    assert rig.launches("blocked") == []
    assert rig.between(int(held[1]), left) == []
    assert min(s for s, _ in rig.launches() if s > int(held[1])) > unlocked
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2:] == ["done", "2"]  # every buffer checked at its end
    assert err == ""


def stand_in_nvml(rig: Rig, free: int | None = None) -> dict[str, str]:
    """The environment that gives the run NVML (tests/fake_nvml), where the GPU has
    ``free`` bytes free (the test itself "uses" the rest), or all of it."""
    where = rig.tmp / "nvml"
    where.mkdir()
    if free is not None:
        (where / str(os.getpid())).write_text(str(FAKE_NVML_TOTAL - free))
    return {"PYTHONPATH": FAKE_NVML, "FAKE_NVML_DIR": str(where)}


@pytest.mark.parametrize("room", [True, False], ids=["room", "no-room"])
def test_a_parked_server_asked_for_comes_back_while_the_holder_finishes(
    rig: Rig, spawn: Spawn, room: bool
) -> None:
    """A request to a parked server while the test's member holds the token: with room
    for it beside 1 GiB (NVML), its context comes back at once, the driver's restore no
    longer waiting for the token, but the program still runs nothing until the member
    lets go (the fake driver's log of its launches, and the member's token, are the
    witnesses); with less, it comes back after, as before."""
    stop = rig.tmp / "stop"
    nvml = stand_in_nvml(rig, None if room else (5 << 30) // 4)  # 1.25 GiB: not enough
    job, program, port = server(rig, spawn, "1", listen=True, SWAP_PROG_STOP=str(stop), **nvml)
    assert round_trip(port) == b"round 1\n"
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[:1] == ["held"] and int(held[2]) == 0
    wait_until(lambda: state(rig, program) == CHECKPOINTED, timeout=10)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(round_trip, port)
        if room:  # (parked again 1 s later, if it were still queued then)
            wait_until(lambda: len(calls(rig, "unlock", program)) == 1, timeout=10)
        time.sleep(0.3)
        assert not answer.done() and not token_free(rig.arena)
        assert state(rig, program) == (RUNNING if room else CHECKPOINTED)
        left = let_go(holder)
        assert answer.result(30) == b"round 2\n"  # its contents, checked by the program
    (restored,), (unlocked,) = calls(rig, "restore", program), calls(rig, "unlock", program)
    assert (restored < unlocked < left) if room else (left < restored < unlocked)
    # Host copies: unlocked before the park, locked again as soon as it is back.
    (locked,), (checkpointed,) = calls(rig, "lock", program), calls(rig, "checkpoint", program)
    unpinned, _ = locking(rig, int(held[1]), locked)
    assert unpinned > 0 and locking(rig, int(held[1]), checkpointed) == (unpinned, 0)
    assert locking(rig, unlocked, left if room else 2**63) == (0, unpinned)
    assert rig.launches("blocked") == []
    assert rig.between(int(held[1]), left) == []
    assert min(s for s, _ in rig.launches() if s > int(held[1])) > left
    # Its next release parks it as VRAMLOCK_PARK_AFTER says, early or not this time.
    holder = rig.holder(spawn)
    assert read_line(holder)[:1] == ["held"]
    wait_until(lambda: state(rig, program) == CHECKPOINTED, timeout=10)
    let_go(holder)
    assert round_trip(port) == b"round 3\n"
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2:] == ["done", "3"]
    assert err == ""


def test_told_off_it_is_never_parked(rig: Rig, spawn: Spawn) -> None:
    stop = rig.tmp / "stop"
    job, program, port = server(rig, spawn, "off", SWAP_PROG_STOP=str(stop))
    assert round_trip(port) == b"round 1\n"
    holder = rig.holder(spawn)
    assert read_line(holder)[:1] == ["held"]
    time.sleep(2.5)  # longer than a park due now would take to be made
    assert state(rig, program) == RUNNING
    let_go(holder)
    assert round_trip(port) == b"round 2\n"
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert err == ""
    assert [rig.launches(what) for what in ("lock", "checkpoint")] == [[], []]


def test_without_the_checkpoint_api_the_context_stays_and_nothing_breaks(
    rig: Rig, spawn: Spawn
) -> None:
    # The usual fake: a driver without the API, as one older than 570.
    rig.env["LD_LIBRARY_PATH"] = str(rig.fakes.directory)
    stop = rig.tmp / "stop"
    (port,) = free_ports(1)
    env = dict(rig.env, SWAP_PROG_LISTEN=str(port), VRAMLOCK_PARK_AFTER="0.2",
               SWAP_PROG_STOP=str(stop))  # fmt: skip
    job = rig.run(spawn, "60", env=env)
    wait_until(lambda: accepts(port))
    for n in (1, 2, 3):
        assert round_trip(port) == f"round {n}\n".encode()
        holder = rig.holder(spawn)
        held = read_line(holder)
        assert held[:1] == ["held"] and int(held[2]) == 0
        time.sleep(1.5)  # long past the park, due after 0.2 s
        left = let_go(holder)
        assert rig.between(int(held[1]), left) == []
    assert round_trip(port) == b"round 4\n"
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2:] == ["done", "4"]
    assert len(err.splitlines()) <= 1, err  # said once at most, not at every release
    assert [rig.launches(what) for what in ("lock", "checkpoint")] == [[], []]


def test_an_order_to_end_waits_for_the_parked_program_to_come_back(rig: Rig, spawn: Spawn) -> None:
    """Told to end while parked, vramlock passes the signal on only once the program is
    restored: a checkpointed program's exit path would block in the driver (or fail
    there). It waits for the token like any restore, and the program then ends whole."""
    job, program, port = server(rig, spawn, "0.3", SWAP_PROG_TERM="1")
    assert round_trip(port) == b"round 1\n"
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[:1] == ["held"]
    wait_until(lambda: state(rig, program) == CHECKPOINTED, timeout=10)
    os.kill(job.pid, signal.SIGTERM)
    time.sleep(0.5)  # the program's loop would have seen a signal ten times over
    assert job.poll() is None and state(rig, program) == CHECKPOINTED
    left = let_go(holder)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    words = out.split()
    assert words[-2:] == ["done", "1"]  # every buffer checked on its way out
    terminated = int(words[words.index("terminated") + 1])
    (unlocked,) = calls(rig, "unlock", program)
    assert left < unlocked < terminated  # the signal came after its context was back
    assert rig.launches("blocked") == []
    assert rig.between(int(held[1]), left) == []
    assert err == ""


def test_a_wrapper_killed_while_parked_leaves_the_program_off_the_gpu(
    rig: Rig, spawn: Spawn
) -> None:
    """vramlock run SIGKILLed while its program is parked: nobody can restore it, so it
    stays checkpointed, and runs no GPU work whoever holds the token; the next member
    gets the token as usual."""
    job, program, port = server(rig, spawn, "0.3")
    assert round_trip(port) == b"round 1\n"
    try:
        holder = rig.holder(spawn)
        assert read_line(holder)[:1] == ["held"]
        wait_until(lambda: state(rig, program) == CHECKPOINTED, timeout=10)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        launched = len(rig.launches())
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(round_trip, port)  # the program takes it, and blocks
            let_go(holder)
            assert token_free(rig.arena)  # the program holds no token...
            other = rig.holder(spawn)
            held = read_line(other)
            assert held[:1] == ["held"] and int(held[2]) == 0  # ...nor any memory
            time.sleep(0.5)
            assert not answer.done()  # ...and runs nothing
            assert len(rig.launches()) == launched
            assert state(rig, program) == CHECKPOINTED
            let_go(other)
            os.kill(program, signal.SIGKILL)
            with pytest.raises(OSError):
                answer.result(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(program, signal.SIGKILL)


def test_a_wrapper_killed_while_it_unparks_gives_the_token_back(rig: Rig, spawn: Spawn) -> None:
    """vramlock run SIGKILLed while it brings its parked program back (the token taken,
    the contexts not restored yet: the fake's restore takes 3 s here). The program cannot
    run, so it must not keep the token that the command shares with the run: it gives it
    back, and the next member gets it. The program runs nothing, then or later."""
    job, program, port = server(rig, spawn, "0", FAKE_CUDA_CKPT_RESTORE_MS="3000")
    assert round_trip(port) == b"round 1\n"
    try:
        holder = rig.holder(spawn)
        assert read_line(holder)[:1] == ["held"]
        wait_until(lambda: state(rig, program) == CHECKPOINTED, timeout=10)
        launched = len(rig.launches())
        let_go(holder)  # the run takes the token and restores: 3 s
        time.sleep(1.0)
        assert not token_free(rig.arena)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        other = rig.holder(spawn)
        held = read_line(other)  # on the tree before: never
        assert held[:1] == ["held"] and int(held[2]) == 0
        time.sleep(0.5)
        assert len(rig.launches()) == launched and state(rig, program) == CHECKPOINTED
        let_go(other)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(program, signal.SIGKILL)
    assert job.stderr is not None
    said = job.stderr.read()
    assert "went away while the command was parked" in said
    assert "the token is given back" in said


def test_a_parked_program_that_is_killed_ends_the_run_and_frees_the_token(
    rig: Rig, spawn: Spawn
) -> None:
    job, program, port = server(rig, spawn, "0.3")
    assert round_trip(port) == b"round 1\n"
    holder = rig.holder(spawn)
    assert read_line(holder)[:1] == ["held"]
    wait_until(lambda: state(rig, program) == CHECKPOINTED, timeout=10)
    os.kill(program, signal.SIGKILL)  # the OOM killer, say
    out, err = job.communicate(timeout=30)
    assert job.returncode == 128 + signal.SIGKILL, (out, err)
    assert calls(rig, "restore", program) == []  # nothing tried on a process that is gone
    assert len(err.splitlines()) <= 1, err
    let_go(holder)
    assert token_free(rig.arena)


# A process with a context on the fake driver; each line on its stdin runs a "kernel"
# that takes half a second (a host function, as the fake's kernels are).
TARGET = textwrap.dedent(
    """
    import ctypes, sys, time
    lib = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert lib.cuInit(0) == 0 and lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda params: time.sleep(0.5))
    print("ready", flush=True)
    for line in sys.stdin:
        args = [ctypes.cast(KERNEL, ctypes.c_void_p)] + [1] * 6 + [0, None, None, None]
        print("launched", lib.cuLaunchKernel(*args), flush=True)
    """
)

# vramlock's binding (in a process of its own: it loads the driver once), told what to
# do (argv[1]) to the target (argv[2]): what each call answered, on a line.
CALLER = textwrap.dedent(
    """
    import os, sys
    from vramlock.gpu import cuda
    what, target = sys.argv[1], int(sys.argv[2])
    def answer(call, *args):
        try:
            out = call(*args)
        except cuda.CudaError as err:
            return err.code
        return "ok" if out is None else int(out)
    if what == "codes":  # argv[3]: a pid that is gone
        print(answer(cuda.process_state, int(sys.argv[3])),
              answer(cuda.process_state, os.getpid()), answer(cuda.restore_thread_id, target),
              answer(cuda.unlock, target), answer(cuda.restore, target))
    elif what == "lock":  # within a tenth of a second
        print(answer(cuda.lock, target, 0.1), answer(cuda.process_state, target))
    elif what == "checkpoint":
        print(answer(cuda.checkpoint, target, 5), answer(cuda.process_state, target),
              answer(cuda.checkpoint, target, 5))
    else:
        print(answer(cuda.restore, target), answer(cuda.process_state, target))
    """
)


def test_the_fake_driver_answers_as_the_driver_does(rig: Rig, spawn: Spawn) -> None:
    """The fake's checkpoint API itself: the codes vramlock/gpu/cuda.py expects, a lock
    that waits for a kernel in flight, and a launch that waits for the restore."""
    target = spawn([sys.executable, "-c", TARGET], env=rig.env, stdin=subprocess.PIPE)
    assert read_line(target) == ["ready"]
    assert target.stdin is not None
    gone = subprocess.Popen(["true"])
    gone.wait()

    def caller(*args: object) -> list[str]:
        done = subprocess.run([sys.executable, "-c", CALLER, *map(str, args)], env=rig.env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done
        return done.stdout.split()

    # Gone: 304; no context (the caller itself): 3; unlock or restore while running: 401.
    assert caller("codes", target.pid, gone.pid) == ["304", "3", str(target.pid), "401", "401"]
    target.stdin.write("go\n")
    target.stdin.flush()
    time.sleep(0.1)  # its kernel runs half a second
    assert caller("lock", target.pid) == ["600", "0"]  # not ready, and still running
    assert read_line(target) == ["launched", "0"]
    # Checkpointed (a second checkpoint: 401), its next launch waits for the restore.
    assert caller("checkpoint", target.pid) == ["ok", "2", "401"]
    target.stdin.write("go\n")
    target.stdin.flush()
    time.sleep(0.3)
    assert [s for s, _ in rig.launches()][1:] == []
    assert caller("restore", target.pid) == ["ok", "0"]
    assert read_line(target) == ["launched", "0"]
    (blocked,), (unlocked,) = rig.launches("blocked"), calls(rig, "unlock", target.pid)
    assert blocked[1] > unlocked and rig.launches()[1][0] > unlocked


def test_a_cuda_process_started_after_a_checkpoint_is_stopped_until_the_turn(
    rig: Rig, spawn: Spawn
) -> None:
    # Under --release checkpoint, the release checkpoints the processes that use CUDA
    # then. One that starts after it (another program of the command) would run on the
    # GPU in the next member's turn: the run's watch stops it before its first kernel
    # (the fake's cuInit takes 300 ms, as a real driver's start takes longer than the
    # watch's looks) and lets it go in the command's turn. Witness: the fake driver's
    # launch log against the test's own member.
    go = rig.tmp / "go"
    program = rig.fakes.program
    script = (f"{program} 30 & while [ ! -e {go} ]; do sleep 0.02; done;"
              f" FAKE_CUDA_INIT_MS=300 {program} 1; kill $!; wait $!; exit 0")  # fmt: skip
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release",
                 "checkpoint", "--", "sh", "-c", script),
        env=rig.env,
    )  # fmt: skip
    wait_until(lambda: any(state(rig, pid) == RUNNING for pid in descendants(job.pid)))
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held"
    first = next(pid for pid in descendants(job.pid) if state(rig, pid) == CHECKPOINTED)
    go.touch()  # the second program starts now, in the test's turn

    pid = stopped_stray(job, str(program), lambda pid: pid != first)
    time.sleep(0.5)
    left = let_go(holder)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    during = [s for s, _ in rig.launches() if int(held[1]) < s < left]
    assert during == [], during
    assert max(s for s, _ in rig.launches()) > left  # both ran on, in the command's turn
    said = [line for line in err.splitlines() if "began to use CUDA" in line]
    assert len(said) == 1 and f"process {pid} of the command" in said[0], err


def test_a_worker_forked_after_a_checkpoint_is_not_stopped(rig: Rig, spawn: Spawn) -> None:
    # Under --release checkpoint, a checkpointed CUDA process forks a worker (no exec)
    # while released, as a data loader starts its workers: the worker has the driver
    # mapped, as its parent, and no context of its own (the driver says so). It is not
    # stopped, nor said to use CUDA. Witnesses: its state, and the run's stderr.
    go = rig.tmp / "go"
    code = textwrap.dedent(
        """
        import ctypes, os, sys, time
        cuda = ctypes.CDLL("libcuda.so.1")
        ctx, ptr = ctypes.c_void_p(), ctypes.c_ulonglong()
        assert cuda.cuInit(0) == 0
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20) == 0
        print("ready", flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.02)
        pid = os.fork()
        if pid == 0:
            time.sleep(1.5)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        """
    )
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release",
                 "checkpoint", "--", sys.executable, "-c", code, str(go)),
        env=rig.env,
    )  # fmt: skip
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    assert read_line(holder)[0] == "held"
    (parent,) = descendants(job.pid)
    assert state(rig, parent) == CHECKPOINTED
    go.touch()  # the worker is forked now, in the test's turn
    wait_until(lambda: len(descendants(job.pid)) == 2)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        assert all(procfs.state(pid) != "T" for pid in descendants(job.pid))
        time.sleep(0.005)
    let_go(holder)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert "began to use CUDA" not in err, err


def test_a_parked_process_that_dies_does_not_keep_the_others_off_the_gpu(
    rig: Rig, spawn: Spawn
) -> None:
    """Two CUDA processes in one command, both parked; one is killed meanwhile (the OOM
    killer, say). On the next turn the one that lives gets its context and memory back
    and answers: the restore of a process that is gone must not leave the others
    checkpointed for good."""
    stop = rig.tmp / "stop"
    job, port, server_pid, worker = server_and_worker(rig, spawn, stop)
    programs = [server_pid, worker]
    wait_until(lambda: all(state(rig, p) == RUNNING for p in programs))
    assert round_trip(port) == b"round 1\n"
    holder = rig.holder(spawn)
    assert read_line(holder)[:1] == ["held"]
    wait_until(lambda: all(state(rig, p) == CHECKPOINTED for p in programs), timeout=10)
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: worker not in descendants(job.pid))  # reaped by its shell
    let_go(holder)
    assert round_trip(port) == b"round 2\n"  # its contents, checked by the program
    assert state(rig, server_pid) == RUNNING
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert "done 2" in out and "could not be restored" not in err, (out, err)


def test_a_process_that_ends_as_it_is_parked_leaves_parking_on(rig: Rig, spawn: Spawn) -> None:
    """Two CUDA processes, one ending while the driver locks them for the park (each lock
    slowed to two seconds here): the park fails for a process that is gone, which says
    nothing of the others; the next look parks them, and no warning says parking is off."""
    stop = rig.tmp / "stop"
    job, port, server_pid, worker = server_and_worker(rig, spawn, stop,
                                                      FAKE_CUDA_CKPT_LOCK_MS="2000")  # fmt: skip
    holder = rig.holder(spawn)
    assert read_line(holder)[:1] == ["held"]
    time.sleep(1.0)  # the park is due after 0.3 s: its first lock is under way
    assert calls(rig, "lock", server_pid) == calls(rig, "lock", worker) == []
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: state(rig, server_pid) == CHECKPOINTED, timeout=15)
    let_go(holder)
    assert round_trip(port) == b"round 1\n"
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert "done 1" in out and "stay on the GPU" not in err, (out, err)


def test_a_process_started_while_parked_waits_for_the_turn(rig: Rig, spawn: Spawn) -> None:
    """A second CUDA process of the command starts while the first is parked: it joins
    released, touches nothing on the "GPU" (not even a context) while the test's member
    holds the token, and runs once the command is back, its parked process restored."""
    (port,) = free_ports(1)
    go, stop = rig.tmp / "go", rig.tmp / "stop"
    env = dict(rig.env, VRAMLOCK_PARK_AFTER="0.3", SWAP_PROG_STOP=str(stop))
    script = f'SWAP_PROG_LISTEN=$1 "$0" 60 & SWAP_PROG_START_AFTER={go} "$0" 60; wait'
    job = rig.command(spawn, "sh", "-c", script, str(rig.fakes.program), str(port), env=env)
    wait_until(lambda: accepts(port))
    assert sorted([read_line(job), read_line(job)]) == [["ready"], ["waiting"]]
    listening = f"SWAP_PROG_LISTEN={port}".encode()
    _, *programs = descendants(job.pid)
    (server_pid,) = [p for p in programs if listening in Path(f"/proc/{p}/environ").read_bytes()]
    (late,) = [p for p in programs if p != server_pid]
    assert round_trip(port) == b"round 1\n"
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[:1] == ["held"]
    wait_until(lambda: state(rig, server_pid) == CHECKPOINTED, timeout=10)
    go.touch()  # CUDA starts in the late one now, while the test's member holds the token
    time.sleep(1.0)
    assert state(rig, late) is None  # no context: its first CUDA call waits for its turn
    left = let_go(holder)
    assert read_line(job) == ["ready"]  # the late one, on the command's turn
    assert round_trip(port) == b"round 2\n"
    assert rig.between(int(held[1]), left) == []
    assert rig.launches("blocked") == []
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and err == "", (out, err)
