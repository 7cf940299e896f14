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

import contextlib
import ctypes
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, own_pid_namespace, queued, token_free, wait_until
from helpers.serve import call
from helpers.swap_rig import (
    DEAF_PEER,
    Rig,
    _driver_here,
    ask,
    during,
    let_go,
    ran_after,
    read_line,
    resumed,
    stopped_stray,
    swap_turns,
    take_turn,
    turns_then_stop,
)

from vramlock import procfs
from vramlock.arena import records
from vramlock.gpu import swap
from vramlock.procfs import descendants, environ, mapped, starttime, state, stopped
from vramlock.strategies.swap import Hub

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(swap.compiler() is None, reason="no C compiler to build the fakes"),
]


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
        pytest.skip("no nm here to list the library's exported names")
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


@pytest.mark.parametrize(
    "how",
    ["env -u LD_PRELOAD", "env -u VRAMLOCK_SWAP_SOCKET", "env -i", "python-execve",
     "python-spawn", "system"],
)  # fmt: skip
def test_a_program_execd_without_the_library_gets_it_back(rig: Rig, spawn: Spawn, how: str) -> None:
    # A process of the command execs the program with the library's variables taken out
    # of its environment: through the C library's exec and spawn, the library is passed
    # on all the same, and the program, started while another member holds the token,
    # runs nothing until the command's turn (witness: the fake driver's launch log).
    path = rig.fakes.program
    program = f"{path} 1"
    scrub = "{k: v for k, v in os.environ.items() if not k.startswith(('LD_', 'VRAMLOCK_'))}"
    keep = f"dict({scrub}, LD_LIBRARY_PATH=os.environ['LD_LIBRARY_PATH'])"
    fake = "FAKE_CUDA_PHYS=$FAKE_CUDA_PHYS FAKE_CUDA_LAUNCH_LOG=$FAKE_CUDA_LAUNCH_LOG"
    python = {
        "python-execve": f"import os; os.execve('{path}', ['p', '1'], {keep})",
        "python-spawn": f"import os, subprocess; subprocess.run(['{path}', '1'], env={keep})",
        "system": "import os; os.environ.pop('LD_PRELOAD'); os.environ.pop("
                  f"'VRAMLOCK_SWAP_SOCKET'); assert os.system('{program}') == 0",
    }  # fmt: skip
    launch = {
        "env -u LD_PRELOAD": f"env -u LD_PRELOAD {program}",
        "env -u VRAMLOCK_SWAP_SOCKET": f"env -u VRAMLOCK_SWAP_SOCKET {program}",
        "env -i": f"env -i LD_LIBRARY_PATH=$LD_LIBRARY_PATH {fake} {program}",
    }.get(how) or f'python3 -c "{python[how]}"'
    go = rig.tmp / "go"
    script = f"while [ ! -e {go} ]; do sleep 0.02; done; {launch}"
    job = rig.command(spawn, "sh", "-c", script)
    wait_until(lambda: [m["state"] for m in who_json(rig.arena)] == ["resident"])
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held"
    go.touch()  # the program starts now, in the test's turn
    time.sleep(1.0)
    assert rig.launches() == [] and int(rig.phys.read_text()) == 0
    ran_after(rig, job, let_go(holder))


def test_a_huge_environment_is_passed_on_from_a_small_stack(rig: Rig, spawn: Spawn) -> None:
    # A thread with a small stack (256 KiB) execs a program with an environment of
    # 40,000 variables and no LD_PRELOAD: the exec works as it does without the library
    # (the copy with the library put back does not fit on that stack), and the program
    # has the library. Witness: the program's own environment and exit status.
    code = (
        "import os, sys, threading\n"
        "env = {f'V{i}': 'x' for i in range(40000)}\n"
        "args = ['sh', '-c', 'printf \"%s\\\\n\" \"$LD_PRELOAD\"']\n"
        "threading.stack_size(256 * 1024)\n"
        "threading.Thread(target=os.execve, args=('/bin/sh', args, env)).start()\n"
        "threading.Event().wait()\n"
    )
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--release", "swap", "--",
                 "python3", "-c", code),
        env=rig.env,
    )  # fmt: skip
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split(":")[0].strip() == str(swap.library_path()), out


