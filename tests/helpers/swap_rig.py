"""``--release swap`` against the fake CUDA driver (tests/fake_cuda): building it, one
test's rig, and the turns of a member the test owns."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT
from helpers.commands import vramlock
from helpers.processes import Spawn, wait_until
from vramlock import procfs
from vramlock.gpu import swap

FAKES = ROOT / "tests" / "fake_cuda"
# The fake driver computes the swap library's digests with the library's own arithmetic.
SWAP_SOURCES = ROOT / "vramlock" / "gpu" / "swap"


STRICT = ("-std=c11", "-O2", "-Wall", "-Wextra", "-Werror")
# The fake libcuda.so.1's parts (they share fake_cuda.h; fake_libcuda.c says what it is).
DRIVER = ("fake_libcuda.c", "fake_memory.c", "fake_host.c", "fake_checkpoint.c")


# A member the test owns: queues as any waiter, says when it holds the token (and what
# the fake driver holds then), and lets go when told on stdin.
HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    arena, phys = sys.argv[1], sys.argv[2]
    want = os.open(os.path.join(arena, "want.lock"), os.O_RDWR | os.O_CLOEXEC)
    token = os.open(os.path.join(arena, "token.lock"), os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(want, fcntl.LOCK_SH)
    fcntl.flock(token, fcntl.LOCK_EX)
    got = time.monotonic_ns()
    print("held", got, open(phys).read().strip(), flush=True)
    sys.stdin.readline()
    print("leaving", time.monotonic_ns(), open(phys).read().strip(), flush=True)
    """
)


# A process of the command that joins the swap hub as the library would (hello, and the
# hub's answer, printed), then never reads or answers again.
DEAF_PEER = textwrap.dedent(
    """
    import os, socket, sys, time
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.environ["VRAMLOCK_SWAP_SOCKET"])
    s.sendall(f"hello {os.getpid()}\\n".encode())
    print(s.recv(100).decode().strip(), flush=True)
    time.sleep(100)
    """
)


# A user's own preload library: it wraps nanosleep through dlsym(RTLD_NEXT), which
# loops for ever if the swap library's dlsym answers RTLD_NEXT for itself.
USER_PRELOAD = textwrap.dedent(
    """
    #define _GNU_SOURCE
    #include <dlfcn.h>
    #include <stdio.h>
    #include <stdlib.h>
    #include <time.h>
    static int calls;
    int nanosleep(const struct timespec *req, struct timespec *rem)
    {
        int (*next)(const struct timespec *, struct timespec *) = dlsym(RTLD_NEXT, "nanosleep");
        calls++;
        return next(req, rem);
    }
    __attribute__((destructor)) static void done(void)
    {
        const char *path = getenv("USER_PRELOAD_OUT");
        FILE *f = path ? fopen(path, "a") : NULL;
        if (f) {
            fprintf(f, "%d\\n", calls);
            fclose(f);
        }
    }
    """
)


def swap_marks() -> list[pytest.MarkDecorator]:
    """The marks of a module that runs the fakes: a timeout, and a skip where no C
    compiler can build them."""
    return [
        pytest.mark.timeout(120),
        pytest.mark.skipif(swap.compiler() is None, reason="no C compiler to build the fakes"),
    ]


@dataclass
class Fakes:
    """The compiled fakes: the driver's directory, the programs and a user's preload
    library."""

    directory: Path  # holds libcuda.so.1
    program: Path
    user_preload: Path
    delta_program: Path  # tests/fake_cuda/delta_prog.c
    raw_exec: Path  # tests/fake_cuda/raw_exec.c: an exec the C library does not make
    # The program linked against the driver and, before it, a library whose constructor
    # takes SLOW_INIT_MS (tests/fake_cuda/slow_init.c): the dynamic linker maps the
    # driver long before the swap library's constructor runs.
    linked_program: Path
    # Holds the libcuda.so.1 that has the checkpoint API (-DFAKE_CHECKPOINT): the other
    # has none, as a driver older than 570.
    checkpoint_directory: Path


def _cc(*args: str) -> None:
    cc = swap.compiler()
    assert cc is not None
    subprocess.run([cc, *args], check=True, timeout=120)


