"""A budget member's footprint: declared (``--vram``), or measured with NVML.

A member of a budget arena that declares no footprint is admitted with the whole budget
until something is measured; from then on NVML's peak for its command's processes during
its last residency, plus a margin, is its footprint at its next admission. A member that
uses more than its units while resident takes free units at once, and where too few are
free it is told so (once a residency), steps aside at once, and asks for what it used at
its next admission.
docs/protocol.md, "The budget", says what this promises and what it risks.

Sampling is cheap: one NVML process query (about 25 µs on an H200 host) and, for the
few pids NVML lists, a check that they are the command's; every ``SAMPLE_INTERVAL``
while resident, and once just before each release.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..gpu import nvml

# What a measured peak is given on top: allocators grow in steps, and a peak sampled
# every half second misses short spikes. 10 %, and never less than one budget unit.
MARGIN_FRACTION = 0.10
SAMPLE_INTERVAL = 0.5

# Where a footprint comes from, as records and ``who`` say it.
DECLARED = "declared"
MEASURED = "measured"
WHOLE = "whole budget"  # nothing measured yet


def with_margin(peak: int, unit: int) -> int:
    """A measured peak plus the margin."""
    return peak + max(math.ceil(peak * MARGIN_FRACTION), unit)


@dataclass(frozen=True)
class Footprint:
    """What a member asks for at an admission: ``size`` bytes, from ``source``."""

    size: int
    source: str


def after_residency(declared: int | None, peak: int, unit: int, total: int) -> Footprint:
    """The footprint for the next admission, from the peak of the last residency.

    A declared footprint stands while the use stays within it; past it, the measured
    one replaces it. Never more than the whole budget (``total``). A peak of 0 means
    nothing was seen, not nothing used (NVML's pids may not be ours to see): the
    caller keeps the footprint it had.
    """
    if declared is not None and peak <= declared:
        return Footprint(declared, DECLARED)
    return Footprint(min(with_margin(peak, unit), total), MEASURED)


class Meter:
    """NVML's view of one command's GPU memory, sampled while it is resident.

    ``ours``: is this pid one of the command's processes (``Child.owns``)? ``gpus``:
    the GPUs to count, as ``nvml.processes`` takes them.
    """

    def __init__(self, ours: Callable[[int], bool], gpus: nvml.Which) -> None:
        self.ours = ours
        self.gpus = gpus
        self.peak = 0
        self.next_at = 0.0  # time.monotonic() of the next sample

    def due(self) -> float:
        """Seconds until the next sample is due (0 when it is)."""
        return max(0.0, self.next_at - time.monotonic())

    def sample(self) -> int | None:
        """The bytes the command uses now, kept in the peak; None when NVML cannot say."""
        self.next_at = time.monotonic() + SAMPLE_INTERVAL
        try:
            per_pid = nvml.processes(self.gpus)
        except nvml.NvmlError:
            return None
        used = sum(size for pid, size in per_pid.items() if self.ours(pid))
        self.peak = max(self.peak, used)
        return used

    def take_peak(self) -> int:
        """The peak since the last call (the residency that ends), and start again."""
        peak, self.peak = self.peak, 0
        return peak


def meter(ours: Callable[[int], bool], gpus: nvml.Which) -> Meter | None:
    """A Meter, or None where NVML cannot be used (pynvml missing, no driver)."""
    return Meter(ours, gpus) if nvml.available() else None
