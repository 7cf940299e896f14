"""``--release swap`` on one NVIDIA GPU: switch throughput and interposition cost, in one run.

    python bench/swap.py [--sizes 1,5,20,60] [--repeat 3] [--steps 300] [--json PATH]

1. **pinned**: host<->device copy bandwidth of page-locked host memory, as bench/gpu.py
   measures it (the better of one 4 GiB copy and 16 of 256 MiB): the ceiling.
2. **switch**: a PyTorch process holding SIZE GiB (tests/gpu_worker.py) under
   ``vramlock run --release swap --min-hold 0``, and a member that arrives and takes the
   token, then gives it back, as bench/gpu_run.py does: *out* runs from its arrival to
   owning the token (noticing it, the library's copy to host memory and the unmapping,
   the NVML check, the handoff), *back* from dropping the token to the worker answering
   a request queued while it was released (its own time subtracted: re-queue, mapping
   and copy back, the gate opening). The first release pins the host buffers, which
   are kept; it is shown apart, and the table gives the medians of ``--repeat`` later
   swaps, as GB/s of SIZE GiB and as a share of the pinned bandwidth that way.
3. **interposition**: the median step time of a PyTorch training loop
   (tests/gpu_trainer.py ``--plain --timed``) under ``--release swap`` (the library in
   front of it) and under ``--release none`` (nothing in front), each resident all
   along; ``--repeat`` runs of each, alternating, for a GEMM-bound model (8 layers of
   4096) and a launch-bound one (8 layers of 256: a few hundred small kernels a step).

Two llama-servers under swap, checkpoint, the preset and restart: bench/servers.py.
GB/s are 10^9 bytes a second; sizes are GiB.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402  (bench/gpu.py: imports torch)
import gpu_run  # noqa: E402

from vramlock import nvml  # noqa: E402

TRAINER = str(ROOT / "tests" / "gpu_trainer.py")
MODELS = {"GEMM-bound": ["--layers", "8", "--width", "4096"],
          "launch-bound": ["--layers", "8", "--width", "256"]}  # fmt: skip


def switch(gib: float, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as arena:
        runs = gpu_run.strategy(gib, arena, "swap", swaps=1 + repeat)
    first, later = runs[0], runs[1:]
    return {
        "gib": gib,
        "first": first,
        "out": statistics.median(r["out"] for r in later),
        "back": statistics.median(r["back"] for r in later),
        "runs": later,
    }


def step_ms(release: str, model: list[str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as arena:
        out = subprocess.run(
            [sys.executable, "-m", "vramlock", "run", "--arena", arena, "--release", release,
             "--", sys.executable, TRAINER, "--plain", "--timed", "--scratch-gib", "0",
             "--steps", str(steps), *model],
            capture_output=True, text=True, check=True, timeout=600,
        ).stdout  # fmt: skip
    found = re.search(r"step_ms=([0-9.]+)", out)
    assert found, out
    return float(found.group(1))


def interposition(repeat: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, model in MODELS.items():
        runs: dict[str, list[float]] = {"none": [], "swap": []}
        for _ in range(repeat):
            for release in runs:
                runs[release].append(step_ms(release, model, steps))
        none, swap = statistics.median(runs["none"]), statistics.median(runs["swap"])
        out[name] = {"none": none, "swap": swap, "cost": swap / none - 1, "runs": runs}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,5,20,60")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    card = nvml.gpu(0)
    print(f"{card.name}, driver {nvml.driver_version()}, torch {gpu.torch.__version__}")
    pinned = gpu.bench_pinned()
    d2h, h2d = pinned["d2h_gbps"], pinned["h2d_gbps"]
    print(f"pinned copy: device->host {d2h:.1f} GB/s, host->device {h2d:.1f} GB/s")
    rows = [switch(float(s), args.repeat) for s in args.sizes.split(",")]
    print(f"\nswitch: medians of {args.repeat} swaps after the first")
    print("| GiB | out: s (GB/s, % pinned) | back: s (GB/s, % pinned) | first out / back: s |")
    print("|---:|---|---|---|")
    for r in rows:
        n = r["gib"] * gpu.GIB
        print(
            f"| {r['gib']:g} | {r['out']:.3f} ({gpu.gbps(n, r['out']):.1f},"
            f" {gpu.gbps(n, r['out']) / d2h:.0%}) | {r['back']:.3f}"
            f" ({gpu.gbps(n, r['back']):.1f}, {gpu.gbps(n, r['back']) / h2d:.0%})"
            f" | {r['first']['out']:.2f} / {r['first']['back']:.2f} |"
        )
    cost = interposition(args.repeat, args.steps)
    print(f"\ninterposition: median step of {args.steps}, medians of {args.repeat} runs each")
    print("| model | none: ms | swap: ms | cost |")
    print("|---|---:|---:|---:|")
    for name, c in cost.items():
        print(f"| {name} | {c['none']:.3f} | {c['swap']:.3f} | {c['cost']:+.1%} |")
    if args.json:
        result = {"pinned": pinned, "switch": rows, "interposition": cost}
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
