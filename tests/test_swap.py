"""``--release swap`` against a fake driver: no GPU needed.

tests/fake_cuda/fake_libcuda.c is a libcuda.so.1 whose device memory is host memory
(see its header): a "kernel" runs on the CPU and logs each launch with its times,
and the physical memory it holds is written to a file at every change. The
program (tests/fake_cuda/swap_prog.c) finds the driver as the CUDA runtime does,
allocates in every way the library handles, and checks its memory's contents as
it goes. The other member is a process the test owns, holding the token itself;
its times, the fake's launch log and its physical-memory file are the witnesses.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, token_free, wait_until
from helpers.swap_rig import (
    Fakes,
    Rig,
    _driver_here,
    build_fakes,
    during,
    make_rig,
    read_line,
    resumed,
    swap_turns,
    take_turn,
)

from vramlock.gpu import swap
from vramlock.procfs import descendants

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(swap.compiler() is None, reason="no C compiler to build the fakes"),
]


@pytest.fixture(scope="session")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Fakes:
    return build_fakes(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture
def rig(fakes: Fakes, arena: Path, tmp_path: Path) -> Rig:
    return make_rig(fakes, arena, tmp_path)


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


def test_a_library_that_cannot_be_built_fails_before_the_command(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    env = dict(rig.env, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--release", "swap", "--", "touch", str(marker)),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1
    assert "--release swap cannot be used here" in done.stderr and "no-such-cc" in done.stderr
    assert not marker.exists()


def test_a_cache_directory_that_cannot_be_made_fails_before_the_command(
    rig: Rig, tmp_path: Path
) -> None:
    marker, plain = tmp_path / "started", tmp_path / "a-file"
    plain.touch()
    env = dict(rig.env, XDG_CACHE_HOME=str(plain / "cache"))
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--release", "swap", "--", "touch", str(marker)),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1
    assert "--release swap cannot be used here" in done.stderr
    assert f"{plain}/cache/vramlock cannot be made: Not a directory" in done.stderr
    assert not marker.exists()


@pytest.mark.skipif(_driver_here(), reason="a CUDA driver is installed here")
def test_no_driver_fails_before_the_command(arena: Path, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    done = subprocess.run(
        vramlock("run", "--arena", str(arena), "--release", "swap", "--", "touch", str(marker)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1
    assert "--release swap cannot be used here: cannot load libcuda.so.1" in done.stderr
    assert not marker.exists()


def test_the_library_compiles_without_warnings(tmp_path: Path) -> None:
    swap.build(tmp_path / "lib.so", "-Werror")
    nm = shutil.which("nm")
    if nm is None:
        return
    exported = subprocess.run([nm, "-D", "--defined-only", str(tmp_path / "lib.so")],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    names = {line.split()[-1] for line in exported.splitlines()}
    assert {"dlsym", "cuGetProcAddress_v2", "cuMemAlloc_v2", "cuLaunchKernel"} <= names
    assert not any(n.startswith(("gate_", "own_", "real_")) for n in names)


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
    holder = rig.holder(spawn)  # queues; the command cannot let it in
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2] == "done"  # every round ran, contents intact
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert f"cannot be swapped: {why}; it was left running" in lines[0]
    assert "holding the GPU until it exits" in lines[0]
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())  # only once the command was done


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


@pytest.mark.parametrize("variable", ["LD_PRELOAD", "VRAMLOCK_SWAP_SOCKET"])
def test_a_process_that_lost_the_library_is_refused_and_the_command_keeps_the_gpu(
    rig: Rig, spawn: Spawn, variable: str
) -> None:
    # The shell removes LD_PRELOAD (as a setuid program or an env scrub would), or the
    # socket's name: the program runs on the driver with no library to release it, or a
    # library that cannot reach its run.
    prog = str(rig.fakes.program)
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release", "swap", "--",
                 "sh", "-c", f"env -u {variable} {prog} 2"),
        env=rig.env,
    )  # fmt: skip
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)  # queues; the command cannot let it in
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "uses CUDA without the swap library" in lines[0]
    assert "holding the GPU until it exits" in lines[0]
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())  # only once the command was done


def test_a_wrapper_killed_while_released_leaves_the_program_blocked(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        job = rig.run(spawn, "60", stderr=err)
    assert read_line(job) == ["ready"]
    program = descendants(job.pid)
    assert len(program) == 1
    try:
        holder = rig.holder(spawn)
        assert read_line(holder)[0] == "held"  # the command is released
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        wait_until(lambda: "went away" in err_file.read_text())
        launched = len(rig.launches())
        assert holder.stdin is not None
        holder.stdin.close()
        assert read_line(holder)[0] == "leaving"
        assert holder.wait(10) == 0
        assert token_free(rig.arena)  # nobody holds the token, and still:
        (row,) = [r for r in who_json(rig.arena) if r["pid"] == program[0]]
        assert row["state"] == "released" and row["strategy"] == "swap"
        assert "its vramlock run is gone" in row["note"]
        time.sleep(0.5)  # the program's loop would have launched dozens of times
        assert len(rig.launches()) == launched
        assert int(rig.phys.read_text()) == 0
        assert err_file.read_text().count("\n") == 1
    finally:
        for pid in program:
            os.kill(pid, signal.SIGKILL)


def test_every_cuda_process_of_the_command_is_swapped(rig: Rig, spawn: Spawn) -> None:
    stop = rig.tmp / "stop"
    prog = str(rig.fakes.program)
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release", "swap", "--",
                 "sh", "-c", f"{prog} 60 & {prog} 60; wait $!"),
        env=dict(rig.env, SWAP_PROG_STOP=str(stop)),
    )  # fmt: skip
    assert read_line(job) == ["ready"] and read_line(job) == ["ready"]
    out, _ = swap_turns(rig, spawn, job, stop, 3)  # both processes' memory was gone
    assert out.split().count("done") == 2  # each checked every buffer at its end


def test_a_restore_without_memory_gives_the_gpu_back_and_queues_again(
    rig: Rig, spawn: Spawn
) -> None:
    full, stop = rig.tmp / "full", rig.tmp / "stop"
    env = dict(rig.env, FAKE_CUDA_FULL=str(full), SWAP_PROG_STOP=str(stop))
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
    assert "release failed" in lines[0] and "cuMemHostAlloc" in lines[0]
    assert "could not be swapped out 3 times in a row" in lines[1]
    assert lines[1].endswith("holding the GPU until it exits")
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())  # only once the command was done


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


def test_the_hub_stops_listening_when_the_run_ends(tmp_path: Path) -> None:
    import socket

    from vramlock.strategies.swap import Hub

    path = str(tmp_path / "control")
    hub = Hub(path, str(tmp_path / "lib.so"))
    hub.close()
    assert not hub._thread.is_alive()  # not left blocked in accept()
    with socket.socket(socket.AF_UNIX) as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(path)


def test_a_library_path_ld_preload_cannot_carry_fails_before_the_command(
    rig: Rig, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    env = dict(rig.env, XDG_CACHE_HOME=str(tmp_path / "my cache"))
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--release", "swap", "--", "touch", str(marker)),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1 and "cannot go in LD_PRELOAD" in done.stderr
    assert not marker.exists()


def test_a_process_whose_run_goes_before_answering_stays_off_the_gpu(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    import socket

    path, err_file = tmp_path / "control", tmp_path / "stderr"
    env = dict(rig.env, LD_PRELOAD=str(swap.library_path()), VRAMLOCK_SWAP_SOCKET=str(path))
    with socket.socket(socket.AF_UNIX) as server, err_file.open("w") as err:
        server.bind(str(path))
        server.listen()
        server.settimeout(30)
        prog = spawn([str(rig.fakes.program), "5"], env=env, stderr=err)
        conn, _ = server.accept()
        assert conn.recv(64).startswith(b"hello ")
        conn.close()  # as a SIGKILLed run would, before saying resident or release
    wait_until(lambda: "went away" in err_file.read_text())
    time.sleep(0.3)  # it would have initialised and launched by now
    assert prog.poll() is None
    assert rig.launches() == [] and int(rig.phys.read_text()) == 0


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
