"""``--release swap`` on one NVIDIA GPU: release and restore throughput, in one run.

    python bench/swap.py [--sizes 1,5,20,60] [--unchanged 0,50,100] [--repeat 3] [--json PATH]

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
3. **unchanged**: before each release the worker changes all but UNCHANGED % of its
   tensors (``touch``: every word of them), for each of ``--unchanged``; a release copies
   out only the segments that changed since the last one (docs/swap.md), so *out* falls
   with it, while *back* copies everything. *copied* is what the library says each
   release copied (its VRAMLOCK_SWAP_DEBUG trace), *digest* how long its digest kernel
   took. At 100 % the worker's checksum after each restore still writes its temporaries
   (32 MiB, reused blocks of PyTorch's cache): those segments are copied too.
4. **first**: the first release, ``--settle`` seconds after the worker is ready, with the
   library's host copies made ready meanwhile (``--prepare on``), without (``off``, as
   ``VRAMLOCK_SWAP_PREPARE=0``), or ``both``, one after the other in the same run: *first
   out* and *back*, what the first release copied, and the first switch (out + back)
   against a later one's; then, for each host copy made ahead, how long digesting it
   took and where (the kernel reading it, or the CPU: the library's trace).
5. **parked** (``--park``): each size again with ``VRAMLOCK_PARK_AFTER=0`` and the member
   holding the token PARK_HOLD seconds, so that the released worker's CUDA context leaves
   the GPU too. *queued*: the worker's request comes as soon as it is released, so it is
   parked while queued, and *back* includes bringing its context back. *asked*: the
   worker, under ``--demand child``, says it wants the GPU when its request comes, once
   it is parked, ASK_AFTER seconds into the hold: its context comes back while the
   member finishes its turn (docs/swap.md).

What the library costs a resident program: bench/interpose.py. Two llama-servers under
swap, checkpoint, the preset and restart: bench/servers.py. GB/s are 10^9 bytes a
second; sizes are GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

PARK_HOLD = 2.0  # seconds: the park (a checkpoint of the context, ~0.5 s) is done by then
ASK_AFTER = 1.5  # seconds into the hold: the parked worker's request comes then


def traced(err: str) -> tuple[list[int], list[float]]:
    """The bytes each release copied and each digest's milliseconds, from the trace."""
    copied = [int(n) for n in re.findall(r"released \d+ bytes, copied (\d+):", err)]
    digest = [float(ms) for ms in re.findall(r"digest: \d+ segments in ([\d.]+) ms", err)]
    return copied, digest


def switch(
    gib: float,
    repeat: int,
    unchanged: float,
    settle: float = 0.0,
    prepare: bool = True,
    park: str = "",
) -> dict[str, Any]:
    def change(w: Any) -> None:
        if unchanged < 100:
            w.touch(100 - unchanged)

    env = {**os.environ, "VRAMLOCK_SWAP_DEBUG": "1", "VRAMLOCK_SWAP_PREPARE": str(int(prepare))}
    if park:  # parked at once, and the member holds the token long enough for it
        env["VRAMLOCK_PARK_AFTER"] = "0"
    with tempfile.TemporaryDirectory() as arena, tempfile.TemporaryFile("w+") as err:
        runs = gpu_run.strategy(gib, arena, "swap", swaps=1 + repeat, env=env, before=change,
                                stderr=err, settle=settle,
                                hold=PARK_HOLD if park else 0.0,
                                ask_after=ASK_AFTER if park == "asked" else None)  # fmt: skip
        err.seek(0)
        trace = err.read()
        copied, digest = traced(trace)
        ahead = re.findall(r"(\d+) bytes made ahead \(digested in ([\d.]+) ms, (\w+)\)", trace)
    for run, n, ms in zip(runs, copied, digest + [0.0] * len(runs), strict=False):
        run["copied"], run["digest_ms"] = n, ms
    first, later = runs[0], runs[1:]
    return {
        "gib": gib,
        "unchanged": unchanged,
        "prepare": prepare,
        "park": park,
        "settle": settle,
        "first": first,
        # each host copy made ahead of the first release: bytes, ms digesting it, where
        "ahead": [(int(n), float(ms), where) for n, ms, where in ahead],
        **{key: statistics.median(r.get(key, 0) for r in later)
           for key in ("out", "back", "moved", "copied", "digest_ms")},
        "runs": later,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,5,20,60")
    parser.add_argument("--unchanged", default="0,50,100", help="percent of memory kept")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.0, help="idle seconds before release 1")
    parser.add_argument("--prepare", choices=("on", "off", "both"), default="on")
    parser.add_argument("--park", action="store_true", help="each size parked too (back)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    prepares = {"on": [True], "off": [False], "both": [True, False]}[args.prepare]
    card = nvml.gpu(0)
    print(f"{card.name}, driver {nvml.driver_version()}, torch {gpu.torch.__version__}")
    pinned = gpu.bench_pinned()
    d2h, h2d = pinned["d2h_gbps"], pinned["h2d_gbps"]
    print(f"pinned copy: device->host {d2h:.1f} GB/s, host->device {h2d:.1f} GB/s")
    rows = [switch(float(s), args.repeat, float(u), args.settle, p)
            for s in args.sizes.split(",") for u in args.unchanged.split(",")
            for p in prepares]  # fmt: skip
    if args.park:
        rows += [switch(float(s), args.repeat, 100.0, args.settle, True, park=how)
                 for s in args.sizes.split(",") for how in ("queued", "asked")]  # fmt: skip
    print(f"\nswitch: medians of {args.repeat} swaps after the first;"
          f" the first {args.settle:g} s after the worker was ready")  # fmt: skip
    print(
        "| GiB asked | unchanged | prepare | GiB moved | GiB copied | digest ms | out: s (GB/s,"
        " % pinned) | back: s (GB/s, % pinned) | first out / back: s | first copied GiB"
        " | first / later switch |"
    )
    print("|---:|---:|---|---:|---:|---:|---|---|---|---:|---:|")
    for r in rows:
        n = r["moved"]
        print(
            f"| {r['gib']:g} | {r['unchanged']:g} % | {'on' if r['prepare'] else 'off'}"
            f"{', parked, ' + r['park'] if r['park'] else ''}"
            f" | {n / gpu.GIB:.2f}"
            f" | {r['copied'] / gpu.GIB:.2f} | {r['digest_ms']:.1f}"
            f" | {r['out']:.3f} ({gpu.gbps(n, r['out']):.1f},"
            f" {gpu.gbps(n, r['out']) / d2h:.0%}) | {r['back']:.3f}"
            f" ({gpu.gbps(n, r['back']):.1f}, {gpu.gbps(n, r['back']) / h2d:.0%})"
            f" | {r['first']['out']:.2f} / {r['first']['back']:.2f}"
            f" | {r['first']['copied'] / gpu.GIB:.2f}"
            f" | {(r['first']['out'] + r['first']['back']) / (r['out'] + r['back']):.2f}x |"
        )
    for r in rows:
        for n, ms, where in r["ahead"]:
            print(f"{r['gib']:g} GiB, prepare {'on' if r['prepare'] else 'off'}: a host copy of"
                  f" {n / gpu.GIB:.2f} GiB made ahead, digested in {ms:.1f} ms ({where},"
                  f" {gpu.gbps(n, ms / 1000):.1f} GB/s)")  # fmt: skip
    if args.json:
        result = {"pinned": pinned, "switch": rows}
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
