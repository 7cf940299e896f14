"""Releasing and restoring real VRAM on one NVIDIA GPU, every way, in one run (docs/benchmarks.md).

    python bench/gpu.py [--sizes 4,16,64] [--json PATH] [--files /dev/shm]

1. **pinned**: host<->device copy bandwidth of page-locked host memory (4 GiB as one
   copy and as 16 copies of 256 MiB, the better of the two; medians of 5, CUDA
   events): the ceiling for a cooperative offload. Pageable copies for reference.
2. **offload**: ``vramlock.offload.Offloader`` on a module holding SIZE GiB of
   parameters: pinning its host buffer once (``prepare``), then the medians of 3
   offloads and restores, as a share of the pinned bandwidth in the same direction.
3. **checkpoint**: the bare driver API (``vramlock.gpu.cuda``) on a PyTorch process that
   holds SIZE GiB (tests/gpu_worker.py): lock+checkpoint and restore+unlock, with its
   footprint as NVML reports it (data plus CUDA context); the data checked afterwards.
4. **restart**: what ``restart`` costs instead: a fresh process that reads the same
   SIZE GiB from a file in the page cache (on tmpfs, ``--files``) to the GPU, from
   spawn to the weights being on the GPU (the file is mapped and copied in 256 MiB
   pieces, as servers that mmap their weights do).

GB/s are 10^9 bytes a second; sizes are GiB.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from vramlock.gpu import cuda, nvml  # noqa: E402
from vramlock.offload import Offloader  # noqa: E402

worker: Any = importlib.import_module("gpu_worker")  # tests/gpu_worker.py; imports torch
torch: Any = worker.torch

GIB = 1 << 30
CHUNK = 256 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def copy_seconds(pairs: list[tuple[Any, Any]], reps: int) -> float:
    """Median seconds of ``dst.copy_(src)`` for every pair in turn, timed with CUDA events."""
    times: list[float] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bench_pinned() -> dict[str, Any]:
    """The best of one 4 GiB copy and 16 copies of 256 MiB (what the helper issues)."""
    n = 4 * GIB
    device = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    host = torch.empty(n, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(host.data_ptr(), n, 0) == cudart.cudaError.success
    pieces = list(zip(host.split(CHUNK), device.split(CHUNK), strict=True))
    out: dict[str, Any] = {}
    for way, pairs in (("d2h", [(host, device)]), ("h2d", [(device, host)])):
        out[f"{way}_one_copy_gbps"] = gbps(n, copy_seconds(pairs, 5))
    out["d2h_pieces_gbps"] = gbps(n, copy_seconds(pieces, 5))
    out["h2d_pieces_gbps"] = gbps(n, copy_seconds([(d, h) for h, d in pieces], 5))
    for way in ("d2h", "h2d"):
        out[f"{way}_gbps"] = max(out[f"{way}_one_copy_gbps"], out[f"{way}_pieces_gbps"])
    cudart.cudaHostUnregister(host.data_ptr())
    m = GIB
    pageable = torch.empty(m, dtype=torch.uint8)
    out["pageable_d2h_gbps"] = gbps(m, copy_seconds([(pageable, device[:m])], 3))
    out["pageable_h2d_gbps"] = gbps(m, copy_seconds([(device[:m], pageable)], 3))
    del device, pieces
    torch.cuda.empty_cache()
    return out


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bench_offload(gib: int, pinned: dict[str, Any]) -> dict[str, Any]:
    nbytes = gib * GIB
    module = torch.nn.Module()
    module.chunks = torch.nn.ParameterList(
        torch.nn.Parameter(torch.empty(CHUNK // 4, device="cuda").uniform_())
        for _ in range(nbytes // CHUNK)
    )
    before = worker.checksum(list(module.parameters()))
    off = Offloader(module)
    pin = timed(off.prepare)
    offloads, restores = [timed(off.offload)], []
    left = nvml.used_by([os.getpid()], 0)
    restores.append(timed(off.restore))
    for _ in range(2):
        offloads.append(timed(off.offload))
        restores.append(timed(off.restore))
    ok = worker.checksum(list(module.parameters())) == before
    off.close()
    del module, off
    torch.cuda.empty_cache()
    out_s, in_s = statistics.median(offloads), statistics.median(restores)
    return {
        "gib": gib,
        "pin_s": pin,
        "offload_s": out_s,
        "restore_s": in_s,
        "offload_gbps": gbps(nbytes, out_s),
        "restore_gbps": gbps(nbytes, in_s),
        "offload_pct_pinned": 100 * gbps(nbytes, out_s) / pinned["d2h_gbps"],
        "restore_pct_pinned": 100 * gbps(nbytes, in_s) / pinned["h2d_gbps"],
        "left_on_gpu_mib": left >> 20,
        "data_intact": ok,
    }


def start_worker(*args: str) -> Any:
    proc = subprocess.Popen(
        [sys.executable, worker.PATH, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return worker.Client(proc, timeout=600)


def bench_checkpoint(gib: int, reps: int) -> dict[str, Any]:
    w = start_worker("--gib", str(gib))
    try:
        footprint = nvml.used_by([w.pid], 0)
        out_s, in_s, seen_s = [], [], []
        for _ in range(reps):
            out_s.append(timed(lambda: cuda.checkpoint(w.pid, lock_timeout_s=60)))
            seen_s.append(timed(lambda: nvml.wait_released([w.pid], 0, 30)))
            if not nvml.wait_free(0, footprint + GIB, 30):
                raise RuntimeError("too little free VRAM to restore")
            in_s.append(timed(lambda: cuda.restore(w.pid)))
        ok = w.check(600) == w.checksum
    finally:
        w.close()
    o, i = statistics.median(out_s), statistics.median(in_s)
    return {
        "gib": gib,
        "footprint_gib": footprint / GIB,
        "reps": reps,
        "lock_checkpoint_s": o,
        "restore_unlock_s": i,
        "checkpoint_gbps": gbps(footprint, o),
        "restore_gbps": gbps(footprint, i),
        "nvml_saw_release_after_s": max(seen_s),
        "data_intact": ok,
    }


def bench_restart(gib: int, files: Path) -> dict[str, Any]:
    path = files / f"vramlock-bench-{gib}gib.bin"
    block = torch.empty(CHUNK, dtype=torch.uint8, device="cuda").random_().cpu().numpy()
    try:
        with open(path, "wb") as f:
            for _ in range(gib * GIB // CHUNK):
                f.write(block.data)
        w = start_worker("--load", str(path))
        w.close()
    finally:
        path.unlink(missing_ok=True)
    load_s = float(w.first[2])
    return {
        "gib": gib,
        "spawn_to_loaded_s": w.ready_s,
        "load_s": load_s,
        "load_gbps": gbps(gib * GIB, load_s),
    }


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one measurement; a failure is recorded, not fatal to the others."""
    try:
        return fn()
    except Exception as err:  # a benchmark reports what failed and goes on
        return {"error": f"{type(err).__name__}: {err}"}


