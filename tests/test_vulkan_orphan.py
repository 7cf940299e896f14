"""A Vulkan program whose ``vramlock run`` is SIGKILLed while the program is released: the
layer finds its run gone, and the program stays off the GPU for good (its GPU work held,
its data memory not made again), though nobody holds the token any more; ``who`` says so.

The program (tests/vulkan/vk_prog.c) submits every few milliseconds; the witness layer
(below vramlock's, next to the driver) logs each submit and the memory the program holds
at the driver. The other member is a process the test owns, holding the token itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from helpers.commands import who_json
from helpers.processes import Spawn, token_free, wait_until
from helpers.swap_rig import ask, read_line
from helpers.vulkan import BYTES, MARKS, Rig, built, rig, submitted

from vramlock.procfs import descendants

__all__ = ["built", "rig"]  # fixtures

pytestmark = MARKS


def test_a_wrapper_killed_while_released_leaves_the_program_off_the_gpu(
    rig: Rig, spawn: Spawn
) -> None:
    job = rig.run(spawn, "prog", "--min-hold", "0", "--release", "swap-vulkan")
    assert read_line(job) == ["ready"]
    (program,) = descendants(job.pid)
    try:
        holder = rig.holder(spawn)
        assert read_line(holder)[0] == "held"  # the program is released
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        ask(holder, "")
        assert holder.wait(10) == 0
        assert token_free(rig.arena)  # nobody holds the token, and still:
        wait_until(lambda: any(r["pid"] == program for r in who_json(rig.arena)))
        (row,) = [r for r in who_json(rig.arena) if r["pid"] == program]
        assert row["state"] == "released" and "its vramlock run is gone" in row["note"], row
        seen = submitted(rig, "prog")
        time.sleep(0.5)  # it would have submitted a hundred times
        assert submitted(rig, "prog") == seen
        assert rig.held_at("prog", time.monotonic_ns()) == BYTES  # its staging buffer only
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(program, signal.SIGKILL)


def test_a_wrapper_killed_while_resident_leaves_the_token_with_the_program(
    rig: Rig, spawn: Spawn
) -> None:
    """The program holds the token through the command's description: it runs on, and a
    waiter gets the token once the program has ended, never while it is at work."""
    job = rig.run(spawn, "prog", "--min-hold", "0", "--release", "swap-vulkan")
    assert read_line(job) == ["ready"]
    (program,) = descendants(job.pid)
    try:
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        holder = rig.holder(spawn)
        seen = submitted(rig, "prog")
        wait_until(lambda: submitted(rig, "prog") > seen + 20)  # it runs on
        assert not token_free(rig.arena)
        rig.stop("prog").touch()
        held = read_line(holder)
        assert held[0] == "held", held
        assert max(end for _, end in rig.lines("prog", "submit")) < int(held[1])
        assert job.stdout is not None and job.stdout.read().split()[-1] == "ok"  # every word
        ask(holder, "")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(program, signal.SIGKILL)
