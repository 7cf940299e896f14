"""Figures shared by the handoff benchmarks (bench/handoff.py, bench/handoff_e2e.py):
nearest-rank percentiles in µs, table cells, the filesystem an arena is on."""

from __future__ import annotations

import math

WARMUP = 0.3  # seconds of each run left out of the figures


def pct(values: list[int], q: float) -> float:
    """Nearest-rank percentile, in µs."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1] / 1000


def cell(v: list[int]) -> str:
    if not v:
        return f"{'-':>22}"
    return f"{pct(v, 50):>8.1f} / {pct(v, 99):>7.1f} ({max(v) / 1000:.0f})".rjust(22)


def filesystem(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (records cost differs a lot)."""
    best, kind = "", "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if len(parts) > 2 and inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def quantiles(v: list[int]) -> dict[str, float]:
    if not v:
        return {}
    return {"p50_us": pct(v, 50), "p99_us": pct(v, 99), "max_us": max(v) / 1000}
