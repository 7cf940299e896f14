"""Two real llama-servers taking turns behind ``--demand listen``: restart vs the preset.

    python bench/servers.py [--alternations 50] [--ctx 4096] [--json PATH]

Needs the CPU llama-server that ``tools/llama_server.py`` builds and caches, and the tiny
model ``tools/tiny_gguf.py`` writes. For each of ``--release restart`` and ``--release http
--preset llama-server`` (one after the other, in one run), two servers are wrapped as

    vramlock run --demand listen --listen L --upstream U --min-hold 0 --idle 100ms ...

and a client alternates between them ``--alternations`` times, each time sending the same
long prompt (about ``--ctx`` tokens) to the server that was just released. Per request:

- **latency**: the whole request through the proxy, from send to the last byte, while the
  target was released (so it includes the other server's release and this one's restore);
- **first token**: the server's own ``timings.prompt_ms`` for that prompt, i.e. the prefill
  it had to do: all of it after a restart, only the new tokens with the restored slot.

Under both, the proxy holds a client until the server's ``/health`` says it has loaded:
the wait counts in the latency.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import llama_server  # noqa: E402
from netutil import accepts  # noqa: E402

MODES = {
    "restart": ["--release", "restart"],
    "preset": ["--release", "http", "--preset", "llama-server"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def request(port: int, prompt: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = json.dumps({"prompt": prompt, "n_predict": 1, "cache_prompt": True})
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        status, data = reply.status, reply.read()
    finally:
        conn.close()
    if status != 200:  # a 503 too: the proxy holds clients until the server has loaded
        raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
    timings: dict[str, Any] = json.loads(data)["timings"]
    return timings


def run_mode(mode: str, binary: str, model: str, ctx: int, n: int) -> dict[str, Any]:
    procs = []
    ports = []
    with tempfile.TemporaryDirectory() as arena:
        try:
            for _ in range(2):
                port, upstream = free_port(), free_port()
                argv = [sys.executable, "-m", "vramlock", "run", "--arena", arena,
                        "--demand", "listen", "--listen", str(port), "--upstream", str(upstream),
                        "--min-hold", "0", "--idle", "100ms", *MODES[mode], "--",
                        binary, "-m", model, "--host", "127.0.0.1", "--port", str(upstream),
                        "-np", "1", "-c", str(ctx), "-t", "2"]  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)),
                    )
                )
                ports.append(port)
            for port in ports:
                end = time.monotonic() + 30
                while not accepts(port):
                    if time.monotonic() > end:
                        raise RuntimeError("the wrapper did not listen")
                    time.sleep(0.01)
            words = "the quick brown fox jumps over the lazy dog " * (ctx // 12)
            prompts = [f"Server {i}: {words}" for i in range(2)]
            for i in range(2):
                request(ports[i], prompts[i])  # warm: each has its prompt in its slot once
            latency, prefill, cached = [], [], []
            for k in range(n):
                i = k % 2
                t0 = time.perf_counter()
                timings = request(ports[i], prompts[i])
                latency.append(time.perf_counter() - t0)
                prefill.append(float(timings["prompt_ms"]) / 1000)
                cached.append(int(timings.get("cache_n", 0)))
            return {"latency": latency, "prefill": prefill, "cache_n": cached}
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alternations", type=int, default=50)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    binary = llama_server.cached_binary()
    if binary is None:
        print("no llama-server built: run python tools/llama_server.py", file=sys.stderr)
        return 1
    import tiny_gguf

    model = str(tiny_gguf.cached_model())
    results = {m: run_mode(m, str(binary), model, args.ctx, args.alternations) for m in MODES}
    print(f"{args.alternations} alternations between two llama-servers (CPU, tiny model, "
          f"-c {args.ctx}), times in s")  # fmt: skip
    print("| release | latency p50 | latency p95 | prefill p50 | prefill p95 | cache_n p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(
            f"| {mode} | {statistics.median(r['latency']):.3f} | {pct(r['latency'], 0.95):.3f}"
            f" | {statistics.median(r['prefill']):.3f} | {pct(r['prefill'], 0.95):.3f}"
            f" | {statistics.median(r['cache_n']):.0f} |"
        )
    rs, ps = results["restart"], results["preset"]
    med = statistics.median
    first = med(rs["prefill"]) / med(ps["prefill"])
    whole = med(rs["latency"]) / med(ps["latency"])
    print(f"preset vs restart: first token (prefill) {first:.1f}x faster, request {whole:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
