"""A training job that takes turns on the GPU, for tests/test_gpu.py.

    vramlock run --arena A --release signal -- python tests/gpu_trainer.py ...
    python tests/gpu_trainer.py --arena A ...          # the Python API (Member)
    vramlock run --release checkpoint -- python tests/gpu_trainer.py --plain ...

Trains a stack of Linear layers with Adam on seeded inputs, and holds a large
scratch buffer besides (as a server holds a cache). On each release it takes a
checksum of the model and optimizer state, drops the scratch buffer and offloads
the rest with ``vramlock.offload``; on restore it takes both back and checks the
checksum. It ends with one line: ``done steps=N swaps=K bad=B sum=S``. Two of
them with the same arguments must end with the same sum, however they took turns.
``--timed`` waits for each step's GPU work and adds ``step_ms=`` (the median step) to
that line, for benchmarks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_worker import checksum, torch

from vramlock.offload import Offloader


class Job:
    def __init__(self, layers: int, width: int, scratch_gib: float) -> None:
        self.torch = torch
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(width, width, device="cuda") for _ in range(layers)]
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.width = width
        self.scratch_bytes = int(scratch_gib * (1 << 30))
        self.scratch: Any = None
        self.off = Offloader(self.model, self.opt)
        self.swaps = self.bad = 0
        self.expected = 0
        self.step(0)  # Adam makes its state on the first step: offload must see it
        self._take_scratch()

    def _take_scratch(self) -> None:
        self.scratch = self.torch.empty(self.scratch_bytes, dtype=self.torch.uint8, device="cuda")

    def tensors(self) -> list[Any]:
        out = []
        for p in self.model.parameters():
            out += [p, p.grad]
        for state in self.opt.state.values():
            out += [v for v in state.values() if v.is_cuda]
        return out

    def step(self, n: int) -> None:
        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(1024, self.width, generator=gen, device="cuda")
        loss = self.model(x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # keep the gradients: offload moves them too

    def release(self) -> None:
        self.expected = checksum(self.tensors())
        self.scratch = None
        self.off.offload()

    def restore(self) -> None:
        self.off.restore()
        self._take_scratch()
        self.swaps += 1
        if checksum(self.tensors()) != self.expected:
            self.bad += 1

    def finish(self) -> str:
        """The result line; the VRAM is given back before the caller leaves the arena."""
        result = checksum(list(self.model.parameters()))
        self.release()
        return f"swaps={self.swaps} bad={self.bad} sum={result}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arena", help="join this arena through the Python API")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--scratch-gib", type=float, default=1.0)
    parser.add_argument("--min-hold", type=float, default=1.0)
    parser.add_argument(
        "--plain", action="store_true", help="an unmodified CUDA program: no vramlock at all"
    )
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--timed", action="store_true", help="report the median step time")
    args = parser.parse_args()

    def train(yield_turn: Any) -> str:
        job = Job(args.layers, args.width, args.scratch_gib)
        took = []
        for n in range(1, args.steps):
            started = time.perf_counter()
            job.step(n)
            if args.step_sleep or args.timed:
                torch.cuda.synchronize()
                took.append(time.perf_counter() - started)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            yield_turn(job)
        timed = f" step_ms={statistics.median(took) * 1000:.3f}" if args.timed else ""
        return job.finish() + timed

    if args.plain:
        result = train(lambda j: None)
    elif args.arena:
        import vramlock

        # Leaving the arena hands the GPU on at once: the memory must be gone by then.
        with vramlock.resident(args.arena, name="trainer", min_hold=args.min_hold) as me:
            result = train(lambda j: me.yield_if_wanted(release=j.release, restore=j.restore))
    else:
        from vramlock import child

        ctl = child.connect()
        if ctl is None:
            raise SystemExit("not run by vramlock run")
        result = train(lambda j: ctl.yield_if_asked(release=j.release, restore=j.restore))
    print(f"done steps={args.steps} {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