def _rate(seconds: float, rate: float, pct: float | None = None) -> str:
    share = "" if pct is None else f", {pct:.0f} %"
    return f"{seconds:.2f} ({rate:.1f}{share})"


def _row(gib: int, o: dict[str, Any], c: dict[str, Any], r: dict[str, Any]) -> str:
    def cells(row: dict[str, Any], *fmts: Callable[[dict[str, Any]], str]) -> list[str]:
        if not row:
            return ["-"] * len(fmts)
        if "error" in row:
            return ["failed"] * len(fmts)
        return [fmt(row) for fmt in fmts]

    return (
        "| "
        + " | ".join(
            [
                str(gib),
                *cells(
                    o,
                    lambda x: _rate(x["offload_s"], x["offload_gbps"], x["offload_pct_pinned"]),
                    lambda x: _rate(x["restore_s"], x["restore_gbps"], x["restore_pct_pinned"]),
                    lambda x: f"{x['pin_s']:.2f}",
                ),
                *cells(
                    c,
                    lambda x: _rate(x["lock_checkpoint_s"], x["checkpoint_gbps"]),
                    lambda x: _rate(x["restore_unlock_s"], x["restore_gbps"]),
                ),
                *cells(r, lambda x: f"{x['spawn_to_loaded_s']:.2f} ({x['load_s']:.2f})"),
            ]
        )
        + " |"
    )


def table(results: dict[str, Any]) -> str:
    p = results["pinned"]
    lines = [f"{results['gpu']}, driver {results['driver']}, torch {results['torch']}"]
    if "error" in p:
        lines.append(f"pinned copy: failed: {p['error']}")
    else:
        lines.append(
            f"pinned copy: device->host {p['d2h_gbps']:.1f} GB/s,"
            f" host->device {p['h2d_gbps']:.1f} GB/s"
            f" (pageable: {p['pageable_d2h_gbps']:.1f} / {p['pageable_h2d_gbps']:.1f} GB/s)"
        )
    lines += [
        "",
        "| GiB | helper out: s (GB/s, % pinned) | helper back: s (GB/s, % pinned)"
        " | helper pins once: s | checkpoint out: s (GB/s) | checkpoint back: s (GB/s)"
        " | restart: s (load s) |",
        "|---:|---|---|---:|---|---|---|",
    ]
    by = {k: {r.get("gib"): r for r in results[k]} for k in ("offload", "checkpoint", "restart")}
    for gib in results["sizes"]:
        rows = [by[k].get(gib, {}) for k in ("offload", "checkpoint", "restart")]
        lines.append(_row(gib, *rows))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16,64", help="GiB, comma-separated")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--files", default="/dev/shm", help="tmpfs for the restart files")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, Any] = {
        "gpu": nvml.gpu(0).name,
        "driver": nvml.driver_version(),
        "torch": torch.__version__,
        "command": " ".join(["python", "bench/gpu.py", *sys.argv[1:]]),
        "sizes": sizes,
        "offload": [],
        "checkpoint": [],
        "restart": [],
    }

    def record(key: str, value: dict[str, Any]) -> None:
        print(key, json.dumps(value), flush=True)
        if key == "pinned":
            results[key] = value
        else:
            results[key].append(value)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")

    pinned = attempt(bench_pinned)
    record("pinned", pinned)
    for gib in sizes:
        record("offload", attempt(functools.partial(bench_offload, gib, pinned)))
    for gib in sizes:
        reps = 1 if gib > 16 else 2
        record("checkpoint", attempt(functools.partial(bench_checkpoint, gib, reps)))
    for gib in sizes:
        record("restart", attempt(functools.partial(bench_restart, gib, Path(args.files))))
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
