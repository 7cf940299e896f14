"""Wall time of ``vramlock who`` (and ``--json``) with N members, beside ``python -c pass``
in the same run.

The target: ``who`` with 64 members in at most 100 ms. Run it once with bytecode caching
on (``env -u PYTHONDONTWRITEBYTECODE``), so that vramlock's caches exist, as an installed
package has them: without them every run compiles it again. One member holds the token, the
others wait for it (each a process using ``vramlock.arena.member.Member``, so each has a record),
and both commands are run alternately ``--runs`` times; the medians are reported.

    python bench/who.py [--members 64] [--runs 20]
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

MEMBER = """
import sys, time
from vramlock.arena.directory import Arena
from vramlock.arena.member import Member
m = Member(Arena.open(sys.argv[1]), name=f"member-{sys.argv[2]}", command=["sleep", "600"])
m.acquire()
print("resident", flush=True)
time.sleep(600)
"""


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="vramlock-who-") as arena:
        procs = []
        try:
            for i in range(args.members):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", MEMBER, arena, str(i)],
                        env=env,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
                if i == 0:
                    assert procs[0].stdout is not None
                    procs[0].stdout.readline()  # the first one is resident
            who = [sys.executable, "-m", "vramlock", "who", "--arena", arena]
            deadline = time.monotonic() + 60
            while True:  # every member is in place: one resident, the rest waiting
                out = subprocess.run(who, env=env, capture_output=True, text=True).stdout
                if out.count("waiting") == args.members - 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            rows = out.count("waiting") + out.count("resident")
            base, cli, as_json = [], [], []
            for _ in range(args.runs):
                base.append(timed([sys.executable, "-c", "pass"], env))
                cli.append(timed(who, env))
                as_json.append(timed([*who, "--json"], env))
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.communicate()
    b, c, j = statistics.median(base), statistics.median(cli), statistics.median(as_json)
    print(f"members listed: {rows} of {args.members}; {args.runs} runs each, medians")
    print(f"python -c pass      {b * 1000:7.1f} ms")
    print(f"vramlock who        {c * 1000:7.1f} ms   ({c / b:.1f}x python -c pass)")
    print(f"vramlock who --json {j * 1000:7.1f} ms   ({j / b:.1f}x python -c pass)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
