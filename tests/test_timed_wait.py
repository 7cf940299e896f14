"""A timed wait (``-w``) ends with ``-E``'s status every time, whenever its alarm falls.

The alarm (SIGALRM) that cuts a blocked flock may fall anywhere: before the wait has
begun, inside the lock layer's code, as the lock is granted, in an ``except`` block.
Thousands of tiny timeouts in one process find every such place; many short
``vramlock run -w`` and ``vramlock wait -w`` end to end check the exit status and the
one line on stderr. The witness that the token stays held is the test's own lock.
"""

from __future__ import annotations

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


def _timed_commands(arena: Path) -> list[tuple[str, list[str]]]:
    rng = random.Random(7)
    commands = []
    for i in range(RUNS):
        w = f"{rng.randint(1, 40) / 1000:g}"
        if i % 3 == 2:
            commands.append((w, vramlock("wait", "-w", w, "-E", "7", "--arena", str(arena))))
        else:
            args = ["run", "-w", w, "-E", "7", "--arena", str(arena), "--", "true"]
            commands.append((w, vramlock(*args)))
    return commands


def test_timed_run_and_wait_end_with_the_E_status_every_time(arena: Path) -> None:
    """150 ``run -w`` / ``wait -w`` of 1-40 ms against a held token: status 7 and one
    line each time (2 in 150 ended with a traceback and status 1)."""
    commands = _timed_commands(arena)
    outcomes: list[tuple[str, int, str]] = []
    with holding_token(arena):
        for start in range(0, len(commands), AT_ONCE):
            batch = [
                (w, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True))
                for w, argv in commands[start : start + AT_ONCE]
            ]  # fmt: skip
            for w, proc in batch:
                _, err = proc.communicate(timeout=30)
                outcomes.append((w, proc.returncode, err))
        assert still_held_by_us(arena / "token.lock")
    wrong = [
        (w, code, err)
        for w, code, err in outcomes
        if code != 7 or err != f"vramlock: token not obtained within {w} s\n"
    ]
    assert not wrong, f"{len(wrong)} of {RUNS} ended otherwise: {wrong[:3]}"