def build_fakes(out: Path) -> Fakes:
    """Compile the fake drivers (without and with the checkpoint API), the program and a
    user's preload library into ``out``."""
    checkpoint = out / "checkpoint"
    checkpoint.mkdir()
    for directory, defines in ((out, ()), (checkpoint, ("-DFAKE_CHECKPOINT",))):
        # -Bsymbolic: the fake's table of entry points must hold its own functions, not
        # the swap library's of the same names.
        _cc(*STRICT, *defines, "-fPIC", "-shared", "-Wl,-Bsymbolic", "-I", str(SWAP_SOURCES),
            "-o", str(directory / "libcuda.so.1"), *(str(FAKES / part) for part in DRIVER),
            "-lpthread")  # fmt: skip
    _cc(*STRICT, "-o", str(out / "swap_prog"), str(FAKES / "swap_prog.c"), "-ldl", "-lpthread")
    _cc(*STRICT, "-o", str(out / "delta_prog"), str(FAKES / "delta_prog.c"), "-ldl", "-lpthread")
    _cc(*STRICT, "-o", str(out / "raw_exec"), str(FAKES / "raw_exec.c"))
    _cc(*STRICT, "-fPIC", "-shared", "-o", str(out / "libslow_init.so"),
        str(FAKES / "slow_init.c"))  # fmt: skip
    _cc(*STRICT, "-o", str(out / "swap_prog_linked"), str(FAKES / "swap_prog.c"), "-ldl",
        "-lpthread", "-Wl,--no-as-needed", "-L", str(out), "-lslow_init",
        "-l:libcuda.so.1")  # fmt: skip
    (out / "user_preload.c").write_text(USER_PRELOAD)
    _cc(*STRICT, "-fPIC", "-shared", "-o", str(out / "user_preload.so"),
        str(out / "user_preload.c"), "-ldl")  # fmt: skip
    return Fakes(out, out / "swap_prog", out / "user_preload.so", out / "delta_prog",
                 out / "raw_exec", out / "swap_prog_linked", checkpoint)  # fmt: skip


@dataclass
class Rig:
    """One test's fake GPU: the environment that selects it, and its witnesses."""

    fakes: Fakes
    arena: Path
    env: dict[str, str]
    phys: Path
    launch_log: Path
    tmp: Path

    def launches(self, what: str = "launch") -> list[tuple[int, int]]:
        """The fake driver's launches so far: (start, end) in monotonic ns; the program's
        (``launch``), or the swap library's digest kernel's (``digest``)."""
        if not self.launch_log.exists():
            return []
        text = self.launch_log.read_text()
        out = []
        # Complete lines only: a read can see the first part of a line that a launch is
        # appending (one write, but not atomic against a read where it crosses a page).
        for line in text[: text.rfind("\n") + 1].splitlines():
            kind, start, end = line.split()
            if kind == what:
                out.append((int(start), int(end)))
        return out

    def between(self, start: int, end: int, what: str = "launch") -> list[tuple[int, int]]:
        """``launches(what)`` that began from ``start`` to ``end`` (monotonic ns)."""
        return [(s, e) for s, e in self.launches(what) if start <= s <= end]

    def run(
        self, spawn: Spawn, *args: str, release: str = "swap", **kw: object
    ) -> subprocess.Popen[str]:
        """``vramlock run --release swap -- swap_prog ARGS``."""
        return self.command(spawn, str(self.fakes.program), *args, release=release, **kw)

    def command(
        self, spawn: Spawn, *command: str, release: str = "swap", **kw: object
    ) -> subprocess.Popen[str]:
        """``vramlock run --release swap -- COMMAND`` in the rig's arena (its environment
        unless ``env`` is given)."""
        kw.setdefault("env", self.env)
        return spawn(
            vramlock("run", "--arena", str(self.arena), "--min-hold", "0", "--release", release,
                     "--", *command),
            **kw,
        )  # fmt: skip

    def holder(self, spawn: Spawn) -> subprocess.Popen[str]:
        """Start the test's own member (HOLDER), talked to over its stdin."""
        script = self.tmp / "holder.py"
        script.write_text(HOLDER)
        return spawn(
            [sys.executable, str(script), str(self.arena), str(self.phys)],
            stdin=subprocess.PIPE,
        )


def make_rig(fakes: Fakes, arena: Path, tmp_path: Path) -> Rig:
    """A fake GPU for one test: the environment that selects the fake driver, and its logs."""
    phys, log = tmp_path / "phys", tmp_path / "launches"
    env = dict(os.environ)
    env.update(
        LD_LIBRARY_PATH=str(fakes.directory),
        FAKE_CUDA_PHYS=str(phys),
        FAKE_CUDA_LAUNCH_LOG=str(log),
    )
    env.pop("LD_PRELOAD", None)
    return Rig(fakes, arena, env, phys, log, tmp_path)


