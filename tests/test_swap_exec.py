"""Processes of the command that fork, exec or start while it is released, against the
fake driver of test_swap.py: the library is passed on through every exec it can be, a
program that slips past it is stopped until the command's turn, and one still starting
joins released. Witness: the fake driver's launch log against the test's own member.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, own_pid_namespace, queued, wait_until
from helpers.swap_rig import (
    Rig,
    let_go,
    ran_after,
    read_line,
    stopped_stray,
    swap_marks,
    swap_turns,
)

from vramlock.gpu import swap
from vramlock.procfs import descendants, environ, mapped, state, stopped

pytestmark = swap_marks()


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