def test_a_program_that_slips_past_the_library_while_released_is_stopped(
    rig: Rig, spawn: Spawn
) -> None:
    # After the release, a process of the command execs the program by the system call
    # itself without LD_PRELOAD (as Go's runtime execs): no library, no gate. The run's
    # watch stops it before its first kernel (the fake's cuInit takes 300 ms, as a real
    # driver's start and context take longer than the watch's looks), and it runs,
    # unswapped, in the command's turn. Witness: the fake driver's launch log against
    # the test's own member.
    go = rig.tmp / "go"
    env = dict(rig.env, FAKE_CUDA_INIT_MS="300")
    script = (f"while [ ! -e {go} ]; do sleep 0.02; done;"
              f" {rig.fakes.raw_exec} LD_PRELOAD -- {rig.fakes.program} 1")  # fmt: skip
    job = rig.command(spawn, "sh", "-c", script, env=env)
    wait_until(lambda: [m["state"] for m in who_json(rig.arena)] == ["resident"])
    holder = rig.holder(spawn)
    assert read_line(holder)[0] == "held"
    go.touch()  # the program starts now, in the test's turn

    pid = stopped_stray(job, str(rig.fakes.program))

    def noted() -> bool:
        notes = [m["note"] or "" for m in who_json(rig.arena) if m["member"]]
        return any(f"stopped until its turn: {pid} " in n for n in notes)

    wait_until(noted)  # who says so too
    time.sleep(0.5)
    assert rig.launches() == [] and state(pid) == "T"
    err = ran_after(rig, job, let_go(holder))
    said = [line for line in err.splitlines() if "began to use CUDA" in line]
    assert len(said) == 1 and f"process {pid} of the command" in said[0], err
    assert "stopped until the command's turn" in said[0]


@pytest.mark.parametrize("how", ["exec-in-place", "library-without-its-socket"])
def test_a_program_that_slips_past_the_library_on_a_quiet_host_is_stopped(
    rig: Rig, spawn: Spawn, how: str
) -> None:
    # As above, on a host where nothing else starts processes (the run in a pid namespace
    # of its own): the program is exec'd by the system call in place of the process that
    # waited (no new pid), or it has the library mapped without the socket's name, and
    # maps the driver only after the release. Each must be stopped before its first
    # kernel all the same. Witness: the fake driver's launch log against the test's own
    # member.
    go = rig.tmp / "go"
    env = dict(rig.env, FAKE_CUDA_INIT_MS="300")
    program, raw_exec = str(rig.fakes.program), str(rig.fakes.raw_exec)
    if how == "exec-in-place":
        command = ["python3", "-c", (
            "import os, sys, time\nprint('waiting', flush=True)\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
            "time.sleep(0.2)\nos.execv(sys.argv[2], sys.argv[2:])"
        ), str(go), raw_exec, "LD_PRELOAD", "--", program, "1"]  # fmt: skip
    else:
        env["SWAP_PROG_START_AFTER"] = str(go)
        command = [raw_exec, "VRAMLOCK_SWAP_SOCKET", "--", program, "1"]
    job = spawn(
        [*own_pid_namespace(), *vramlock("run", "--arena", str(rig.arena), "--min-hold", "0",
                                         "--release", "swap", "--", *command)],
        env=env,
    )  # fmt: skip
    assert read_line(job) == ["waiting"]
    holder = rig.holder(spawn)
    assert read_line(holder)[0] == "held"
    go.touch()  # the program starts now, in the test's turn

    pid = stopped_stray(job, program)
    time.sleep(0.5)
    assert rig.launches() == [] and state(pid) == "T"
    err = ran_after(rig, job, let_go(holder))
    said = [line for line in err.splitlines() if "began to use CUDA" in line]
    assert len(said) == 1 and "stopped until the command's turn" in said[0], err


def test_a_program_linked_against_the_driver_waits_its_turn_unstopped(
    rig: Rig, spawn: Spawn
) -> None:
    # A program linked against the driver, started while the command is released: the
    # dynamic linker maps the driver, then runs the constructors of the program's own
    # libraries (one of them slow, as a C++ library's static initialisers are) before
    # the swap library's. It has the library all along: it waits for its turn as any
    # other, and is neither stopped nor said to use CUDA beyond it.
    go = rig.tmp / "go"
    env = dict(rig.env, SLOW_INIT_MS="300")
    program = str(rig.fakes.linked_program)
    script = f"while [ ! -e {go} ]; do sleep 0.02; done; {program} 1"
    job = rig.command(spawn, "sh", "-c", script, env=env)
    wait_until(lambda: [m["state"] for m in who_json(rig.arena)] == ["resident"])
    holder = rig.holder(spawn)
    assert read_line(holder)[0] == "held"
    go.touch()  # the program starts now, in the test's turn

    def started() -> list[int]:
        found = []
        for pid in descendants(job.pid):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/exe") == program:
                    found.append(pid)
        return found

    wait_until(lambda: started() != [])
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        assert all(state(pid) != "T" for pid in started())
        time.sleep(0.005)
    assert rig.launches() == []
    err = ran_after(rig, job, let_go(holder))
    assert "began to use CUDA" not in err, err