def swap_copies(err: str) -> list[tuple[int, int]]:
    """What each release held and copied, as the swap library traced it
    (VRAMLOCK_SWAP_DEBUG=1 on its stderr ``err``): (bytes, bytes copied)."""
    found = re.findall(r"released (\d+) bytes, copied (\d+):", err)
    return [(int(held), int(copied)) for held, copied in found]


def read_line(proc: subprocess.Popen[str]) -> list[str]:
    """The next line of ``proc``'s stdout, split into words."""
    assert proc.stdout is not None
    return proc.stdout.readline().split()


def ask(proc: subprocess.Popen[str], line: str) -> list[str]:
    """Tell ``proc`` one line on its stdin: its answer (the next line of its stdout)."""
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return read_line(proc)


def let_go(holder: subprocess.Popen[str]) -> int:
    """The test's member leaves the token: when (monotonic ns)."""
    assert holder.stdin is not None
    holder.stdin.close()
    left = read_line(holder)
    assert left[:1] == ["leaving"], left
    assert holder.wait(10) == 0
    return int(left[1])


def ran_after(rig: Rig, job: subprocess.Popen[str], left: int) -> str:
    """The command ends well, its program having launched, all of it after ``left``
    (when the test's member left the token): the run's stderr."""
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert rig.launches() and min(s for s, _ in rig.launches()) > left
    return err


@dataclass
class Turn:
    """The test's member held the token from ``start`` to ``end`` (monotonic ns)."""

    start: int
    end: int
    phys: tuple[int, int]  # the fake driver's physical memory then, at both ends


def kept_the_gpu(rig: Rig, spawn: Spawn, job: subprocess.Popen[str]) -> str:
    """``job``, a program swap refused, with a holder queued behind it: the program
    runs every round, its contents intact, and exits 0 having said one line on stderr
    (returned); the holder gets the token only once the program is done."""
    holder = rig.holder(spawn)  # queues; the command cannot let it in
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2] == "done"  # every round ran, contents intact
    lines = err.splitlines()
    assert len(lines) == 1, err  # said once
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())  # only once the command was done
    return lines[0]


def take_turn(rig: Rig, spawn: Spawn) -> Turn:
    """Queue, hold the token a moment while the command runs on, let go."""
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held", held
    time.sleep(0.2)  # the command's loop keeps trying to launch meanwhile
    assert holder.stdin is not None
    holder.stdin.write("\n")
    holder.stdin.close()
    left = read_line(holder)
    assert holder.wait(10) == 0
    return Turn(int(held[1]), int(left[1]), (int(held[2]), int(left[2])))


def during(launches: list[tuple[int, int]], turns: list[Turn]) -> list[tuple[int, int]]:
    """The launches that overlapped any of ``turns``."""
    return [(s, e) for s, e in launches for t in turns if s <= t.end and e >= t.start]


def resumed(rig: Rig, seen: int) -> Callable[[], bool]:
    """Has the program launched again since it had launched ``seen`` times?"""
    return lambda: len(rig.launches()) > seen + 20


def turns_then_stop(
    rig: Rig, spawn: Spawn, job: subprocess.Popen[str], stop: Path, rounds: int
) -> tuple[list[Turn], str, str]:
    """``rounds`` turns of the test's member while ``job`` runs (each time the program
    launches again in between), then ``stop`` ends the program, which must exit 0: the
    turns, its stdout and its stderr."""
    turns = []
    for _ in range(rounds):
        turns.append(take_turn(rig, spawn))
        wait_until(resumed(rig, len(rig.launches())))
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    return turns, out, err


def swap_turns(
    rig: Rig, spawn: Spawn, job: subprocess.Popen[str], stop: Path, rounds: int
) -> tuple[str, str]:
    """``turns_then_stop``: its stdout and stderr. Checked here too: no physical memory was
    held and no launch ran during a turn (the fake driver's own witnesses)."""
    turns, out, err = turns_then_stop(rig, spawn, job, stop, rounds)
    assert all(t.phys == (0, 0) for t in turns), turns
    assert not during(rig.launches(), turns)
    return out, err


def _driver_here() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def stopped_stray(
    job: subprocess.Popen[str], program: str, also: Callable[[int], bool] = lambda pid: True
) -> int:
    """The process of ``job`` running ``program`` (and passing ``also``), once the run's
    watch has stopped it (state T): its pid."""

    def find() -> int | None:
        for pid in procfs.descendants(job.pid):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/exe") == program and also(pid):
                    return pid
        return None

    wait_until(lambda: find() is not None)
    pid = find()
    assert pid is not None
    wait_until(lambda: procfs.state(pid) == "T")
    return pid
