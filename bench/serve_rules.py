"""What serve's routing rules cost a request: the same requests with and without them.

    python bench/serve_rules.py [--requests 1000] [--rounds 4]

Two ``vramlock serve`` instances on temporary arenas, each serving two fake model
servers (tests/helpers/serving.py's, on this machine's CPU): one without rules, one
with a group of both models (``groups: {g: {members: [a, b]}}``). With rules, serve
looks whether a request's model is resident (the arena's lock state) before letting
it in. ``--requests`` sequential POSTs to the resident model on one keep-alive
connection per instance, the two instances alternating request by request so that the
machine's load weighs on both alike, ``--rounds`` times; the p50 and p90 of each.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.net import free_ports  # noqa: E402
from helpers.serving import FAKE_SERVER  # noqa: E402

WARM_UP = 20


def start(where: Path, rules: bool) -> tuple[subprocess.Popen[str], int]:
    """serve on a configuration of two fake models in ``where``; its port once it serves."""
    (where / "arena").mkdir(mode=0o700)
    (where / "fake.py").write_text(FAKE_SERVER)
    pa, pb, listen = free_ports(3)
    text = "logLevel: warn\n" + ("groups:\n  g:\n    members: [a, b]\n" if rules else "")
    text += "models:\n"
    for name, port in (("a", pa), ("b", pb)):
        text += (
            f"  {name}:\n    cmd: {sys.executable} {where}/fake.py {port} {name} {where}/log\n"
            f"    proxy: http://127.0.0.1:{port}\n    checkEndpoint: none\n"
            "    release: restart\n"
        )
    (where / "serve.yaml").write_text(text)
    env = {**os.environ, "VRAMLOCK_ARENA": str(where / "arena"), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "vramlock", "serve", str(where / "serve.yaml"),
            "--listen", str(listen)]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    if "serving" not in proc.stderr.readline():
        raise SystemExit("serve did not start")
    return proc, listen


def post(conn: http.client.HTTPConnection) -> None:
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "a"}))
    reply = conn.getresponse()
    reply.read()
    if reply.status != 200:
        raise SystemExit(f"status {reply.status}")


def measure(ports: dict[str, int], n: int) -> dict[str, list[float]]:
    conns = {
        what: http.client.HTTPConnection("127.0.0.1", p, timeout=60) for what, p in ports.items()
    }
    out: dict[str, list[float]] = {what: [] for what in ports}
    try:
        for i in range(n + WARM_UP):
            for what, conn in conns.items():
                t = time.perf_counter()
                post(conn)
                if i >= WARM_UP:
                    out[what].append(time.perf_counter() - t)
    finally:
        for conn in conns.values():
            conn.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        procs, ports = [], {}
        try:
            for what, rules in (("no rules", False), ("groups", True)):
                where = Path(tmp) / what.replace(" ", "-")
                where.mkdir()
                proc, port = start(where, rules)
                procs.append(proc)
                ports[what] = port
            times: dict[str, list[float]] = {what: [] for what in ports}
            for _ in range(args.rounds):
                for what, seen in measure(ports, args.requests).items():
                    times[what] += seen
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)
    for what, seen in times.items():
        q = statistics.quantiles(seen, n=10)
        print(f"{what:>8}: {len(seen)} requests, p50 {statistics.median(seen) * 1e3:.3f} ms,"
              f" p90 {q[8] * 1e3:.3f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
