"""Where a parked process's return goes: the driver's checkpoint steps, timed one by one.

    python bench/park.py [--host-gib 0,5,20] [--repeat 3] [--json PATH]

A parked member's processes hold only their CUDA contexts on the GPU (their memory is in
host memory already, in page-locked copies the swap library registered with the driver).
For each case below a PyTorch child is made to look like that, then this process has the
driver lock, checkpoint, restore and unlock it, ``--repeat`` times, timing each step; then
the child runs one small kernel and says how long it took (what the first call after the
unlock pays):

- **context**: the child's context after a kernel and a GEMM (cuBLAS loaded), with its
  memory freed;
- **host K GiB**: the same, plus K GiB of host memory locked and device-mapped, as the
  library's host copies are;
- **small stack**: the context case with the per-thread stack limit set to its least first
  (``cuCtxSetLimit``): how much of the context is local memory.

Each row gives what NVML saw the child hold before the park, and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vramlock.gpu import cuda, nvml  # noqa: E402

CHILD = r"""
import ctypes, mmap, sys, time
import torch
host_gib, small_stack = float(sys.argv[1]), sys.argv[2] == "1"
x = torch.zeros(1 << 20, device="cuda")
a = torch.randn(4096, 4096, device="cuda"); (a @ a).sum().item()
del a; torch.cuda.synchronize(); torch.cuda.empty_cache()
if small_stack:
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuCtxSetLimit(ctypes.c_int(0), ctypes.c_size_t(16)) == 0
    torch.cuda.synchronize()
keep = None
if host_gib:
    size = int(host_gib * (1 << 30))
    keep = mmap.mmap(-1, size)
    keep.madvise(mmap.MADV_HUGEPAGE)  # as the library maps its host copies
    buf = (ctypes.c_char * size).from_buffer(keep)
    ptr = ctypes.addressof(buf)
    for off in range(0, size, 1 << 21):
        keep[off] = 1
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 2)  # cudaHostRegisterMapped
    assert int(err) == 0, err
print("ready", flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    x.add_(1); torch.cuda.synchronize()
    print(f"ran {time.perf_counter() - t0:.6f}", flush=True)
"""


def case(host_gib: float, small_stack: bool, repeat: int) -> dict[str, Any]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(host_gib), "1" if small_stack else "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        held = nvml.used_by([child.pid])
        steps: dict[str, list[float]] = {k: [] for k in ("lock", "checkpoint", "restore",
                                                         "unlock", "first call")}  # fmt: skip
        parked_held = []
        for _ in range(repeat):
            t = [time.perf_counter()]
            cuda.lock(child.pid, 5.0)
            t.append(time.perf_counter())
            cuda._checkpoint_locked(child.pid)
            t.append(time.perf_counter())
            parked_held.append(nvml.used_by([child.pid]))
            t.append(time.perf_counter())
            cuda._restore_checkpointed(child.pid)
            t.append(time.perf_counter())
            cuda.unlock(child.pid)
            t.append(time.perf_counter())
            steps["lock"].append(t[1] - t[0])
            steps["checkpoint"].append(t[2] - t[1])
            steps["restore"].append(t[4] - t[3])
            steps["unlock"].append(t[5] - t[4])
            child.stdin.write("run\n")
            child.stdin.flush()
            steps["first call"].append(float(child.stdout.readline().split()[1]))
            time.sleep(0.5)
        return {
            "case": ("small stack" if small_stack else
                     f"host {host_gib:g} GiB" if host_gib else "context"),
            "held_mib": held / 2**20,
            "parked_mib": max(parked_held) / 2**20,
            **{k: statistics.median(v) for k, v in steps.items()},
        }  # fmt: skip
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-gib", default="0,5,20")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [case(float(g), False, args.repeat) for g in args.host_gib.split(",")]
    rows.append(case(0.0, True, args.repeat))
    print(f"{'case':<14}{'held MiB':>9}{'parked':>8}"
          + "".join(f"{k:>12}" for k in ("lock", "checkpoint", "restore", "unlock",
                                         "first call")))  # fmt: skip
    for r in rows:
        print(f"{r['case']:<14}{r['held_mib']:>9.0f}{r['parked_mib']:>8.0f}"
              + "".join(f"{r[k]:>12.4f}" for k in ("lock", "checkpoint", "restore", "unlock",
                                                   "first call")))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
