"""What the Vulkan layer (``--release swap-vulkan``) costs a program as it records.

    python bench/vulkan_record.py [--pairs 5] [--dispatches 1000] [--json PATH]

llama.cpp records every step of a model anew for each token: per operation a pipeline
bound, a descriptor set of its own bound, push constants, a dispatch and a barrier.
While a token is decoded the GPU often waits for that recording, so the time the layer
adds to each recorded command is time added to every token. This times it alone, with
the tests' Vulkan program (tests/vulkan/vk_prog.c, VK_PROG_RECORD): ``--dispatches``
such operations in one command buffer, each with its own set, recorded and submitted
55 times; the median over the last 50 of the time from vkBeginCommandBuffer to
vkQueueSubmit's return, per dispatch. Bare (the program alone) and under ``vramlock run
--release swap-vulkan`` (the layer in front of it), ``--pairs`` times each, the order
reversed every other time; the layer's cost is the median of the pairs' differences.

It runs on whatever Vulkan driver the loader finds (name one with VK_DRIVER_FILES):
Mesa's lavapipe is a CPU driver that records slowly itself, so there the difference
says more than the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "tests" / "vulkan"


def build(out: Path) -> Path:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise SystemExit("vulkan_record: no C compiler")
    subprocess.run([cc, "-std=c11", "-O2", "-o", str(out / "vk_prog"), str(SOURCES / "vk_prog.c"),
                    "-lvulkan"], check=True, timeout=120)  # fmt: skip
    return out / "vk_prog"


def per_dispatch(program: Path, mode: str, dispatches: int) -> float:
    """The program's median ns per recorded dispatch, bare or under the layer."""
    env = dict(os.environ, VK_PROG_INPUT="ro", VK_PROG_RECORD=str(dispatches))
    argv = [str(program), "64"]
    with tempfile.TemporaryDirectory() as arena:
        if mode != "bare":
            argv = [sys.executable, "-m", "vramlock", "run", "--arena", arena, "--release",
                    "swap-vulkan", "--", *argv]  # fmt: skip
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    words = done.stdout.split()
    if done.returncode != 0 or words[:1] != ["record"]:
        raise SystemExit(f"vulkan_record: {mode} failed ({done.returncode}): {done.stderr}")
    return float(words[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--dispatches", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        program = build(Path(out))
        runs: dict[str, list[float]] = {"bare": [], "swap-vulkan": []}
        for i in range(args.pairs):
            for mode in list(runs) if i % 2 == 0 else list(runs)[::-1]:
                runs[mode].append(per_dispatch(program, mode, args.dispatches))
                print(f"  {mode}: {runs[mode][-1]:.1f} ns", flush=True)
    added = [s - b for s, b in zip(runs["swap-vulkan"], runs["bare"], strict=True)]
    result: dict[str, Any] = {m: statistics.median(r) for m, r in runs.items()}
    result["added"] = statistics.median(added)
    result["runs"] = runs
    print("| ns per dispatch | bare | swap-vulkan | added by the layer |")
    print("|---|---|---|---|")
    print(f"| {args.dispatches} dispatches, {args.pairs} pairs | {result['bare']:.1f} "
          f"| {result['swap-vulkan']:.1f} | {result['added']:.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
