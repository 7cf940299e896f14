"""Start-up cost of the short commands, beside ``python -c pass`` in the same run.

``who`` (empty arena), ``wait -n`` (free token) and ``run -- true`` are what shell scripts
call in loops; each should cost little more than the interpreter. The commands are run
round-robin ``--runs`` times, so drift on the machine hits all of them alike, and the medians
are reported with their ratio to ``python -c pass``.

    python bench/startup.py [--runs 30]
    python -X importtime -m vramlock who --arena DIR 2>&1 | sort -t'|' -k2 -n | tail  # why
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("VRAMLOCK_ARENA", None)
    # An installed package has its bytecode compiled; without it every run compiles again.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="vramlock-startup-") as arena:
        os.chmod(arena, 0o700)
        commands = {
            "python -c pass": [py, "-c", "pass"],
            "vramlock who": [py, "-m", "vramlock", "who", "--arena", arena],
            "vramlock wait -n": [py, "-m", "vramlock", "wait", "-n", "--arena", arena],
            "vramlock run -- true": [py, "-m", "vramlock", "run", "--arena", arena, "--", "true"],
        }
        for cmd in commands.values():  # warm the page cache and the bytecode cache
            timed(cmd, env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, cmd in commands.items():
                times[name].append(timed(cmd, env))
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["python -c pass"]
    print(f"{sys.version.split()[0]}; {args.runs} runs each, round-robin, medians")
    for name, m in medians.items():
        ratio = "" if name == "python -c pass" else f"   ({m / base:.1f}x python -c pass)"
        print(f"{name:22s}{m * 1000:7.1f} ms{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