def test_a_program_still_starting_when_a_member_asks_is_released(rig: Rig, spawn: Spawn) -> None:
    # A member asks for the token while the command's program is still starting: the
    # dynamic linker has mapped the driver (the program links it) and the swap library,
    # but a slow constructor runs before the library's. The program was given the socket:
    # it joins released, as any process does. The wrapper used to take it for a program
    # beyond the library and keep the GPU until it exited (a CUDA llama-server started
    # just before the other server's request: that request waited for good).
    env = dict(rig.env, SLOW_INIT_MS="1500")
    program = str(rig.fakes.linked_program)
    job = rig.command(spawn, program, "1", env=env)

    def starting() -> bool:
        for pid in descendants(job.pid):
            paths = mapped(pid)
            if paths and any(os.path.basename(p) == "libcuda.so.1" for p in paths):
                return True
        return False

    wait_until(starting)
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held"
    time.sleep(2.0)  # its constructors are done: it waits for its turn
    left = let_go(holder)
    err = ran_after(rig, job, left)
    assert "without the swap library" not in err, err
    # It ran nothing before the member's turn, nor in it: all of it came after.
    assert left > int(held[1])


def test_a_program_that_drops_the_socket_while_starting_waits_its_turn(
    rig: Rig, spawn: Spawn
) -> None:
    # As above, and the slow constructor takes the socket's name out of the process's
    # environment before the swap library's constructor reads it (a library that scrubs
    # the environment at start). The wrapper saw the name in the environment the program
    # was started with and released the command, taking the program for one still
    # starting: the program must join released all the same, not run unswapped in the
    # member's turn.
    env = dict(rig.env, SLOW_INIT_MS="1000", SLOW_INIT_UNSETENV="VRAMLOCK_SWAP_SOCKET")
    program = str(rig.fakes.linked_program)
    job = rig.command(spawn, program, "1", env=env)
    wait_until(lambda: _starting(job, program))
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held"
    time.sleep(2.0)  # its constructors are done: it waits for its turn
    left = let_go(holder)
    err = ran_after(rig, job, left)
    assert not rig.between(int(held[1]), left), err


def test_a_program_started_with_the_socket_named_twice_is_stopped_while_released(
    rig: Rig, spawn: Spawn
) -> None:
    # After the release, a process of the command execs the program with an environment
    # that names the socket twice: empty first, this run's path after it. The C library
    # reads the first (the swap library in the program is not given the socket: it lets
    # every call through); the wrapper must not read the last and take the program for
    # one the library holds. The run's watch stops it before its first kernel.
    go = rig.tmp / "go"
    env = dict(rig.env, FAKE_CUDA_INIT_MS="300")
    program = str(rig.fakes.program)
    code = (
        "import ctypes, os, sys, time\n"
        "print('waiting', flush=True)\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
        "env = [b'VRAMLOCK_SWAP_SOCKET='] + [k + b'=' + v for k, v in os.environb.items()]\n"
        "envp = (ctypes.c_char_p * (len(env) + 1))(*env, None)\n"
        "argv = (ctypes.c_char_p * 3)(sys.argv[2].encode(), b'1', None)\n"
        "ctypes.CDLL(None).execve(sys.argv[2].encode(), argv, envp)\n"
        "sys.exit(127)\n"
    )
    job = rig.command(spawn, "python3", "-c", code, str(go), program, env=env)
    assert read_line(job) == ["waiting"]
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held"
    go.touch()  # the program starts now, in the test's turn

    def stopped_or_ran() -> bool:
        return bool(rig.launches()) or any(
            os.path.realpath(f"/proc/{pid}/exe") == program and state(pid) == "T"
            for pid in descendants(job.pid)
        )

    wait_until(stopped_or_ran)
    time.sleep(0.5)
    left = let_go(holder)
    err = ran_after(rig, job, left)
    assert not rig.between(int(held[1]), left), err


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


