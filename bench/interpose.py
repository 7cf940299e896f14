"""What ``--release swap``'s library costs a resident program, side by side in one run.

    python bench/interpose.py [--pairs 6] [--cpus 2-5] [--json PATH]
    python bench/interpose.py --binary CUDA_LLAMA_SERVER --model GGUF [--ngl 99] ...
    python bench/interpose.py --only launches,launch-bound ...

Each workload runs as a fresh command under ``vramlock run --release none`` (nothing in
front of it) and under ``vramlock run --release swap`` (the library in front of it, the
program resident all along), ``--pairs`` times each, alternating none/swap then
swap/none so that drift in the machine's state falls on both alike. Every command is
pinned to the same CPUs (``--cpus``), since a launch-bound program's speed is its CPU's.
The cost is the median of the pairs' ratios (swap / none - 1), beside the medians:

- **launches**: a loop of tiny PyTorch kernels (``x.add_(1)`` on 256 floats), about
  5 µs each on the CPU side and nothing on the GPU: what the library's gate costs one
  launch, the worst case;
- **launch-bound step**, **GEMM-bound step**: the median training step of
  tests/gpu_trainer.py (8 layers of 256 and of 4096, Adam);
- **llama-server** (with ``--binary`` and ``--model``): a CUDA llama-server's own
  ``timings`` for a prompt of ``--prompt-tokens`` (prefill tokens/s) and ``--predict``
  generated tokens (tokens/s), the median of ``--requests`` requests a start, after the
  server was idle ``--settle`` seconds (under swap, the library makes its host copies
  ready while it is idle: ``--settle`` long enough measures the resident once they are).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.net import free_port  # noqa: E402
from servers import request  # noqa: E402  (beside this file)

TRAINER = str(ROOT / "tests" / "gpu_trainer.py")
MODELS = {"launch-bound step": ["--layers", "8", "--width", "256"],
          "GEMM-bound step": ["--layers", "8", "--width", "4096"]}  # fmt: skip


def launches(n: int) -> None:
    """The child: ``n`` tiny launches a block, five blocks; the best block's µs a launch."""
    torch: Any = importlib.import_module("torch")
    x = torch.zeros(256, device="cuda")
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    print(f"launch_us={best:.4f}")


# What each column runs under: ``vramlock run --release`` and the command's environment.
MODES = {
    "none": ("none", {}),
    "swap": ("swap", {}),
    "unprepared": ("swap", {"VRAMLOCK_SWAP_PREPARE": "0"}),  # no host copies made ahead
}


