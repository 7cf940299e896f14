"""Time of ``vramlock stats`` over a journal of N events (the target: 100,000 in at most 1 s).

Writes a journal of handoffs between three members (``UID.jsonl.1`` and ``UID.jsonl``, as a
rotated one is, each at most the cap), then times, in this process, reading it
(``journal.read``), computing the statistics and drawing the timeline, ``--runs`` times; the
median and the best are reported. Also times the whole command, ``vramlock stats --json``.

    python bench/stats.py [--events 100000] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vramlock.arena import journal
from vramlock.arena.directory import Arena
from vramlock.observe.stats import compute, timeline

T0 = 1_700_000_000.0


def _line(at: float, pid: int, event: str) -> str:
    return json.dumps({"time": T0 + at, "mono": 1000.0 + at, "pid": pid, "start": 0,
                       "uid": os.geteuid(), "name": f"member-{pid}", "event": event,
                       "strategy": "swap"}) + "\n"  # fmt: skip


def write_journal(arena: Path, events: int) -> int:
    """Handoffs of five lines each, around three members; the number of lines written."""
    lines = [_line(-1, 1, "acquire")]
    at = 0.0
    while len(lines) < events:
        out, into = 1 + len(lines) % 3, 1 + (len(lines) + 1) % 3
        lines += [_line(at, into, "want"), _line(at, out, "release-start"),
                  _line(at + 0.1, out, "release-end"), _line(at + 0.1, into, "restore-start"),
                  _line(at + 0.3, into, "restore-end")]  # fmt: skip
        at += 2.0
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    half = len(lines) // 2
    (jdir / f"{os.geteuid()}{journal.OLDER}").write_text("".join(lines[:half]))
    (jdir / f"{os.geteuid()}{journal.SUFFIX}").write_text("".join(lines[half:]))
    return len(lines)


def once(path: Path) -> tuple[float, float]:
    """(read seconds, compute and timeline seconds)."""
    opened = Arena.open(str(path))
    try:
        started = time.perf_counter()
        events = journal.read(opened)
        read = time.perf_counter()
        timeline(compute(events), 120)
        return read - started, time.perf_counter() - read
    finally:
        opened.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        arena = Path(tmp)
        n = write_journal(arena, args.events)
        runs = [once(arena) for _ in range(args.runs)]
        totals = [r + c for r, c in runs]
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "vramlock", "stats", "--arena", str(arena), "--json"],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        command = time.perf_counter() - started
    print(f"{n} events, {args.runs} runs: read {statistics.median(r for r, _ in runs):.3f} s,"
          f" compute and timeline {statistics.median(c for _, c in runs):.3f} s,"
          f" total median {statistics.median(totals):.3f} s (best {min(totals):.3f} s);"
          f" vramlock stats --json {command:.3f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
