"""``vramlock stats --prometheus``: the textfile collector's format, read back with
prometheus_client's own parser."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock
from helpers.journal import T0, ev, handoff
from helpers.processes import Spawn, wait_until

from vramlock.arena.budget import Budget
from vramlock.arena.roster import BudgetView, Row
from vramlock.observe.prometheus import BUCKETS, families, render, text
from vramlock.observe.stats import compute

parser = pytest.importorskip(
    "prometheus_client.parser", reason="the test extra's prometheus-client"
)

FAKE_NVML = str(Path(__file__).parent / "fake_nvml")


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(family: Any, **labels: str) -> float:
    found = [s.value for s in family.samples if labels.items() <= s.labels.items()]
    assert len(found) == 1, (labels, family.samples)
    return float(found[0])


def _row(pid: int, name: str, state: str, vram: int | None = None) -> Row:
    return Row(pid=pid, state=state, name=name, command=name, strategy="swap", since=None,
               child_pid=None, member=True, vram=vram)  # fmt: skip


def test_every_metric_parses_with_its_type_and_value() -> None:
    events = [ev(0, 1, "acquire"), *handoff(10, 1, 2, 0.5, 1.0), *handoff(20, 2, 1, 3.0, 1.0)]
    events.insert(3, ev(10.2, 1, "moved")._replace(bytes=6 << 30))
    report = compute(events, now=T0 + 30)
    rows = [_row(1, 'tr"ainer', "resident", 5 << 30), _row(2, "llama", "waiting", 0)]
    budget = BudgetView(budget=Budget(unit=1 << 30, units=12), held=6)
    text = render("/arena\\0", rows, report, budget)
    fams = _families(text)
    state = fams["vramlock_member_state"]
    assert _value(state, member='tr"ainer', vramlock_member_state="resident") == 1
    assert _value(state, member='tr"ainer', vramlock_member_state="waiting") == 0
    assert _value(state, member="llama", vramlock_member_state="waiting") == 1
    assert {s.labels["arena"] for s in state.samples} == {"/arena\\0"}
    assert _value(fams["vramlock_waiters"]) == 1
    vram = fams["vramlock_member_vram_bytes"]
    assert vram.type == "gauge" and _value(vram, member='tr"ainer') == 5 << 30
    hist = fams["vramlock_handoff_seconds"]
    assert hist.type == "histogram"
    assert _value(hist, strategy="swap", le="+Inf") == 2
    assert _value(hist, strategy="swap", le="1.0") == 1
    assert len([s for s in hist.samples if s.name.endswith("_bucket")]) == len(BUCKETS) + 1
    assert [x.value for x in hist.samples if x.name.endswith("_sum")] == [3.5]
    swapped = fams["vramlock_swapped_bytes"]
    assert swapped.type == "counter"
    assert _value(swapped, member="m1", direction="out") == 6 << 30
    assert _value(swapped, member="m1", direction="in") == 6 << 30  # restored at 20
    assert _value(fams["vramlock_handoffs"]) == 2
    assert _value(fams["vramlock_budget_units"]) == 12
    assert _value(fams["vramlock_budget_units_held"]) == 6
    assert _value(fams["vramlock_budget_unit_bytes"]) == 1 << 30
    assert all(name.startswith("vramlock_") for name in fams)


def test_several_arenas_are_one_exposition_each_family_once() -> None:
    """serve's /metrics: two arenas' families under one HELP and TYPE each, every sample
    labelled with its arena (the text format wants each family once)."""
    report = compute([ev(0, 1, "acquire"), *handoff(10, 1, 2, 0.5, 1.0)], now=T0 + 30)
    one = families("/a", [_row(1, "x", "resident")], report, None)
    two = families("/b", [_row(2, "y", "waiting")], report, None)
    exposition = text([*one, *two])
    assert exposition.count("# TYPE vramlock_member_state ") == 1
    fams = _families(exposition)
    state = fams["vramlock_member_state"]
    assert _value(state, arena="/a", member="x", vramlock_member_state="resident") == 1
    assert _value(state, arena="/b", member="y", vramlock_member_state="waiting") == 1
    assert _value(fams["vramlock_handoffs"], arena="/a") == 1
    assert _value(fams["vramlock_handoffs"], arena="/b") == 1


HOLDER = textwrap.dedent(
    """
    import sys
    import vramlock
    with vramlock.resident(sys.argv[1], name="holder"):
        print("resident", flush=True)
        sys.stdin.read()
    """
)


def test_the_textfile_of_a_live_arena(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml"
    nvml.mkdir()
    holder = spawn([sys.executable, "-c", HOLDER, str(arena)], stdin=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == "resident\n"
    (nvml / str(holder.pid)).write_text(str(3 << 30))
    env = {**os.environ, "FAKE_NVML_DIR": str(nvml),
           "PYTHONPATH": f"{FAKE_NVML}{os.pathsep}{os.environ['PYTHONPATH']}"}  # fmt: skip
    out = tmp_path / "textfile" / "vramlock.prom"
    out.parent.mkdir()
    out.write_text("old\n")
    journal = arena / "journal" / f"{os.geteuid()}.jsonl"
    wait_until(lambda: journal.exists() and b'"acquire"' in journal.read_bytes())
    before = journal.read_bytes()
    done = subprocess.run(vramlock("stats", "--arena", str(arena), "--prometheus", str(out)),
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    fams = _families(out.read_text())
    state = fams["vramlock_member_state"]
    assert _value(state, member="holder", vramlock_member_state="resident") == 1
    assert _value(fams["vramlock_member_vram_bytes"], member="holder") == 3 << 30
    assert _value(fams["vramlock_gpu_memory_bytes"], gpu="0") == 80 << 30
    assert sorted(p.name for p in out.parent.iterdir()) == ["vramlock.prom"]  # no temp file
    # A scrape is never activity: nothing journalled, the holder still resident.
    assert journal.read_bytes() == before
    assert holder.poll() is None


def test_an_unwritable_textfile_is_a_usage_error(arena: Path, tmp_path: Path) -> None:
    target = tmp_path / "missing" / "vramlock.prom"
    done = subprocess.run(vramlock("stats", "--arena", str(arena), "--prometheus", str(target)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        f"vramlock: --prometheus: cannot write {str(target)!r}: No such file or directory\n"
    )


def test_prometheus_dash_is_standard_output(arena: Path, tmp_path: Path) -> None:
    done = subprocess.run(vramlock("stats", "--arena", str(arena), "--prometheus", "-"),
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert "vramlock_waiters" in _families(done.stdout)
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_prometheus_writes_only_a_regular_file(arena: Path, tmp_path: Path, kind: str) -> None:
    """A link (``/dev/stdout`` is one) is never replaced by a plain file, nor is anything
    else that is not a regular file."""
    (tmp_path / "out").mkdir()
    target, real = tmp_path / "out" / "metrics.prom", tmp_path / "out" / "real"
    real.write_text("kept\n")
    if kind == "symlink":
        target.symlink_to(real)
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    done = subprocess.run(vramlock("stats", "--arena", str(arena), "--prometheus", str(target)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    what = {"symlink": "a symbolic link", "fifo": "a FIFO", "directory": "a directory"}[kind]
    assert done.returncode == 2
    assert done.stderr == (
        f"vramlock: --prometheus: {str(target)!r} is {what}, not a regular file"
        " (name a file, or - for standard output)\n"
    )
    assert target.is_symlink() if kind == "symlink" else not target.is_file()
    assert real.read_text() == "kept\n"
    assert sorted(p.name for p in real.parent.iterdir()) == ["metrics.prom", "real"]
