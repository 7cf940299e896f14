"""Host copies made ahead by the Vulkan layer (vramlock/gpu/vulkan/ahead.c): once the
program's allocations have stood still a second and it is idle (no call of it through
the layer for a second), a thread of the layer's own makes the host copy of each allocation
a release would move, so that the first release need not; never with
VRAMLOCK_SWAP_PREPARE=0.

The program (tests/vulkan/vk_prog.c) rests 1.5 s between rounds here (VK_PROG_REST:
by default 5 ms, never idle long enough, so that the other tests never see a copy made
ahead), and takes the device's way of copying (VRAMLOCK_VULKAN_STAGING=1 on lavapipe),
whose host copies are memory of the layer's at the driver: the witness layer (below
vramlock's, next to the driver) sees them made. Only the memory is made ahead: the
release copies the contents as before, and the program checks every word each round.
"""

from __future__ import annotations

import re
import subprocess
import time

from helpers.processes import Spawn, wait_until
from helpers.swap_rig import read_line
from helpers.vulkan import BYTES, MARKS, Rig, built, rig, submitted, take_turn

__all__ = ["built", "rig"]  # fixtures

pytestmark = MARKS

AHEAD = re.compile(r"host copy of (\d+) bytes made ahead")
RELEASED = re.compile(r"released (\d+) bytes, (\d+) of them copied out, (\d+) of host copies made")


def resting(rig: Rig, spawn: Spawn, rest_ms: int = 1500, **extra: str) -> subprocess.Popen[str]:
    """The program under swap-vulkan, resting ``rest_ms`` between rounds, its copies the
    device's way, the layer's trace on; once it is ready."""
    job = rig.run(spawn, "prog", "--min-hold", "0", "--release", "swap-vulkan",
                  VRAMLOCK_VULKAN_STAGING="1", VRAMLOCK_SWAP_DEBUG="1",
                  VK_PROG_REST=str(rest_ms), **extra)  # fmt: skip
    assert read_line(job) == ["ready"]
    return job


def turn_then_stop(rig: Rig, spawn: Spawn, job: subprocess.Popen[str]) -> str:
    """A turn of the test's member, the program run on, then stopped: it ends well, every
    word right every round. Its stderr."""
    take_turn(rig, spawn)
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 2 or job.poll() is not None)
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-1] == "ok"  # every word right, every round
    return err


def none_made(rig: Rig, spawn: Spawn, job: subprocess.Popen[str]) -> None:
    """After 3.5 s (quiet and idle long enough, where it rests 1.5 s) the program holds its
    two buffers only, and its first release makes the host copy itself."""
    time.sleep(3.5)
    assert job.poll() is None
    assert rig.held_at("prog", time.monotonic_ns()) == 2 * BYTES
    err = turn_then_stop(rig, spawn, job)
    assert "made ahead" not in err, err
    releases = [tuple(map(int, r)) for r in RELEASED.findall(err)]
    assert releases and releases[0] == (BYTES, BYTES, BYTES), err


def test_the_host_copy_is_made_while_the_program_rests(rig: Rig, spawn: Spawn) -> None:
    """Before any turn the witness sees the host copy made (the data buffer's size more
    than the program's two buffers), the layer says so, and the release makes none."""
    job = resting(rig, spawn)

    def held() -> int:
        return rig.held_at("prog", time.monotonic_ns())

    wait_until(lambda: held() == 3 * BYTES or job.poll() is not None)
    assert job.poll() is None
    before = time.monotonic_ns()
    time.sleep(0.5)  # nothing more is made
    assert rig.held_at("prog", before) == held() == 3 * BYTES
    err = turn_then_stop(rig, spawn, job)
    assert [int(n) for n in AHEAD.findall(err)] == [BYTES], err
    releases = [tuple(map(int, r)) for r in RELEASED.findall(err)]
    assert releases and releases[0] == (BYTES, BYTES, 0), err  # copied out, nothing made
    assert err.index("made ahead") < err.index("released ")


def test_none_is_made_ahead_with_swap_prepare_0(rig: Rig, spawn: Spawn) -> None:
    """VRAMLOCK_SWAP_PREPARE=0: the program holds its two buffers only until the first
    release, which makes the host copy itself."""
    none_made(rig, spawn, resting(rig, spawn, VRAMLOCK_SWAP_PREPARE="0"))


def test_none_is_made_while_the_program_never_rests_a_second(rig: Rig, spawn: Spawn) -> None:
    """Making a host copy cannot be cut short, and the program's work waits for it on a
    GPU: a program that works at least every 300 ms gets none made ahead."""
    none_made(rig, spawn, resting(rig, spawn, rest_ms=300))
