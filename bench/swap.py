"""``--release swap`` on one NVIDIA GPU: release and restore throughput, in one run.

    python bench/swap.py [--sizes 1,5,20,60] [--repeat 3] [--json PATH]

1. **pinned**: host<->device copy bandwidth of page-locked host memory, as bench/gpu.py
   measures it (the better of one 4 GiB copy and 16 of 256 MiB): the ceiling.
2. **switch**: a PyTorch process asked for SIZE GiB (tests/gpu_worker.py) under
   ``vramlock run --release swap --min-hold 0``, and a member that arrives and takes the
   token, then gives it back, as bench/gpu_run.py does: *out* runs from its arrival to
   owning the token (noticing it, the library's copy to host memory and the unmapping,
   the NVML check, the handoff), *back* from dropping the token to the worker answering
   a request queued while it was released (its own time subtracted: re-queue, mapping
   and copy back, the gate opening). The bytes are those that left the GPU, as NVML saw
   the process before and during the release: PyTorch's allocator holds more than it
   was asked for, and all of it moves. The first release pins the host buffers, which
   are kept; it is shown apart, and the table gives the medians of ``--repeat`` later
   swaps, as GB/s of the bytes moved and as a share of the pinned bandwidth that way.

What the library costs a resident program: bench/interpose.py. Two llama-servers under
swap, checkpoint, the preset and restart: bench/servers.py. GB/s are 10^9 bytes a
second; sizes are GiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402  (bench/gpu.py: imports torch)
import gpu_run  # noqa: E402

from vramlock.gpu import nvml  # noqa: E402


def switch(gib: float, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as arena:
        runs = gpu_run.strategy(gib, arena, "swap", swaps=1 + repeat)
    first, later = runs[0], runs[1:]
    return {
        "gib": gib,
        "first": first,
        "out": statistics.median(r["out"] for r in later),
        "back": statistics.median(r["back"] for r in later),
        "moved": statistics.median(r["moved"] for r in later),
        "runs": later,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,5,20,60")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    card = nvml.gpu(0)
    print(f"{card.name}, driver {nvml.driver_version()}, torch {gpu.torch.__version__}")
    pinned = gpu.bench_pinned()
    d2h, h2d = pinned["d2h_gbps"], pinned["h2d_gbps"]
    print(f"pinned copy: device->host {d2h:.1f} GB/s, host->device {h2d:.1f} GB/s")
    rows = [switch(float(s), args.repeat) for s in args.sizes.split(",")]
    print(f"\nswitch: medians of {args.repeat} swaps after the first")
    print("| GiB asked | GiB moved | out: s (GB/s, % pinned) | back: s (GB/s, % pinned)"
          " | first out / back: s |")  # fmt: skip
    print("|---:|---:|---|---|---|")
    for r in rows:
        n = r["moved"]
        print(
            f"| {r['gib']:g} | {n / gpu.GIB:.2f} | {r['out']:.3f} ({gpu.gbps(n, r['out']):.1f},"
            f" {gpu.gbps(n, r['out']) / d2h:.0%}) | {r['back']:.3f}"
            f" ({gpu.gbps(n, r['back']):.1f}, {gpu.gbps(n, r['back']) / h2d:.0%})"
            f" | {r['first']['out']:.2f} / {r['first']['back']:.2f} |"
        )
    if args.json:
        result = {"pinned": pinned, "switch": rows}
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