def _starting(job: subprocess.Popen[str], program: str) -> bool:
    """Does a process of ``job`` run ``program`` with the CUDA driver mapped?"""
    for pid in descendants(job.pid):
        with contextlib.suppress(OSError):
            paths = mapped(pid)
            if os.readlink(f"/proc/{pid}/exe") == program and paths is not None:
                return any(os.path.basename(p) == "libcuda.so.1" for p in paths)
    return False


def test_a_spawn_caught_before_its_exec_is_not_stopped(rig: Rig, spawn: Spawn) -> None:
    # A CUDA process of the command spawns a program while released (posix_spawn, as
    # Python's subprocess and many runtimes do: a child that shares its memory until it
    # execs), and the child waits before its exec (it opens a FIFO nobody writes to
    # yet). Until then the child is its parent's memory map: the driver and the library
    # (joined) in a process that is no peer. It runs nothing of its own, and must be
    # neither stopped nor said to use CUDA.
    go, fifo = rig.tmp / "go", rig.tmp / "fifo"
    os.mkfifo(fifo)
    code = (
        "import ctypes, os, sys, time\n"
        "assert ctypes.CDLL('libcuda.so.1').cuInit(0) == 0\n"
        "print('joined', flush=True)\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
        "wait = [(os.POSIX_SPAWN_OPEN, 0, sys.argv[2], os.O_RDONLY, 0)]\n"
        "pid = os.posix_spawn('/bin/true', ['true'], os.environ, file_actions=wait)\n"
        "assert os.waitpid(pid, 0)[1] == 0\n"
    )
    job = rig.command(spawn, "python3", "-c", code, str(go), str(fifo))
    assert read_line(job) == ["joined"]
    holder = rig.holder(spawn)
    assert read_line(holder)[0] == "held"
    go.touch()
    wait_until(lambda: len(descendants(job.pid)) == 2)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        assert all(state(pid) != "T" for pid in descendants(job.pid))
        time.sleep(0.005)

    def let_it_exec() -> bool:
        try:  # once the child waits in its open
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            return False
        return True

    wait_until(let_it_exec)
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(10) == 0
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert "began to use CUDA" not in err, err


def test_a_run_told_to_end_while_a_stray_is_stopped_ends_without_its_turn(
    rig: Rig, spawn: Spawn
) -> None:
    # SIGTERM to vramlock run while a program that slipped past the library is stopped
    # and the test's member holds the token: the command is told at once, as it is with
    # nothing stopped (its shell ends), and the run ends without waiting for a turn that
    # may never come. The stopped program (it catches SIGTERM) never runs meanwhile: it
    # is killed where it stands. Witnesses: its state, and the fake driver's launch log
    # and memory.
    go = rig.tmp / "go"
    env = dict(rig.env, FAKE_CUDA_INIT_MS="300", SWAP_PROG_TERM="1")
    program = str(rig.fakes.program)
    script = (f"while [ ! -e {go} ]; do sleep 0.02; done;"
              f" {rig.fakes.raw_exec} LD_PRELOAD -- {program} 30")  # fmt: skip
    job = rig.command(spawn, "sh", "-c", script, env=env)
    wait_until(lambda: [m["state"] for m in who_json(rig.arena)] == ["resident"])
    holder = rig.holder(spawn)
    assert read_line(holder)[0] == "held"
    go.touch()

    pid = stopped_stray(job, program)
    time.sleep(0.5)  # its driver's start is over: continued, it would launch at once
    job.send_signal(signal.SIGTERM)
    states: list[str | None] = []  # the stopped program's, until the run is over
    end = time.monotonic() + 15
    while job.poll() is None and time.monotonic() < end:
        states.append(state(pid))
        time.sleep(0.002)
    assert job.poll() == 128 + signal.SIGTERM, job.poll()
    # Stopped until it was killed (R or D as it dies): never continued, to be stopped again.
    dying = next((i for i, st in enumerate(states) if st != "T"), len(states))
    assert "T" not in states[dying:], states
    assert rig.launches() == [] and int(rig.phys.read_text()) == 0
    assert holder.poll() is None  # the test's member held the token all along
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(10) == 0


