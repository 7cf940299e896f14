"""The checkpoint strategy through ``vramlock run`` beside the bare driver API, in one run.

    python bench/gpu_run.py [--sizes 4,16] [--repeat 3] [--json PATH]

For each SIZE (GiB), on one NVIDIA GPU:

- **bare**: a PyTorch process holding SIZE GiB (tests/gpu_worker.py) is checkpointed
  and restored with ``vramlock.gpu.cuda`` directly (lock+checkpoint, restore+unlock).
- **strategy**: the same kind of process under
  ``vramlock run --release checkpoint --min-hold 0``. This process joins the arena as
  a member: *release* runs from its arrival (it takes want.lock) to owning the token,
  so it includes noticing the waiter, finding the CUDA processes, NVML's footprint,
  the lock and checkpoint, the NVML check that the memory is gone, and the handoff.
  *restore* runs from dropping the token to the worker answering a checksum request
  that was queued while it was checkpointed (the check's own time, measured while
  resident, is subtracted); it includes the wrapper's re-queue, the free-VRAM check,
  the restore and the unlock.

Each size is measured ``--repeat`` times, bare and strategy alternating, each time on a
fresh worker; the table gives medians (single runs vary by 10-20 % on this machine).

Target (docs/benchmarks.md): the strategy within 1.1x of the bare API.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from vramlock.arena.directory import Arena  # noqa: E402
from vramlock.arena.member import Member  # noqa: E402
from vramlock.gpu import cuda, nvml  # noqa: E402

worker: Any = importlib.import_module("gpu_worker")  # tests/gpu_worker.py
GIB = 1 << 30


def bare(gib: float) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, worker.PATH, "--gib", str(gib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    w = worker.Client(proc)
    try:
        t0 = time.perf_counter()
        cuda.checkpoint_all([w.pid], 30)
        t1 = time.perf_counter()
        cuda.restore_all([w.pid])
        t2 = time.perf_counter()
        assert w.check() == w.checksum
        return {"out": t1 - t0, "back": t2 - t1}
    finally:
        w.close()


def one_swap(
    w: Any, opened: Arena, release: str, hold: float, ask_after: float | None, check_s: float
) -> dict[str, float]:
    """A member takes the token from the worker, holds it ``hold`` seconds and gives it
    back: the times out and back, and what left the GPU as NVML saw it."""
    me = Member(opened, name="bench", command=["bench"])
    try:
        held = nvml.processes(0).get(w.pid) or 0
        t0 = time.perf_counter()
        assert me.acquire(120)
        t1 = time.perf_counter()
        left = nvml.processes(0).get(w.pid)
        # Released: off the GPU (checkpoint), or holding its CUDA context alone.
        assert left is None if release == "checkpoint" else (left or 0) < GIB, left
        asks = min(ask_after or 0.0, hold)
        time.sleep(asks)
        if ask_after is not None:
            w.send("want")
            assert w.read(10) == "wanted"
        w.send("check")  # blocks while released
        time.sleep(hold - asks)
        t2 = time.perf_counter()
        me.residency.drop()
        word, value = w.read(120).split()
        t3 = time.perf_counter()
        assert (word, int(value)) == ("sum", w.checksum)
    finally:
        me.close()
    moved = held - (left or 0)
    return {"out": t1 - t0, "back": t3 - t2 - check_s, "check": check_s, "moved": moved}


def strategy(
    gib: float,
    arena: str,
    release: str = "checkpoint",
    swaps: int = 1,
    env: dict[str, str] | None = None,
    before: Callable[[Any], object] | None = None,
    stderr: IO[str] | None = None,
    settle: float = 0.0,
    hold: float = 0.0,
    ask_after: float | None = None,
) -> list[dict[str, float]]:
    """``swaps`` releases and restores of one worker under ``--release RELEASE``: a
    member arrives and takes the token (*out*), holds it ``hold`` seconds, then gives
    it back (*back*). The worker asks for the GPU once its request comes, as the
    command's demand says (``always``: at once after each release); with ``ask_after``,
    its request comes that many seconds into the hold, and it says ``want`` then
    (``--demand child``).
    ``before`` is called with the worker's Client before each release (while
    resident); the first release comes ``settle`` seconds after the worker is ready
    (idle meanwhile)."""
    run = [sys.executable, "-m", "vramlock", "run", "--arena", arena, "--release", release]
    demand = ["--demand", "child"] if ask_after is not None else []
    proc = subprocess.Popen(
        [*run, "--min-hold", "0", *demand, "--", sys.executable, worker.PATH, "--gib", str(gib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        stderr=stderr,
    )
    w = worker.Client(proc)
    runs = []
    try:
        t = time.perf_counter()
        assert w.check() == w.checksum
        check_s = time.perf_counter() - t
        time.sleep(settle)
        opened = Arena.open(arena)
        for _ in range(swaps):
            if before is not None:
                before(w)
            runs.append(one_swap(w, opened, release, hold, ask_after, check_s))
        opened.close()
        return runs
    finally:
        w.close()
        proc.wait(60)


def median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    gpu = nvml.gpu(0)
    print(f"{gpu.name}, driver {nvml.driver_version()}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as arena:
        for gib in sizes:
            runs = [(bare(gib), strategy(gib, arena)[0]) for _ in range(args.repeat)]
            rows.append({
                "gib": gib,
                "bare": median([b for b, _ in runs]),
                "strategy": median([s for _, s in runs]),
                "runs": runs,
            })  # fmt: skip
    print(f"medians of {args.repeat}")
    print("| GiB | bare out s | strategy out s | ratio | bare back s | strategy back s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b: dict[str, float] = r["bare"]
        s: dict[str, float] = r["strategy"]
        print(
            f"| {r['gib']:g} | {b['out']:.2f} | {s['out']:.2f} | {s['out'] / b['out']:.2f}x"
            f" | {b['back']:.2f} | {s['back']:.2f} | {s['back'] / b['back']:.2f}x |"
        )
    for r in rows:
        for b, s in r["runs"]:
            print(f"  {r['gib']:g} GiB run: bare {b['out']:.2f}/{b['back']:.2f} s,"
                  f" strategy {s['out']:.2f}/{s['back']:.2f} s")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
