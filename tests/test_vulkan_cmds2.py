"""Under plain ``vramlock run`` (``auto``) the Vulkan layer hides nothing a program may need.

A Vulkan 1.3 program (tests/vulkan/vk_prog.c with VK_PROG_SYNC2=1) takes the entry
points that the layer must translate (vkCmdCopyBuffer2, vkCmdPipelineBarrier2,
vkQueueSubmit2, a descriptor update template): it is swapped, its data kept, and what
its copies write is copied out at every release. A program that enables buffer device
addresses, which the layer cannot keep, sees them and runs unswapped: its device is left
alone, and a waiter is told once why. One known to go on without them (llama.cpp's
Vulkan backend, by the name it gives Vulkan) is not shown them, and is swapped.
The witness is the tests' own layer next to the driver (helpers/vulkan.py).
"""

from __future__ import annotations

import re
import subprocess

from helpers.commands import strategy_of, who_json
from helpers.processes import Spawn, wait_until
from helpers.swap_rig import ask, read_line
from helpers.vulkan import (
    BYTES,
    HOLDER,
    MARKS,
    Rig,
    built,
    overlapping,
    rig,
    submitted,
    take_turn,
)

__all__ = ["built", "rig"]  # fixtures

pytestmark = MARKS

MIRROR = 2 * BYTES  # VK_PROG_SYNC2's mirror buffer: written by vkCmdCopyBuffer2 alone
RELEASED = re.compile(r"released (\d+) bytes, (\d+) of them copied out")


def test_a_vulkan_1_3_program_is_swapped_under_auto_its_copies_followed(
    rig: Rig, spawn: Spawn
) -> None:
    """Three turns of the test's member: no submit of the program (vkQueueSubmit2) reaches
    the driver in them, its data buffer and mirror are gone then, and every word is right
    after each (its set, written through a template, was written again with the buffers
    made again). The mirror is written by vkCmdCopyBuffer2 only: every release copies it
    out, as it does the data buffer a kernel writes."""
    job = rig.run(spawn, "prog", "--min-hold", "0", VK_PROG_SYNC2="1", VRAMLOCK_SWAP_DEBUG="1")
    assert read_line(job) == ["ready"]
    turns = []
    for _ in range(3):
        before = submitted(rig, "prog")
        wait_until(lambda: submitted(rig, "prog") > before + 3 or job.poll() is not None)  # noqa: B023
        assert job.poll() is None, job.communicate()
        turns.append(take_turn(rig, spawn))
    assert strategy_of(rig.arena) == "auto:swap-vulkan"
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3 or job.poll() is not None)
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", (out, err)
    assert not overlapping(rig.lines("prog", "submit"), turns)
    for start, end in turns:
        assert rig.held_at("prog", start) == rig.held_at("prog", end) == BYTES  # staging
    releases = [(int(a), int(b)) for a, b in RELEASED.findall(err)]
    assert len(releases) >= 3, err
    assert releases == [(BYTES + MIRROR, BYTES + MIRROR)] * len(releases), err


def test_a_program_that_enables_device_addresses_runs_unswapped_under_auto(
    rig: Rig, spawn: Spawn
) -> None:
    """It asks for bufferDeviceAddress through the 1.2 features, and exits if the device
    shows none: under auto it sees it, runs on, and is never held. A waiter is told once
    (``who`` keeps it) that it cannot be swapped, and gets the token when it exits.
    Under an explicit ``--release swap-vulkan`` the layer hides the feature, to make a
    program swappable: this one then says it has none."""
    job = rig.run(spawn, "prog", "--min-hold", "0", VK_PROG_ADDRESS="12")
    assert read_line(job) == ["ready"], job.communicate()
    holder = spawn(["python3", "-c", HOLDER, str(rig.arena)], stdin=subprocess.PIPE)
    assert job.stderr is not None
    said = job.stderr.readline()
    assert said.startswith("vramlock: ") and said.endswith("holding the GPU until it exits\n")
    assert "cannot be swapped: the program uses buffer device addresses" in said, said
    (row,) = [r for r in who_json(rig.arena) if r["member"]]
    assert row["strategy"] == "auto:none"
    assert "swap-vulkan refused" in row["note"] and "device addresses" in row["note"], row
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3)  # it runs on, never held
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", (out, err)
    assert err == ""  # said once
    held = read_line(holder)
    assert held[0] == "held" and int(held[1]) > rig.lines("prog", "submit")[-1][1]
    ask(holder, "")
    named = rig.run(spawn, "named", "--release", "swap-vulkan", VK_PROG_ADDRESS="12")
    out, err = named.communicate(timeout=60)
    assert named.returncode == 4, (out, err)
    assert err == "vk_prog: the device shows no bufferDeviceAddress\n"


def test_under_auto_addresses_are_hidden_only_from_a_program_known_to_go_without(
    rig: Rig, spawn: Spawn
) -> None:
    """A program that takes addresses where the device shows them, and goes on without
    them where not (as llama.cpp does): named ggml-vulkan (llama.cpp's name), it is shown
    none under auto and is swapped; under another name it is shown them, takes them, and
    is not swapped."""
    other = rig.run(spawn, "other", "--min-hold", "0", VK_PROG_ADDRESS="opt")
    assert read_line(other) == ["ready", "addresses"], other.communicate()
    rig.stop("other").touch()
    out, err = other.communicate(timeout=60)
    assert other.returncode == 0 and out.split()[-1] == "ok", (out, err)
    job = rig.run(
        spawn, "prog", "--min-hold", "0", VK_PROG_ADDRESS="opt", VK_PROG_APP="ggml-vulkan"
    )
    assert read_line(job) == ["ready"], job.communicate()
    before = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > before + 3)
    start, end = take_turn(rig, spawn)
    assert strategy_of(rig.arena) == "auto:swap-vulkan"
    assert rig.held_at("prog", start) == rig.held_at("prog", end) == BYTES
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", (out, err)
    assert err == ""
