"""Measured footprints in a budget arena: NVML's peak for a member's command at its last
residency, plus a margin, is what it asks for at its next admission.

NVML is the stand-in of ``tests/fake_nvml``: each command writes the bytes it "uses" to
a file named after its pid, and writes 0 before it says it released. The witness is the
test's own file, as in test_budget.py: a command takes one byte of it (an OFD write
lock) per unit of memory it really uses, among as many bytes as the budget has units,
and says "OVER" when it cannot get them all: members whose real use went past the
budget together.
"""

from __future__ import annotations

import os
import select
import signal
import time
from pathlib import Path

import pytest
from helpers.budget import DEADLINE, Budgeted, Member, run_measured
from helpers.commands import who_json, who_plain
from helpers.processes import Spawn, wait_until
from helpers.worker import events

from vramlock.arena.budget import UNIT
from vramlock.arena.footprint import DECLARED, MEASURED, WHOLE, after_residency, with_margin

GIB = 1 << 30


@pytest.fixture
def room(spawn: Spawn, arena: Path, tmp_path: Path) -> Budgeted:
    return Budgeted(spawn, arena, tmp_path, "3G")  # 12 units


def _footprints(room: Budgeted) -> dict[str, tuple[int, str]]:
    return {r["name"]: (r["footprint"], r["footprint_from"]) for r in who_json(room.arena)}


def _next_line(member: Member, timeout: float = DEADLINE) -> str:
    """The next line the member's ``vramlock run`` writes on stderr, within ``timeout``."""
    assert member.proc.stderr is not None
    ready, _, _ = select.select([member.proc.stderr], [], [], timeout)
    assert ready, f"{member.name} said nothing on stderr within {timeout} s"
    return member.proc.stderr.readline()


def _stderr_after_sigterm(member: Member) -> str:
    os.kill(member.proc.pid, signal.SIGTERM)
    member.proc.wait(30)
    assert member.proc.stderr is not None
    return member.proc.stderr.read()


def test_after_residency_keeps_a_declared_footprint_until_the_use_passes_it() -> None:
    assert with_margin(10 * GIB, UNIT) == 11 * GIB  # 10 %
    assert with_margin(GIB, UNIT) == GIB + UNIT  # at least a unit
    total = 3 * GIB
    assert after_residency(None, GIB, UNIT, total).source == MEASURED
    assert after_residency(None, GIB, UNIT, total).size == GIB + UNIT
    assert after_residency(2 * GIB, GIB, UNIT, total).size == 2 * GIB  # within: declared
    assert after_residency(2 * GIB, GIB, UNIT, total).source == DECLARED
    assert after_residency(GIB, 2 * GIB, UNIT, total).size == 2 * GIB + UNIT  # past it
    assert after_residency(None, 3 * GIB, UNIT, total).size == total  # never past the budget


def test_run_without_vram_takes_the_budget_then_its_measured_footprint(room: Budgeted) -> None:
    m = run_measured(room, "m", GIB)
    m.wait_for("resident")
    wait_until(lambda: room.capacity_bytes_held() == room.units)  # nothing measured yet
    assert _footprints(room)["m"] == (3 * GIB, WHOLE)
    b = run_measured(room, "b", GIB, vram="1G")
    b.wait_for("resident")
    m.wait_for("release")
    # Measured at its release: 1G and a unit of margin, 5 units beside b's 4.
    m.wait_for("resident", 2)
    wait_until(lambda: room.resident() == {"m", "b"})
    assert room.capacity_bytes_held() == 9
    assert _footprints(room) == {"m": (GIB + UNIT, MEASURED), "b": (GIB, DECLARED)}
    out = who_plain(room.arena)
    assert "footprint 1.25G measured, 5 unit(s)" in out
    assert "footprint 1G, 4 unit(s)" in out
    assert room.over() == []
    said = _stderr_after_sigterm(m)
    assert "without --vram this command takes the whole budget until its footprint is measured" in (
        said
    )


def test_who_shows_a_run_from_its_join_while_nvml_wakes_up(room: Budgeted) -> None:
    """The record is on disk before anything slow: a member whose footprint is to be
    measured waits for NVML's first call, and who shows it meanwhile."""
    gate = room.log.parent / "nvml-init"
    os.mkfifo(gate)
    m = run_measured(room, "slow", GIB, FAKE_NVML_INIT_GATE=str(gate))
    wait_until(lambda: [r["name"] for r in who_json(room.arena)] == ["slow"], timeout=DEADLINE)
    assert room.count("slow", "resident") == 0  # still in NVML's first call
    os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))  # NVML is awake
    m.wait_for("resident")


def test_run_that_outgrows_its_units_takes_free_ones(room: Budgeted) -> None:
    m = run_measured(room, "m", 2 * GIB, vram="1G")
    m.wait_for("resident")
    wait_until(lambda: room.capacity_bytes_held() == 8)  # 2G, not the 1G declared
    b = run_measured(room, "b", GIB, vram="1G")
    b.wait_for("resident")  # fits in the last 4
    c = run_measured(room, "c", GIB, vram="1G")
    c.wait_for("resident")  # somebody had to step aside for it
    assert room.count("m", "release") + room.count("b", "release") >= 1
    assert room.over() == []
    assert "uses" not in _stderr_after_sigterm(m)  # covered: nothing to say


def test_run_that_outgrows_its_units_when_none_are_free_steps_aside_at_once(
    room: Budgeted,
) -> None:
    a = run_measured(room, "a", 2 * GIB, vram="2G")
    a.wait_for("resident")
    m = run_measured(room, "m", 2 * GIB, vram="1G")  # takes the 4 free units, needs 8
    m.wait_for("OVER")  # the risk: until it releases, more is in use than the budget
    assert _next_line(m) == (
        "vramlock: m uses 2G, more than its footprint of 1G, and too few units of the budget"
        " are free; it steps aside and asks for 2.25G at its next admission\n"
    )
    m.wait_for("release")  # by itself: nobody waits for the GPU
    stepped_aside = time.monotonic()
    assert _footprints(room)["m"] == (2 * GIB + UNIT, MEASURED)
    # 8 + 9 units do not fit in 12: they take turns from now on, never over the budget.
    for member in (a, m):
        member.wait_for("resident", 3, timeout=DEADLINE)
    assert [t for t, _, w in events(room.log) if w == "OVER" and t > stepped_aside] == []
    assert " uses " not in _stderr_after_sigterm(m)  # once, and its units cover it since


def test_a_residency_where_nvml_sees_nothing_keeps_the_whole_budget(room: Budgeted) -> None:
    # As where NVML's pids name nobody here (a container): 0 is not a measurement.
    m = run_measured(room, "m", 0)
    m.wait_for("resident")
    b = run_measured(room, "b", GIB, vram="1G")
    b.wait_for("resident")
    m.wait_for("release")
    wait_until(lambda: room.count("m", "resident") == 2 or room.count("b", "release") == 1)
    assert _footprints(room)["m"] == (3 * GIB, WHOLE)
    assert "m" not in room.resident() or "b" not in room.resident()
