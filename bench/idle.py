"""CPU of an idle resident ``vramlock run`` that probes, beside a bare Python select() loop.

The target: an idle resident's probing costs at most 0.2 % of a core. The resident wraps a
child that speaks the control protocol (so ``--release auto`` picks ``signal`` and the wrapper
probes want.lock); nobody waits. CPU is utime + stime from /proc/PID/stat (clock ticks).

    python bench/idle.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vramlock.run.scheduler import PROBE_INTERVAL  # noqa: E402

CHILD = "from vramlock import child; import time; c = child.connect(); time.sleep(3600)"
BARE = f"import select\nwhile True: select.select([], [], [], {PROBE_INTERVAL})"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(pids: list[int], seconds: float) -> list[float]:
    """Per cent of one core used by each of ``pids`` over the same ``seconds``."""
    c0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(seconds)
    c1, t1 = [cpu_seconds(p) for p in pids], time.monotonic()
    return [100 * (b - a) / (t1 - t0) for a, b in zip(c0, c1, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="vramlock-idle-") as arena:
        run = [sys.executable, "-m", "vramlock", "run", "--arena", arena, "--"]
        resident = subprocess.Popen([*run, sys.executable, "-c", CHILD], env=env)
        bare = subprocess.Popen([sys.executable, "-c", BARE])
        try:
            deadline = time.monotonic() + 30
            who = [sys.executable, "-m", "vramlock", "who", "--arena", arena, "--json"]
            while (
                '"auto:signal"'
                not in subprocess.run(who, env=env, capture_output=True, text=True).stdout
            ):
                if time.monotonic() > deadline:
                    raise SystemExit("the resident never started probing")
                time.sleep(0.2)
            time.sleep(1.0)  # start-up is over
            ours, reference = measure([resident.pid, bare.pid], args.seconds)
        finally:
            for p in (resident, bare):
                p.terminate()
                p.wait(10)
    print(f"probe interval {PROBE_INTERVAL * 1000:g} ms, both over the same {args.seconds:g} s")
    print(f"idle resident vramlock run     {ours:6.3f} % of a core")
    print(f"bare select() loop, same rate  {reference:6.3f} % of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
