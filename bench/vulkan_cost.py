"""What the Vulkan layer (``--release swap-vulkan``) costs a resident llama-server.

    python bench/vulkan_cost.py --binary VULKAN_LLAMA_SERVER --model GGUF \
        [--pairs 3] [--ngl 99] [--ctx 4096] [--prompt-tokens 1000] [--predict 128] \
        [--requests 3] [--settle 0] [--modes bare,swap-vulkan] [--json PATH]

The same server, model and prompt, started afresh for every measurement: bare (the
server alone, no vramlock) and under ``vramlock run --release swap-vulkan`` as the only
member of a fresh arena (the layer in front of it, the server resident all along, never
released). ``--pairs`` rounds, each one start of every mode, the order reversed every
other round so that drift in the machine's state falls on both alike. A start is
measured by the server's own ``timings`` for ``--requests`` requests of a prompt of
``--prompt-tokens`` (nothing from the prompt cache) and ``--predict`` generated tokens,
after it loaded and stayed idle ``--settle`` seconds: prefill
(``timings.prompt_per_second``) and decode (``timings.predicted_per_second``), the
median of the requests. The cost is the median of the rounds' ratios (layer / bare - 1),
beside each mode's median; ``none`` (``vramlock run --release none``: vramlock's wrapper,
no layer) may be added as a column, and ``staged`` and ``unmapped`` (see MODES) tell
what staging copies cost.

The environment is passed on as it is: name the Vulkan driver there where the loader
would not find it (``VK_DRIVER_FILES``), and ``GGML_VK_VISIBLE_DEVICES=0`` to let
llama.cpp take a CPU driver (lavapipe), which it skips otherwise.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.net import free_port  # noqa: E402
from interpose import complete, side_by_side  # noqa: E402  (beside this file)

# ``vramlock run --release`` of each mode; bare is the server alone. The last three tell
# where a cost comes from: ``staged`` is bare with llama.cpp kept off mappable
# device-local memory (GGML_VK_DISABLE_HOST_VISIBLE_VIDMEM: its inputs go through
# staging copies, a submit and a wait each), ``unmapped`` is swap-vulkan without the
# layer's mapped allowance (VRAMLOCK_VULKAN_MAPPED=0: the same, from the layer), and
# ``mapped-1g`` swap-vulkan with an allowance of 1 GiB (buffers up to that mapped).
MODES = {"bare": None, "none": "none", "swap-vulkan": "swap-vulkan", "staged": None,
         "unmapped": "swap-vulkan", "mapped-1g": "swap-vulkan"}  # fmt: skip
ENVS = {"staged": {"GGML_VK_DISABLE_HOST_VISIBLE_VIDMEM": "1"},
        "unmapped": {"VRAMLOCK_VULKAN_MAPPED": "0"},
        "mapped-1g": {"VRAMLOCK_VULKAN_MAPPED": "1G"}}  # fmt: skip
FIGURES = ("prefill tokens/s", "decode tokens/s")


def command(mode: str, arena: str, server: list[str]) -> list[str]:
    release = MODES[mode]
    if release is None:
        return server
    return [sys.executable, "-m", "vramlock", "run", "--arena", arena, "--release", release,
            "--", *server]  # fmt: skip


def up(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the server answers a one-token request (it has loaded)."""
    end = time.monotonic() + timeout
    while True:
        try:
            complete(port, "hi", 1)
            return
        except (OSError, RuntimeError):
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError("llama-server did not come up") from None
            time.sleep(0.2)


def measure_of(args: argparse.Namespace) -> Callable[[str], dict[str, float]]:
    """One fresh start in a mode: its prefill and decode speeds."""
    words = "the quick brown fox jumps over the lazy dog " * (args.prompt_tokens // 10)

    def measure(mode: str) -> dict[str, float]:
        port = free_port()
        server = [args.binary, "-m", args.model, "-ngl", str(args.ngl), "-c", str(args.ctx),
                  "-np", "1", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        with tempfile.TemporaryDirectory() as arena:
            proc = subprocess.Popen(
                command(mode, arena, server), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, **ENVS.get(mode, {})},
            )  # fmt: skip
            try:
                up(port, proc, args.timeout)
                time.sleep(args.settle)
                got = [complete(port, words, args.predict) for _ in range(args.requests)]
            finally:
                proc.terminate()
                proc.wait(60)
        return {
            FIGURES[0]: statistics.median(t["prompt_per_second"] for t in got),
            FIGURES[1]: statistics.median(t["predicted_per_second"] for t in got),
        }

    return measure


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", required=True, help="a Vulkan llama-server")
    parser.add_argument("--model", required=True, help="a GGUF for it")
    parser.add_argument("--pairs", type=int, default=3, help="rounds (a start of every mode)")
    parser.add_argument("--ngl", type=int, default=99)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--predict", type=int, default=128)
    parser.add_argument("--requests", type=int, default=3, help="measured requests a start")
    parser.add_argument("--settle", type=float, default=0.0, help="idle seconds after loading")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a load may take")
    parser.add_argument(
        "--modes",
        default="bare,swap-vulkan",
        help=f"columns, the first the reference: {', '.join(MODES)}",
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))}; known: {', '.join(MODES)}")
    if len(modes) < 2 or args.pairs < 1:
        parser.error("two modes at least, and one pair")
    return args


def table(args: argparse.Namespace, modes: list[str], result: dict[str, Any]) -> list[str]:
    """The figures as a Markdown table a human can paste."""
    ref = modes[0]
    lines = [
        f"{args.pairs} paired starts, {Path(args.model).name}, -ngl {args.ngl} -c {args.ctx},"
        f" {args.prompt_tokens}-token prompt, {args.predict} tokens, {args.requests} requests"
        " a start; cost: median of the rounds' ratios",
        "| figure | " + " | ".join(modes) + " | "
        + " | ".join(f"{m} vs {ref}" for m in modes[1:]) + " |",
        "|---|" + "---:|" * (2 * len(modes) - 1),
    ]  # fmt: skip
    for key in FIGURES:
        r = result[key]
        lines.append(f"| {key} | " + " | ".join(f"{r[m]:.4g}" for m in modes) + " | "
                     + " | ".join(f"{r[f'cost {m}']:+.2%}" for m in modes[1:]) + " |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    modes = args.modes.split(",")
    result = side_by_side(args.pairs, modes, measure_of(args))
    print("\n".join(table(args, modes, result)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
