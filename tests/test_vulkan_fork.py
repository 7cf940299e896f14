"""A Vulkan program that forks under ``--release swap-vulkan``: the child is a process of
its own, which the layer swaps as its own peer, and its parent's allocations are not its
to copy or free.

The program (tests/vulkan/vk_prog.c, VK_PROG_FORK=1) makes its device and an allocation
on it, then forks; the child makes a device of its own and runs as the parent does, both
checking every word of their data each round. The witness layer (below vramlock's, next
to the driver) logs each process's submits and memory apart: the child's in a log of its
own. The other member is a process the test owns, holding the token itself.
"""

from __future__ import annotations

from pathlib import Path

from helpers.processes import Spawn, wait_until
from helpers.swap_rig import read_line
from helpers.vulkan import BYTES, MARKS, Rig, built, held_at, logged, overlapping, rig, take_turn

__all__ = ["built", "rig"]  # fixtures

pytestmark = MARKS


def child_log(rig: Rig) -> Path:
    return Path(f"{rig.log('prog')}.child")


def test_a_forked_child_is_swapped_as_its_own_process(rig: Rig, spawn: Spawn) -> None:
    """No submit of the parent's or the child's reaches the driver in the test's member's
    turns, both give their data memory back then and run on with every word right; the
    child never frees what its parent had made before the fork (its copy of the
    parent's allocation is still held at the driver in each turn)."""
    job = rig.run(spawn, "prog", "--min-hold", "0", "--release", "swap-vulkan",
                  VK_PROG_FORK="1")  # fmt: skip
    assert read_line(job) == read_line(job) == ["ready"]

    def work() -> list[tuple[int, int]]:
        return rig.lines("prog", "submit") + logged(child_log(rig), "submit")

    def both_ran_since(parent: int, child: int) -> bool:
        return (
            len(rig.lines("prog", "submit")) > parent + 3
            and len(logged(child_log(rig), "submit")) > child + 3
        )

    turns = []
    for _ in range(3):
        seen = len(rig.lines("prog", "submit")), len(logged(child_log(rig), "submit"))
        wait_until(lambda: both_ran_since(*seen))  # noqa: B023
        turns.append(take_turn(rig, spawn))
    seen = len(rig.lines("prog", "submit")), len(logged(child_log(rig), "submit"))
    wait_until(lambda: both_ran_since(*seen))  # both run again after
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split().count("ok") == 2, out  # every word right, every round, in both
    assert err == ""
    assert not overlapping(work(), turns)
    for start, end in turns:
        # The parent: its staging buffer (mapped), its data and the allocation it made
        # before the fork gone.
        assert rig.held_at("prog", start) == rig.held_at("prog", end) == BYTES
        # The child: its staging buffer, and its copy of its parent's allocation, which
        # is its parent's to release (the witness counts it in the child too).
        assert held_at(child_log(rig), start) == held_at(child_log(rig), end) == 2 * BYTES