def test_a_stray_continued_for_a_restore_that_fails_is_stopped_again(
    rig: Rig, spawn: Spawn
) -> None:
    # A program that slipped past the library is stopped while the command is released.
    # At the command's turn it is continued; but the restore fails (somebody outside the
    # arena took the GPU's memory), and the member gives the token back: the program must
    # be stopped again before the next member's turn, not some looks later. Witness: the
    # fake driver's launch log against the test's second turn.
    go, full, stop = rig.tmp / "go", rig.tmp / "full", rig.tmp / "stop"
    prog = str(rig.fakes.program)
    script = (f"{prog} 60 & while [ ! -e {go} ]; do sleep 0.02; done;"
              f" env -u FAKE_CUDA_FULL FAKE_CUDA_INIT_MS=300 {rig.fakes.raw_exec} LD_PRELOAD"
              f" -- {prog} 2; touch {stop}; wait")  # fmt: skip
    env = dict(rig.env, FAKE_CUDA_FULL=str(full), SWAP_PROG_STOP=str(stop))
    job = rig.command(spawn, "sh", "-c", script, env=env)
    assert read_line(job) == ["ready"]
    first = rig.holder(spawn)
    assert read_line(first)[0] == "held"
    go.touch()

    pid = stopped_stray(job, prog, lambda pid: "LD_PRELOAD" not in environ(pid))
    full.touch()  # the restore at the command's turn fails
    second = rig.holder(spawn)
    wait_until(lambda: queued(second.pid))
    let_go(first)
    held = read_line(second)
    assert held[0] == "held"
    start = time.monotonic()
    while time.monotonic() < start + 0.5:
        assert stopped(pid), state(pid)  # T, or SIGSTOP pending: it runs nothing
        if time.monotonic() > start + 0.05:  # the first looks of the watch, closely
            time.sleep(0.002)
    full.unlink()
    left = let_go(second)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert "could not be restored" in err, err
    assert not rig.between(int(held[1]), left)
    assert max(s for s, _ in rig.launches()) > left  # both ran on, in the command's turn


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


