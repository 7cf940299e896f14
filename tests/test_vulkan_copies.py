"""What a ``swap-vulkan`` release copies out: only memory written since the last restore.

The program (tests/vulkan/vk_prog.c) runs with an input buffer beside its data buffer
(VK_PROG_INPUT): its kernel either declares the input ``readonly`` (``ro``: never
written after the program filled it, so a release needs to copy it out once) or
declares it writable and adds one to each word every round (``rw``: copied out every
time). Each round the program checks every word of its data, which is right only if
both buffers kept every change across the swaps. The input is twice the data's size so
that the witness layer of the tests (below vramlock's, next to the driver) tells their
copies apart: it logs every mapping of an allocation with the allocation's size (the
CPU's way of copying: one mapping a copy, out or in) and every vkCmdCopyBuffer with its
bytes (the device's way, which VRAMLOCK_VULKAN_STAGING=1 forces on lavapipe). The
layer's own count (VRAMLOCK_SWAP_DEBUG) is checked beside it.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from helpers.processes import Spawn, wait_until
from helpers.swap_rig import read_line
from helpers.vulkan import BYTES, MARKS, Rig, built, rig, submitted, take_turn

__all__ = ["built", "rig"]  # fixtures

pytestmark = MARKS

TURNS = 4
INPUT = 2 * BYTES  # the input buffer's allocation
RELEASED = re.compile(r"released (\d+) bytes, (\d+) of them copied out")


def swapped(rig: Rig, spawn: Spawn, mode: str, staged: bool) -> list[tuple[int, int]]:
    """The program with its input (``mode``) through TURNS turns of the test's member,
    then stopped: it ends well, every word right every round. What each release freed
    and copied, as the layer says."""
    extra = {"VK_PROG_INPUT": mode, "VRAMLOCK_SWAP_DEBUG": "1"}
    if staged:
        extra["VRAMLOCK_VULKAN_STAGING"] = "1"
    job = rig.run(spawn, "prog", "--min-hold", "0", "--release", "swap-vulkan", **extra)
    assert read_line(job) == ["ready"]
    for _ in range(TURNS):
        before = submitted(rig, "prog")
        # it runs again (or ended: a wrong word, said below)
        wait_until(lambda: submitted(rig, "prog") > before + 3 or job.poll() is not None)  # noqa: B023
        assert job.poll() is None, job.communicate()
        take_turn(rig, spawn)
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3 or job.poll() is not None)
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-1] == "ok"  # every word right, every round
    releases = [(int(a), int(b)) for a, b in RELEASED.findall(err)]
    assert len(releases) >= TURNS, err  # one a turn, and any vramlock run makes beside
    assert err.count("restored, ") == len(releases), err
    return releases


def input_copies(rig: Rig, staged: bool) -> int:
    """The copies of the input's allocation the witness saw, out and in: mappings of it
    (the CPU's way), or copies of its size (the device's way; the program's own copies
    are of the data's size, and its input filled by two of those)."""
    return len([b for _, b in rig.lines("prog", "copy" if staged else "map") if b == INPUT])


@pytest.mark.parametrize("staged", [False, True], ids=["mapped", "staged"])
def test_a_buffer_only_read_is_copied_out_once(rig: Rig, spawn: Spawn, staged: bool) -> None:
    """The kernel declares its input readonly: the first release copies both buffers,
    the next ones the data buffer only; every restore copies both back in."""
    releases = swapped(rig, spawn, "ro", staged)
    freed = BYTES + INPUT
    assert releases == [(freed, freed)] + [(freed, BYTES)] * (len(releases) - 1)
    assert input_copies(rig, staged) == 1 + len(releases)  # out once, in every restore


@pytest.mark.parametrize("staged", [False, True], ids=["mapped", "staged"])
def test_a_buffer_a_kernel_may_write_is_copied_out_every_time(
    rig: Rig, spawn: Spawn, staged: bool
) -> None:
    """The kernel does not declare its input readonly (and writes it): every release
    copies it out. Were it skipped, the restore would bring back an input of an older
    round, and the program's check would fail."""
    releases = swapped(rig, spawn, "rw", staged)
    freed = BYTES + INPUT
    assert releases == [(freed, freed)] * len(releases)
    assert input_copies(rig, staged) == 2 * len(releases)


def test_the_programs_own_copies_are_seen_by_the_witness(rig: Rig) -> None:
    """The baseline of the count above, without vramlock: the program's own copies never
    have the input's size, nor does it map the input."""
    env = rig.env("prog", VK_PROG_INPUT="rw", VK_PROG_STOP="/")
    done = subprocess.run([str(rig.built.program), str(BYTES // 4)], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert input_copies(rig, True) == input_copies(rig, False) == 0
    assert [b for _, b in rig.lines("prog", "copy")] == [BYTES] * 4  # 2 fills, data, a round
