"""The unload of a model ``vramlock serve`` cannot release: from the request to its 200.

    python bench/unload.py [--rounds 5] [--unload-timeout 10] [--json PATH]

A model of a small HTTP server that is neither an engine nor a CUDA program (``auto``
finds no way to release it) is what llama-swap stops with SIGTERM, then SIGKILL after
``unloadTimeout``; serve does the same. Two servers: one that obeys SIGTERM, one that
ignores it and leaves a daemon of its own (``setsid``, deaf too). Each round: a request
starts the model, then ``POST /api/models/unload/MODEL`` is timed until its answer, and
the servers' pids are looked up in /proc to check that nothing of the model is left.
Target: the deaf one within ``unloadTimeout`` + 0.5 s, the obedient one at once.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.net import answers_health, free_port, free_ports  # noqa: E402
from test_serve_unload import STUBBORN  # noqa: E402

from vramlock import procfs  # noqa: E402


def ask(port: int, method: str, path: str, body: object = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body))
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def config(tmp: Path, unload_timeout: float) -> str:
    script = tmp / "stubborn.py"
    script.write_text(STUBBORN)
    lines = [f"startPort: {free_port()}", "healthCheckTimeout: 120",
             f"unloadTimeout: {unload_timeout:g}", "models:"]  # fmt: skip
    for name, port in zip(("obeys", "deaf"), free_ports(2), strict=True):
        lines += [f"  {name}:",
                  f"    cmd: {sys.executable} {script} {port} {tmp / name}.pids",
                  f"    proxy: http://127.0.0.1:{port}"]  # fmt: skip
        if name == "deaf":
            lines.append("    env: [DEAF=1, DAEMON=1]")
    return "\n".join(lines) + "\n"


def pids(tmp: Path, name: str) -> list[int]:
    path = tmp / f"{name}.pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def round_trip(port: int, tmp: Path, name: str) -> tuple[float, int]:
    """One start and unload of ``name``: the unload's seconds, and how many of its
    processes outlived it."""
    (tmp / f"{name}.pids").unlink(missing_ok=True)
    status, _ = ask(port, "POST", "/v1/chat/completions", {"model": name})
    assert status == 200, status
    want = 2 if name == "deaf" else 1
    end = time.monotonic() + 30
    while len(pids(tmp, name)) < want and time.monotonic() < end:
        time.sleep(0.01)
    began = time.monotonic()
    status, body = ask(port, "POST", f"/api/models/unload/{name}")
    took = time.monotonic() - began
    assert status == 200, (status, body)
    return took, sum(procfs.living(p) for p in pids(tmp, name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--unload-timeout", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vramlock-unload-") as where:
        tmp = Path(where)
        arena = tmp / "arena"
        arena.mkdir(mode=0o700)
        path = tmp / "serve.yaml"
        path.write_text(config(tmp, args.unload_timeout))
        port = free_port()
        serve = subprocess.Popen(
            [sys.executable, "-m", "vramlock", "serve", str(path), "--listen", str(port)],
            env={**os.environ, "VRAMLOCK_ARENA": str(arena), "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            end = time.monotonic() + 30
            while not answers_health(port):
                assert serve.poll() is None and time.monotonic() < end, "serve did not start"
                time.sleep(0.05)
            out: dict[str, Any] = {"unloadTimeout": args.unload_timeout}
            for name in ("obeys", "deaf"):
                runs = [round_trip(port, tmp, name) for _ in range(args.rounds)]
                times = sorted(t for t, _ in runs)
                out[name] = {"seconds": times, "left": sum(n for _, n in runs),
                             "p50": statistics.median(times), "max": times[-1]}  # fmt: skip
                left = out[name]["left"]
                print(f"{name:6} unload: p50 {out[name]['p50']:.3f} s, max {times[-1]:.3f} s"
                      f" over {args.rounds} rounds; processes left: {left}")  # fmt: skip
        finally:
            serve.terminate()
            serve.wait(60)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
