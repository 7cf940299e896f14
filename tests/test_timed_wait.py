"""A timed wait (``-w``) ends with ``-E``'s status every time, whenever its alarm falls.

The alarm (SIGALRM) that cuts a blocked flock may fall anywhere: before the wait has
begun, inside the lock layer's code, as the lock is granted, in an ``except`` block.
Thousands of tiny timeouts in one process find every such place; many short
``vramlock run -w`` and ``vramlock wait -w`` end to end check the exit status and the
one line on stderr. The witness that the token stays held is the test's own lock.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.errors import holding_token, still_held_by_us

pytestmark = pytest.mark.timeout(120)

TRIES = 4000

# Waits on the token the test holds, each with a timeout of 5 us .. 0.4 ms, alternating
# with want.lock taken shared (granted at once): every one must return, False on the
# token, True on want.lock.
_MANY_WAITS = textwrap.dedent(
    """
    import os, random, sys
    from vramlock.arena import lockfd
    token = os.open(sys.argv[1], os.O_RDONLY | os.O_CLOEXEC)
    want = os.open(sys.argv[2], os.O_RDONLY | os.O_CLOEXEC)
    rng = random.Random(int(sys.argv[4]))
    for _ in range(int(sys.argv[3])):
        if lockfd.lock_within(want, exclusive=False, timeout=rng.uniform(5e-6, 4e-4)) is not True:
            sys.exit("want.lock, free, was not obtained")
        if lockfd.lock_within(token, exclusive=True, timeout=rng.uniform(5e-6, 4e-4)) is not False:
            sys.exit("the token, held, was obtained")
        lockfd.unlock(want)
    print("done")
    """
)


def test_thousands_of_tiny_timed_waits_all_end(arena: Path) -> None:
    """Each ended before: it hung for good where the alarm fell before the wait began or
    inside the flag that arms it, and an internal exception escaped where it fell inside
    an ``except`` block."""
    (arena / "want.lock").touch(mode=0o600)
    with holding_token(arena):
        proc = subprocess.run(
            [sys.executable, "-c", _MANY_WAITS, str(arena / "token.lock"),
             str(arena / "want.lock"), str(TRIES), "33"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "done\n", "")
        assert still_held_by_us(arena / "token.lock")


RUNS = 150
AT_ONCE = 8
REAL = 6  # of them, run as commands of their own; the others forked from one interpreter

# Runs each command line of argv[1] (JSON: [[timeout, argv], ...]) AT_ONCE at a time as
# ``vramlock`` would, but forked from one interpreter that imported vramlock already: a
# fresh interpreter's start (~0.4 s of CPU each) is all that is left out. Prints, per
# command, its timeout, exit status and stderr (JSON).
_FORKED = textwrap.dedent(
    """
    import json, os, sys, traceback
    import vramlock.start, vramlock.cli, vramlock.cli.fast, vramlock.cli.run, vramlock.cli.wait
    import vramlock.run.runner, vramlock.arena.waiter
    commands, at_once = json.loads(sys.argv[1]), int(sys.argv[2])

    def start(argv):
        r, w = os.pipe()
        pid = os.fork()
        if pid:
            os.close(w)
            return pid, r
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0), os.dup2(null, 1), os.dup2(w, 2)
        sys.argv = ["vramlock", *argv]
        code = 1
        try:
            vramlock.start.main()
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else 1
        except BaseException:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(code)

    def finish(pid, r):
        err = b""
        while chunk := os.read(r, 65536):
            err += chunk
        os.close(r)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err.decode()

    out = []
    for i in range(0, len(commands), at_once):
        batch = [(w, start(argv)) for w, argv in commands[i : i + at_once]]
        out += [(w, *finish(*proc)) for w, proc in batch]
    print(json.dumps(out))
    """
)


def _timed_commands(arena: Path) -> list[tuple[str, list[str]]]:
    """(timeout, vramlock's arguments) for RUNS timed waits."""
    rng = random.Random(7)
    commands = []
    for i in range(RUNS):
        w = f"{rng.randint(1, 40) / 1000:g}"
        if i % 3 == 2:
            commands.append((w, ["wait", "-w", w, "-E", "7", "--arena", str(arena)]))
        else:
            commands.append((w, ["run", "-w", w, "-E", "7", "--arena", str(arena), "--", "true"]))
    return commands


def _real(commands: list[tuple[str, list[str]]]) -> list[tuple[str, int, str]]:
    """Each command as a ``vramlock`` of its own, AT_ONCE at a time."""
    outcomes: list[tuple[str, int, str]] = []
    for start in range(0, len(commands), AT_ONCE):
        batch = [
            (w, subprocess.Popen(vramlock(*argv), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
            for w, argv in commands[start : start + AT_ONCE]
        ]  # fmt: skip
        for w, proc in batch:
            _, err = proc.communicate(timeout=30)
            outcomes.append((w, proc.returncode, err))
    return outcomes


def _forked(commands: list[tuple[str, list[str]]]) -> list[tuple[str, int, str]]:
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED, json.dumps(commands), str(AT_ONCE)],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return [(w, code, err) for w, code, err in json.loads(proc.stdout)]


def test_timed_run_and_wait_end_with_the_E_status_every_time(arena: Path) -> None:
    """150 ``run -w`` / ``wait -w`` of 1-40 ms against a held token: status 7 and one
    line each time (2 in 150 ended with a traceback and status 1). A few run as commands
    of their own, the rest forked from one interpreter (2 min of wall time otherwise on
    a loaded 2-core machine: each interpreter's start costs ~0.4 s of CPU)."""
    commands = _timed_commands(arena)
    with holding_token(arena):
        outcomes = _real(commands[:REAL]) + _forked(commands[REAL:])
        assert still_held_by_us(arena / "token.lock")
    assert len(outcomes) == RUNS
    wrong = [
        (w, code, err)
        for w, code, err in outcomes
        if code != 7 or err != f"vramlock: token not obtained within {w} s\n"
    ]
    assert not wrong, f"{len(wrong)} of {RUNS} ended otherwise: {wrong[:3]}"
