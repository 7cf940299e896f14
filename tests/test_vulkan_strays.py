"""Released, a command's Vulkan program that comes without vramlock's layer (its
environment names other layers only) is stopped before its first submit, until the
command's turn, as a CUDA program exec'd without the swap library is (run/strays.py).

The command is a shell that starts the tests' program (tests/vulkan/vk_prog.c) under the
layer, then waits for a file while the command is released, and then runs the program
again with VK_INSTANCE_LAYERS naming the witness layer alone; that one waits 300 ms before
it makes its device, as a GPU driver's start takes a while (the run's watch looks every
few tens of milliseconds: a watch, not a gate). The witness (below, next to
the driver) logs each submit, in a log of each program's own; the other member is a
process the test owns, holding the token itself.
"""

from __future__ import annotations

import time

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, kill_group, wait_until
from helpers.swap_rig import ask, read_line
from helpers.vulkan import MARKS, WORDS, Rig, built, logged, overlapping, rig

__all__ = ["built", "rig"]  # fixtures

pytestmark = MARKS

# $0: the file to wait for; $1 the program; $2 its words; $3 the first one's witness log.
COMMAND = (
    'WITNESS_LOG="$3" "$1" "$2" & '
    'while [ ! -e "$0" ]; do sleep 0.01; done; '
    'env VK_INSTANCE_LAYERS=VK_LAYER_VRAMLOCK_TEST_witness VK_PROG_START_MS=300 "$1" "$2"; '
    "wait"
)


def note(rig: Rig) -> str:
    """What ``who`` says of the command."""
    return " ".join(r["note"] or "" for r in who_json(rig.arena) if r["member"])


@pytest.mark.parametrize("release", ["swap-vulkan", "auto"])
def test_a_vulkan_program_without_the_layer_started_while_released_waits_its_turn(
    rig: Rig, spawn: Spawn, release: str
) -> None:
    go, first = rig.tmp / "go", rig.tmp / "first.log"
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release", release,
                    "--", "sh", "-c", COMMAND, str(go), str(rig.built.program), str(WORDS),
                    str(first))  # fmt: skip
    job = spawn(argv, env=rig.env("prog"))
    try:
        assert read_line(job) == ["ready"]  # the first program, under the layer
        holder = rig.holder(spawn)
        held = read_line(holder)
        assert held[0] == "held", held
        go.touch()
        wait_until(lambda: "began to use Vulkan" in note(rig))  # the second one, stopped
        time.sleep(0.5)  # were it running, it would have made its device and submitted
        seen = len(logged(first, "submit"))
        left = ask(holder, "")
        assert holder.wait(10) == 0
        assert read_line(job) == ["ready"]  # the second, continued at the command's turn
        wait_until(lambda: len(rig.lines("prog", "submit")) > 3)
        wait_until(lambda: len(logged(first, "submit")) > seen + 3)
        turn = [(int(held[1]), int(left[1]))]
        assert not overlapping(rig.lines("prog", "submit") + logged(first, "submit"), turn)
        rig.stop("prog").touch()
        out, err = job.communicate(timeout=60)
        assert job.returncode == 0 and out.split().count("ok") == 2, (out, err)
        said = [ln for ln in err.splitlines() if ln.startswith("vramlock: ")]
        stopped = [ln for ln in said if "began to use Vulkan while it is released" in ln]
        assert len(stopped) == 1 and "stopped until the command's turn" in stopped[0], err
    finally:
        kill_group(job)