def launch(mode: str, arena: str, command: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``command`` in ``mode`` (MODES)."""
    release, extra = MODES[mode]
    return ([sys.executable, "-m", "vramlock", "run", "--arena", arena, "--release", release,
             "--", *command], {**os.environ, **extra})  # fmt: skip


def wrapped(mode: str, command: list[str], cpus: set[int]) -> str:
    """``command``'s output, run in ``mode`` (MODES) on ``cpus``."""
    with tempfile.TemporaryDirectory() as arena:
        line, env = launch(mode, arena, command)
        return subprocess.run(
            line, env=env, capture_output=True, text=True, check=True, timeout=600,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        ).stdout  # fmt: skip


def step_of(command: list[str], cpus: set[int]) -> Callable[[str], dict[str, float]]:
    return lambda mode: {"ms a step": figure("step_ms", wrapped(mode, command, cpus))}


def figure(name: str, out: str) -> float:
    found = re.search(rf"{name}=([0-9.]+)", out)
    assert found, out
    return float(found.group(1))


def side_by_side(
    pairs: int, modes: list[str], measure: Callable[[str], dict[str, float]]
) -> dict[str, Any]:
    """``measure(mode)`` for each of ``modes`` (the first is the reference), ``pairs``
    times each, in turn, the order reversed every other time."""
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for i in range(pairs):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            runs[mode].append(measure(mode))
            print(f"  {mode}: {runs[mode][-1]}", flush=True)
    out: dict[str, Any] = {"runs": runs}
    ref = modes[0]
    for key in runs[ref][0]:
        base = [r[key] for r in runs[ref]]
        out[key] = {m: statistics.median(r[key] for r in runs[m]) for m in modes}
        for m in modes[1:]:
            got = [r[key] for r in runs[m]]
            cost = statistics.median(s / n - 1 for s, n in zip(got, base, strict=True))
            out[key]["cost" if m == "swap" else f"cost {m}"] = cost
    return out


def complete(port: int, prompt: str, predict: int) -> dict[str, Any]:
    """``predict`` tokens after all of ``prompt``, nothing from the prompt cache."""
    return request(port, prompt, n_predict=predict, cache_prompt=False, ignore_eos=True,
                   temperature=0)  # fmt: skip


def llama(args: argparse.Namespace, cpus: set[int]) -> Callable[[str], dict[str, float]]:
    words = "the quick brown fox jumps over the lazy dog " * (args.prompt_tokens // 10)

    def measure(mode: str) -> dict[str, float]:
        port = free_port()
        with tempfile.TemporaryDirectory() as arena:
            line, env = launch(mode, arena, [
                args.binary, "-m", args.model, "-ngl", str(args.ngl), "-c", str(args.ctx),
                "--host", "127.0.0.1", "--port", str(port)])  # fmt: skip
            proc = subprocess.Popen(
                line, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            )  # fmt: skip
            try:
                end = time.monotonic() + 120
                while True:
                    try:
                        complete(port, "hi", 1)
                        break
                    except (OSError, RuntimeError):
                        if time.monotonic() > end or proc.poll() is not None:
                            raise RuntimeError("llama-server did not come up") from None
                        time.sleep(0.2)
                time.sleep(args.settle)  # idle: under swap, the host copies are made ready
                got = [complete(port, words, args.predict) for _ in range(args.requests)]
            finally:
                proc.terminate()
                proc.wait(60)
        return {
            "prefill tokens/s": statistics.median(t["prompt_per_second"] for t in got),
            "tokens/s": statistics.median(t["predicted_per_second"] for t in got),
        }

    return measure


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--cpus", default="2-5", help="CPUs every command runs on (taskset form)")
    parser.add_argument("--launches", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--binary", help="a CUDA llama-server")
    parser.add_argument("--model", help="a GGUF for it")
    parser.add_argument("--ngl", type=int, default=99)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--predict", type=int, default=128)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.0, help="llama: idle seconds first")
    parser.add_argument(
        "--only", help="the workloads to run, by the start of their names: launches,launch-bound"
    )
    parser.add_argument(
        "--modes", default="none,swap",
        help="columns, the first the reference: none, swap, unprepared (swap, nothing made"
        " ahead: VRAMLOCK_SWAP_PREPARE=0)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child-launches", type=int, help=argparse.SUPPRESS)
    return parser


def table(args: argparse.Namespace, modes: list[str], results: dict[str, Any]) -> None:
    print(f"\n{args.pairs} rounds each, CPUs {args.cpus}; cost: median of the rounds' ratios")
    costs = [k for m in modes[1:] for k in ["cost" if m == "swap" else f"cost {m}"]]
    print("| workload | figure | " + " | ".join(modes) + " | "
          + " | ".join(f"{m} vs {modes[0]}" for m in modes[1:]) + " |")  # fmt: skip
    print("|---|---|" + "---:|" * (len(modes) + len(costs)))
    for name, result in results.items():
        for key, r in result.items():
            if key != "runs":
                print(f"| {name} | {key} | " + " | ".join(f"{r[m]:.4g}" for m in modes) + " | "
                      + " | ".join(f"{r[c]:+.2%}" for c in costs) + " |")  # fmt: skip


def main() -> int:
    options = parser()
    args = options.parse_args()
    if args.child_launches:
        launches(args.child_launches)
        return 0
    first, _, last = args.cpus.partition("-")
    cpus = set(range(int(first), int(last or first) + 1))
    me = [sys.executable, os.path.abspath(__file__)]
    work: dict[str, Callable[[str], dict[str, float]]] = {
        "launches": lambda r: {
            "µs a launch": figure(
                "launch_us", wrapped(r, [*me, "--child-launches", str(args.launches)], cpus)
            )
        },
    }
    for name, model in MODELS.items():
        command = [sys.executable, TRAINER, "--plain", "--timed", "--scratch-gib", "0",
                   "--steps", str(args.steps), *model]  # fmt: skip
        work[name] = step_of(command, cpus)
    if args.binary and args.model:
        work["llama-server"] = llama(args, cpus)
    if args.only:
        chosen = tuple(args.only.split(","))
        work = {name: measure for name, measure in work.items() if name.startswith(chosen)}
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        options.error(f"--modes: unknown {', '.join(sorted(unknown))}; known: {', '.join(MODES)}")
    results = {}
    for name, measure in work.items():
        print(f"{name}:", flush=True)
        results[name] = side_by_side(args.pairs, modes, measure)
    table(args, modes, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
