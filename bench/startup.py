"""Start-up cost of the short commands, beside ``python -c pass`` in the same run.

``who`` (empty arena), ``wait -n`` (free token) and ``run -- true`` are what shell scripts
call in loops; each should cost little more than the interpreter. The commands are run
round-robin ``--runs`` times, so drift on the machine hits all of them alike, and the medians
are reported with their ratio to ``python -c pass``. ``--against DIR`` times another
checkout's commands in the same rounds (a before and after, under the same load).

    python bench/startup.py [--runs 30] [--against DIR]
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
    # In the checkout's directory: python -m puts the working directory first on the path.
    subprocess.run(cmd, env=env, cwd=env["PYTHONPATH"].split(os.pathsep)[0],
                   stdout=subprocess.DEVNULL, check=True)  # fmt: skip
    return time.perf_counter() - start


def _commands(py: str, arena: str, tag: str = "") -> dict[str, list[str]]:
    return {
        f"vramlock who{tag}": [py, "-m", "vramlock", "who", "--arena", arena],
        f"vramlock wait -n{tag}": [py, "-m", "vramlock", "wait", "-n", "--arena", arena],
        f"vramlock run -- true{tag}": [py, "-m", "vramlock", "run", "--arena", arena, "--", "true"],
    }


def _env(tree: Path) -> dict[str, str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("VRAMLOCK_ARENA", None)
    # An installed package has its bytecode compiled; without it every run compiles again.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--against", type=Path, help="another checkout, timed alongside")
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="vramlock-startup-") as arena:
        os.chmod(arena, 0o700)
        commands = {"python -c pass": ([py, "-c", "pass"], _env(ROOT))}
        commands |= {name: (cmd, _env(ROOT)) for name, cmd in _commands(py, arena).items()}
        if args.against is not None:
            other = _env(args.against.resolve())
            tag = f" ({args.against})"
            commands |= {name: (cmd, other) for name, cmd in _commands(py, arena, tag).items()}
        for cmd, env in commands.values():  # warm the page cache and the bytecode cache
            timed(cmd, env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, (cmd, env) in commands.items():
                times[name].append(timed(cmd, env))
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["python -c pass"]
    print(f"{sys.version.split()[0]}; {args.runs} runs each, round-robin, medians")
    width = max(map(len, medians)) + 2
    for name, m in medians.items():
        ratio = "" if name == "python -c pass" else f"   ({m / base:.1f}x python -c pass)"
        print(f"{name:{width}s}{m * 1000:7.1f} ms{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