def check_orphan_record(arena: Path, pid: int) -> None:
    """The record the library wrote for ``pid`` is one vramlock.arena.records reads whole:
    every field it writes is a field of Record, and each the reader takes is right (a field
    renamed on either side fails here)."""
    members = os.open(arena / "members", os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = [(rec, ok) for rec, ok in records.read_live(members) if rec.pid == pid]
    finally:
        os.close(members)
    assert len(found) == 1, found
    rec, trusted = found[0]
    assert trusted  # file owner, stated uid and process owner agree
    start = starttime(pid)
    raw = json.loads((arena / "members" / records.record_name(pid, start or 0)).read_text())
    assert set(raw) <= set(records.Record.FIELDS), raw
    assert raw["version"] == records.RECORD_VERSION
    assert (rec.pid, rec.starttime, rec.uid) == (pid, start, os.geteuid())
    assert rec.name == Path(f"/proc/{pid}/comm").read_text().strip()
    assert rec.command == Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    assert (rec.strategy, rec.state) == ("swap", "released")
    assert abs(rec.since - time.time()) < 60
    assert rec.note == "its vramlock run is gone: blocked until ended"


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
        check_orphan_record(rig.arena, program[0])
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
    env = dict(rig.env, SWAP_PROG_STOP=str(stop))
    job = rig.command(spawn, "sh", "-c", f"{prog} 60 & {prog} 60; wait $!", env=env)
    assert read_line(job) == ["ready"] and read_line(job) == ["ready"]
    out, _ = swap_turns(rig, spawn, job, stop, 3)  # both processes' memory was gone
    assert out.split().count("done") == 2  # each checked every buffer at its end


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


def test_the_hub_stops_listening_when_the_run_ends(tmp_path: Path) -> None:
    path = str(tmp_path / "control")
    hub = Hub(path, str(tmp_path / "lib.so"))
    assert hub.abstract  # and its abstract socket
    hub.close()
    assert not any(t.is_alive() for t in hub._threads)  # not left blocked in accept()
    for address in (path, f"\0{hub.abstract}"):
        with socket.socket(socket.AF_UNIX) as sock, pytest.raises(ConnectionRefusedError):
            sock.connect(address)


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


# -- nothing escapes: each way a process of the command could run CUDA during another
# member's turn, against the fake driver's launch log.


@pytest.mark.parametrize("release", ["swap", "auto"])
@pytest.mark.parametrize(
    "way",
    [
        {"SWAP_PROG_FORK": "1"},  # forked without exec from a parent that never ran cuInit
        {"SWAP_PROG_CLEARENV": "1"},  # the environment cleared before cuInit
        # A child forked from the joined program that never uses CUDA: it has the driver
        # mapped, and cannot run GPU work before it joins; it must not block the release.
        {"SWAP_PROG_IDLE_CHILD": "1"},
    ],
    ids=["forked", "clearenv", "idle-child"],
)
def test_a_process_that_slips_away_is_swapped_all_the_same(
    rig: Rig, spawn: Spawn, release: str, way: dict[str, str]
) -> None:
    stop = rig.tmp / "stop"
    job = rig.run(spawn, "60", release=release, env=dict(rig.env, SWAP_PROG_STOP=str(stop), **way))
    assert read_line(job) == ["ready"]
    out, err = swap_turns(rig, spawn, job, stop, 2)  # its memory was gone, no launch ran
    assert out.split()[-2] == "done" and err == ""


def test_a_driver_opened_by_path_after_a_cu_lookup_is_hooked(rig: Rig, spawn: Spawn) -> None:
    # libc's cuserid starts as the driver's names do: looked up before the driver can be
    # loaded by name, it must not leave the driver, opened later by its path, unhooked.
    stop, driver = rig.tmp / "stop", rig.fakes.directory / "libcuda.so.1"
    job = rig.command(spawn, "env", "-u", "LD_LIBRARY_PATH", "SWAP_PROG_CUSERID=1",
                      f"SWAP_PROG_DRIVER={driver}", str(rig.fakes.program), "60",
                      env=dict(rig.env, SWAP_PROG_STOP=str(stop)))  # fmt: skip
    assert read_line(job) == ["ready"]
    _, err = swap_turns(rig, spawn, job, stop, 2)
    assert err == ""


def line_within(proc: subprocess.Popen[str], seconds: float) -> list[str]:
    """``proc``'s next line, or [] when none came within ``seconds``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return proc.stdout.readline().split() if ready else []


def test_a_stranger_on_the_socket_is_dropped(rig: Rig, spawn: Spawn) -> None:
    # Any process of the same user can reach the socket and claim to be the program; the
    # kernel says who connected, and it is no process of the command.
    stop = rig.tmp / "stop"
    job = rig.run(spawn, "60", env=dict(rig.env, SWAP_PROG_STOP=str(stop)))
    assert read_line(job) == ["ready"]
    (program,) = descendants(job.pid)
    with socket.socket(socket.AF_UNIX) as stranger:
        stranger.connect(environ(program)["VRAMLOCK_SWAP_SOCKET"])
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # dropped already
            stranger.sendall(f"hello {program}\n".encode())
        stranger.settimeout(10)
        with contextlib.suppress(ConnectionResetError):  # dropped unread
            assert stranger.recv(64) == b""  # told nothing
        holder = rig.holder(spawn)
        held = line_within(holder, 20)  # not kept waiting for the stranger's answer
        assert held[:1] == ["held"] and int(held[2]) == 0
        assert holder.stdin is not None
        holder.stdin.close()
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)


def test_a_wrapper_killed_mid_release_leaves_the_program_running_on_its_token(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    # Two processes; one does not answer (it said hello, then nothing: a stopped one
    # refuses the release before it starts), so the release waits, within its deadline,
    # with the other already swapped out, and the token still held. Killed then, the
    # run leaves the token with the command (its processes share the description): the
    # swapped one must take its memory back and run on, not block for good holding the
    # token. HUP is ignored, as under nohup, so that what is tested is the library's
    # way on, not the programs' end.
    prog, second = str(rig.fakes.program), tmp_path / "phys2"
    deaf = tmp_path / "deaf.py"
    deaf.write_text(DEAF_PEER)
    script = f"trap '' HUP; {sys.executable} {deaf} & FAKE_CUDA_PHYS={second} {prog} 60; wait"
    job = rig.command(spawn, "sh", "-c", script)
    assert sorted([read_line(job)[0], read_line(job)[0]]) == ["ready", "resident"]
    phys = {p: environ(p).get("FAKE_CUDA_PHYS") for p in descendants(job.pid)}
    programs = [p for p, path in phys.items() if path == str(second)]
    programs += [p for p in descendants(job.pid) if str(deaf) in procfs.text(p, "cmdline")]
    try:
        holder = rig.holder(spawn)  # queues: the release starts
        wait_until(lambda: int(second.read_text()) == 0)  # the running one swapped out
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        launched = len(rig.launches())
        wait_until(resumed(rig, launched))  # restored, running on
        assert int(second.read_text()) > 0
        assert not token_free(rig.arena) and line_within(holder, 0.3) == []
    finally:
        for pid in programs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert line_within(holder, 20)[:1] == ["held"]  # the token went with the command


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
