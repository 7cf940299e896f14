"""An arena as Prometheus metrics, in the text format node_exporter's textfile collector
reads (and a ``/metrics`` endpoint can serve).

The present comes from the kernel's lock state and the records (as ``vramlock who``
sees it), the past from the journal (``stats``). Nothing here takes a lock or writes
to the arena: a scrape is never activity.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..arena import journal
from ..arena.directory import Arena
from ..arena.roster import BudgetView, GpuView, Row, budget_view, gpu_view, snapshot, with_vram
from .stats import Report, compute

# The states of the ``vramlock_member_state`` stateset (one sample each, 1 for the member's).
STATES = ("resident", "releasing", "waiting", "restoring", "released")
# Handoff (release) durations: from a signal's milliseconds to a checkpoint's minute.
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


@dataclass
class Family:
    """One metric: its name, type, help line and samples (name, labels, value)."""

    name: str
    kind: str
    help: str
    samples: Sequence[tuple[str, list[tuple[str, str]], float]]

    def text(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{n}{_labels(ls)} {_number(v)}" for n, ls, v in self.samples]
        return "\n".join(lines)


def _histogram(
    name: str, help_text: str, by: dict[str, list[float]], base: list[tuple[str, str]]
) -> Family:
    samples: list[tuple[str, list[tuple[str, str]], float]] = []
    for strategy, values in sorted(by.items()):
        labels = [*base, ("strategy", strategy)]
        for bound in BUCKETS:
            count = sum(1 for v in values if v <= bound)
            samples.append((f"{name}_bucket", [*labels, ("le", repr(bound))], count))
        samples.append((f"{name}_bucket", [*labels, ("le", "+Inf")], len(values)))
        samples.append((f"{name}_sum", labels, float(sum(values))))
        samples.append((f"{name}_count", labels, len(values)))
    return Family(name, "histogram", help_text, samples)


def waiters(rows: Sequence[Row]) -> int:
    """How many of ``rows`` wait for the GPU."""
    return sum(1 for r in rows if r.state == "waiting")


def _member(row: Row) -> list[tuple[str, str]]:
    return [("member", row.name), ("pid", str(row.pid))]


def _present(rows: Sequence[Row], base: list[tuple[str, str]]) -> list[Family]:
    members = [r for r in rows if r.state != "foreign"]
    states = [
        (
            "vramlock_member_state",
            [*base, *_member(r), ("vramlock_member_state", s)],
            float(r.state == s),
        )
        for r in members
        for s in STATES
    ]
    vram = [("vramlock_member_vram_bytes", [*base, *_member(r)], r.vram)
            for r in members if r.vram is not None]  # fmt: skip
    waiting = waiters(members)
    return [
        Family("vramlock_member_state", "gauge",
                "The member's state now (an OpenMetrics stateset: 1 for its state).", states),
        Family("vramlock_waiters", "gauge", "Members waiting for the GPU now.",
                [("vramlock_waiters", base, waiting)]),
        Family("vramlock_member_vram_bytes", "gauge",
                "GPU memory held by the member and its processes (NVML).", vram),
    ]  # fmt: skip


def _past(report: Report, base: list[tuple[str, str]]) -> list[Family]:
    moved = []
    for m in report.members:
        who = [("member", m.name), ("pid", str(m.pid))]
        moved.append(("vramlock_swapped_bytes_total", [*base, *who, ("direction", "out")],
                      m.bytes_out))  # fmt: skip
        moved.append(("vramlock_swapped_bytes_total", [*base, *who, ("direction", "in")],
                      m.bytes_in))  # fmt: skip
    resident = [("vramlock_member_resident_seconds_total",
                 [*base, ("member", m.name), ("pid", str(m.pid))], m.resident)
                for m in report.members]  # fmt: skip
    return [
        _histogram("vramlock_handoff_seconds",
                   "How long releases took, by strategy (from the journal).",
                   report.release_by_strategy, base),
        Family("vramlock_handoffs_total", "counter", "Releases journalled.",
                [("vramlock_handoffs_total", base, report.handoffs)]),
        Family("vramlock_swapped_bytes_total", "counter",
                "Bytes releases moved off the GPU (out) and restores back (in).", moved),
        Family("vramlock_member_resident_seconds_total", "counter",
                "Seconds the member held the GPU (from the journal).", resident),
    ]  # fmt: skip


def _budget(view: BudgetView | None, base: list[tuple[str, str]]) -> list[Family]:
    if view is None:
        return []
    return [
        Family("vramlock_budget_units", "gauge", "Units of the arena's VRAM budget.",
                [("vramlock_budget_units", base, view.budget.units)]),
        Family("vramlock_budget_units_held", "gauge", "Units of the budget held now.",
                [("vramlock_budget_units_held", base, view.held)]),
        Family("vramlock_budget_unit_bytes", "gauge", "Bytes one unit of the budget stands for.",
                [("vramlock_budget_unit_bytes", base, view.budget.unit)]),
    ]  # fmt: skip


def families(
    path: str,
    rows: Sequence[Row],
    report: Report,
    budget: BudgetView | None,
    gpus: GpuView | None = None,
) -> list[Family]:
    """The metric families of one arena (``path``, a label of every sample)."""
    base = [("arena", path)]
    found = [*_present(rows, base), *_past(report, base), *_budget(budget, base)]
    if gpus is not None:
        total = [("vramlock_gpu_memory_bytes", [*base, ("gpu", str(g.index))], g.total)
                 for g in gpus.gpus]  # fmt: skip
        found.append(Family("vramlock_gpu_memory_bytes", "gauge",
                            "The GPU's memory (NVML).", total))  # fmt: skip
    return found


def text(found: Iterable[Family]) -> str:
    """``found`` in the text format: the samples of families of one name (several
    arenas') under one HELP and TYPE, as the format wants each family once."""
    merged: dict[str, Family] = {}
    for f in found:
        if f.name in merged:
            was = merged[f.name]
            merged[f.name] = Family(f.name, f.kind, f.help, [*was.samples, *f.samples])
        else:
            merged[f.name] = f
    return "\n".join(f.text() for f in merged.values() if f.samples) + "\n"


def render(
    path: str,
    rows: Sequence[Row],
    report: Report,
    budget: BudgetView | None,
    gpus: GpuView | None = None,
) -> str:
    """The metrics of one arena (``path``, a label of every sample) in the text format."""
    return text(families(path, rows, report, budget, gpus))


def arena_families(arena: Arena, gpu: int | None) -> list[Family]:
    """The arena's metric families now: its members (with VRAM where NVML works, for GPU
    ``gpu``, None: every GPU), its journal and its budget."""
    rows = snapshot(arena)
    view = gpu_view(gpu)
    if view is not None:
        rows = with_vram(rows, view)
    report = compute(journal.read(arena))
    return families(arena.path, rows, report, budget_view(arena), view)


def metrics(arena: Arena, gpu: int | None) -> str:
    """The arena's metrics now, in the text format (``arena_families``)."""
    return text(arena_families(arena, gpu))


class NotRegular(ValueError):
    """The path names something other than a regular file: a link (``/dev/stdout`` is
    one), a directory, a FIFO, a device or a socket, which a textfile never replaces."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path!r} is {what}, not a regular file")
        self.path = path
        self.what = what


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_regular(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return  # made here
    for test, what in _KINDS:
        if test(mode):
            raise NotRegular(path, what)
    if not stat.S_ISREG(mode):
        raise NotRegular(path, "not a file")


def write_textfile(path: str, text: str) -> None:
    """Replace ``path`` atomically (a new file in its directory, renamed over it): the
    collector never reads half a file. Only a regular file (or none) is replaced:
    NotRegular for anything else, checked before and again just before the rename;
    OSError when it cannot be written."""
    _check_regular(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        _check_regular(path)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
