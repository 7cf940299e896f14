"""``vramlock serve`` with real llama-servers: overhead, a burst, start-up, a switch.

    python bench/serve.py [--only overhead,burst,startup,switch] [--requests 500]
        [--burst 30] [--startups 10] [--switches 20] [--profile PATH] [--json PATH]
    python bench/serve.py --only switch --binary CUDA_SERVER --model GGUF --ngl 99 \
        --ctx 8192 --release swap

Needs the CPU llama-server that ``tools/llama_server.py`` builds and caches, and writes
three tiny models with ``tools/tiny_gguf.py`` (seeds 0-2). serve runs on a temporary
arena with one model per server, each under ``vramlock run`` as ``serve`` starts it.

- **overhead**: ``--requests`` sequential ``POST /tokenize`` (a request that costs the
  server microseconds, so the path is what is measured) on one keep-alive connection, to
  the resident model's server directly, through its wrapper's proxy, and through serve;
  the p50 and p90 of each, and the p50 each layer adds.
- **burst**: ``--burst`` requests sent at once, cycling over the three models (a b c a b
  c ...), from the settled state (one model resident); every answer's status, and the
  swaps seen in /proc (which server is alive, sampled every 3 ms) against the minimum
  (each model that was not resident loaded once).
- **startup**: ``--startups`` times, serve (three models, none preloaded) from exec to the
  first connection its port accepts, and to the first ``GET /health`` answered.
- **switch**: a request to a released model through serve and through ``vramlock run
  --demand listen``'s proxy side by side (two servers behind each; ``--binary``,
  ``--model``, ``--ngl``, ``--ctx`` and ``--release`` for a GPU run), ``--switches`` pairs.
- ``--profile PATH``: serve runs under cProfile, its stats written there at its end.
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import llama_server  # noqa: E402
import tiny_gguf  # noqa: E402
from helpers.net import accepts, free_ports  # noqa: E402

from vramlock import procfs  # noqa: E402

NAMES = ("a", "b", "c")


def post(conn: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    return reply.status, reply.read()


def latencies(ports: dict[str, int], n: int) -> dict[str, list[float]]:
    """``n`` rounds of one /tokenize request on each path (a keep-alive connection each),
    interleaved so that the machine's load weighs on every path alike: seconds each."""
    conns = {
        what: http.client.HTTPConnection("127.0.0.1", p, timeout=60) for what, p in ports.items()
    }
    body = {"model": "a", "content": "Hello world"}
    out: dict[str, list[float]] = {what: [] for what in ports}
    try:
        for i in range(n + 20):  # the first 20: warm-up (connections, caches)
            for what, conn in conns.items():
                t = time.perf_counter()
                status, _ = post(conn, "/tokenize", body)
                if i >= 20:
                    out[what].append(time.perf_counter() - t)
                assert status == 200, status
    finally:
        for conn in conns.values():
            conn.close()
    return out


def alive(binary: str, ports: dict[str, str]) -> list[str]:
    """Which models' servers are alive (by their --port), from /proc."""
    found = []
    for pid in procfs.all_pids():
        cmd = procfs.text(pid, "cmdline").split()
        if cmd and cmd[0] == binary and "--port" in cmd and procfs.living(pid):
            name = ports.get(cmd[cmd.index("--port") + 1])
            if name is not None:
                found.append(name)
    return found


def states(port: int) -> dict[str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v1/models")
        listing = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    return {m["id"]: m["state"] for m in listing["data"]}


def wait_settled(port: int, timeout: float = 60) -> dict[str, str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            now = states(port)
            if sorted(now.values()) == ["released", "released", "resident"]:
                return now
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise SystemExit("serve did not settle")


def startup(binary: str, work: Path, rounds: int) -> dict[str, Any]:
    """Seconds from serve's exec to the first connection its port accepts, and to the first
    ``GET /health`` answered, ``rounds`` times; three models, none preloaded."""
    lines = ["models:"]
    for name in NAMES:
        lines += [f"  {name}:", f"    cmd: {binary} --port ${{PORT}}"]
    config = work / "startup.yaml"
    config.write_text("\n".join(lines) + "\n")
    arena = work / "startup-arena"
    arena.mkdir(mode=0o700, exist_ok=True)
    accepted, answered = [], []
    for _ in range(rounds):
        port = free_ports(1)[0]
        argv = [sys.executable, "-m", "vramlock", "serve", str(config), "--listen", str(port)]
        env = {**os.environ, "VRAMLOCK_ARENA": str(arena)}
        began = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                    break
                except ConnectionRefusedError:
                    time.sleep(0.0005)
                if proc.poll() is not None:
                    raise SystemExit(f"serve exited with status {proc.returncode}")
            accepted.append(time.perf_counter() - began)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.recv(1024)
            answered.append(time.perf_counter() - began)
            sock.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    ms = {"accepting": accepted, "health answered": answered}
    return {
        what: {"p50_ms": statistics.median(v) * 1000, "max_ms": max(v) * 1000}
        for what, v in ms.items()
    }


def switch_config(work: Path, server: list[str], ports: list[int], release: str) -> Path:
    """serve's configuration for the switch: the two servers, preloaded."""
    lines = ["healthCheckTimeout: 60", "models:"]
    for name, port in zip(NAMES[:2], ports, strict=True):
        lines += [f"  {name}:", f"    cmd: {' '.join(server)} --host 127.0.0.1 --port {port}",
                  f"    proxy: http://127.0.0.1:{port}", f"    release: {release}",
                  "    min_hold: 0"]  # fmt: skip
    lines += ["hooks:", "  on_startup:", f"    preload: [{', '.join(NAMES[:2])}]"]
    config = work / "switch.yaml"
    config.write_text("\n".join(lines) + "\n")
    return config


def alternate(
    targets: dict[str, list[int]], n: int, prompt_tokens: int
) -> dict[tuple[str, str], list[float]]:
    """Each path's servers warmed, then ``n`` rounds of a pair of requests through each path
    in turn: the seconds of each, by path and by when it came."""
    words = "the quick brown fox jumps over the lazy dog " * (prompt_tokens // 10)
    prompts = [f"Server {i}: {words}" for i in range(2)]
    for ports in targets.values():  # warm: each has its prompt in its slot once
        for i in range(2):
            complete(ports[i], NAMES[i], prompts[i])
    # Rounds of a pair each, serve's and run's in turn: a pair's first request comes
    # after the other path's pair (a pause), its second right after the first.
    seconds: dict[tuple[str, str], list[float]] = {
        (what, when): [] for what in targets for when in WHEN
    }
    for _ in range(n):
        for what, ports in targets.items():
            for i, when in enumerate(WHEN):
                t = time.perf_counter()
                complete(ports[i], NAMES[i], prompts[i])
                seconds[what, when].append(time.perf_counter() - t)
    return seconds


def switch(
    server: list[str], work: Path, n: int, prompt_tokens: int, release: str
) -> dict[str, Any]:
    """A request to a released model, ``n`` times, through serve and through ``vramlock run
    --demand listen``'s proxy side by side: two servers behind each, serve's in one arena
    and run's in another (wrapped as bench/servers.py wraps them: ``--min-hold 0 --idle
    100ms``), a pair of requests (a, then b) through one, then a pair through the other.
    Latency: the whole request, the other server's release and this one's restore
    included; "right after" counts the time the other model is kept for its next request
    (serve's LINGER, run's --idle), "after a pause" does not."""
    arenas = {what: work / f"switch-{what}" for what in ("serve", "run")}
    for path in arenas.values():
        path.mkdir(mode=0o700)
    ups = free_ports(7)  # serve's two servers, run's two, serve, run's two wrappers
    serve_port, run_ports = ups[4], ups[5:]
    flags = ["--release", release, "--min-hold", "0"]
    config = switch_config(work, server, ups[:2], release)
    procs = []
    logs = open(work / "switch.log", "w")  # noqa: SIM115 (closed below)
    try:
        serve = [sys.executable, "-m", "vramlock", "serve", str(config)]
        serve += ["--listen", str(serve_port)]
        env = {**os.environ, "VRAMLOCK_ARENA": str(arenas["serve"])}
        procs.append(subprocess.Popen(serve, env=env, stdout=logs, stderr=logs))
        for listen, port in zip(run_ports, ups[2:4], strict=True):
            argv = [sys.executable, "-m", "vramlock", "run", "--arena", str(arenas["run"]),
                    "--demand", "listen", "--listen", str(listen), "--upstream", str(port),
                    "--idle", "100ms", *flags, "--", *server, "--host", "127.0.0.1",
                    "--port", str(port)]  # fmt: skip
            procs.append(subprocess.Popen(argv, stdout=logs, stderr=logs))
        for port in [serve_port, *run_ports]:
            end = time.monotonic() + 30
            while not accepts(port):
                if time.monotonic() > end:
                    raise SystemExit(f"nothing listens on {port}: {work / 'switch.log'}")
                time.sleep(0.01)
        targets = {"serve": [serve_port, serve_port], "run proxy": run_ports}
        seconds = alternate(targets, n, prompt_tokens)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
        logs.close()
    return {
        f"{what}, {when}": {
            "p50_s": statistics.median(v),
            "p90_s": statistics.quantiles(v, n=10)[8],
            "all_s": v,
        }
        for (what, when), v in seconds.items()
    }


WHEN = ("after a pause", "right after the other model")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def complete(port: int, model: str, prompt: str) -> None:
    """POST /completion of ``prompt``, one token, from the prompt cache; 200 expected."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        body = {"model": model, "prompt": prompt, "n_predict": 1, "cache_prompt": True}
        status, data = post(conn, "/completion", body)
    finally:
        conn.close()
    assert status == 200, (status, data[:200])


SECTIONS = ("overhead", "burst", "startup", "switch")


def overhead_and_burst(
    binary: str, work: Path, args: argparse.Namespace, sections: set[str]
) -> dict[str, Any]:
    """The overhead and burst sections, on one serve of three preloaded models."""
    arena = work / "arena"
    arena.mkdir(mode=0o700)
    serve_port, *upstreams = free_ports(4)
    lines = ["healthCheckTimeout: 60", "models:"]
    for seed, (name, port) in enumerate(zip(NAMES, upstreams, strict=True)):
        model = work / f"tiny-{seed}.gguf"
        tiny_gguf.write(model, llama_server.vocab_path(), seed=seed)
        lines += [f"  {name}:",
                  f"    cmd: {binary} -m {model} --host 127.0.0.1 --port {port} -np 1"
                  " -c 1024 -t 1",
                  f"    proxy: http://127.0.0.1:{port}"]  # fmt: skip
    # All three start with serve (models start on their first request otherwise):
    # the settled state is one resident, two released.
    lines += ["hooks:", "  on_startup:", f"    preload: [{', '.join(NAMES)}]"]
    config = work / "serve.yaml"
    config.write_text("\n".join(lines) + "\n")
    profile = ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
    argv = [sys.executable, *profile, "-m", "vramlock", "serve", str(config)]
    with open(work / "serve.log", "w") as log:
        serve = subprocess.Popen(
            [*argv, "--listen", str(serve_port)],
            env={**os.environ, "VRAMLOCK_ARENA": str(arena)},
            stdout=log,
            stderr=log,
        )
        try:
            wait_settled(serve_port)
            results: dict[str, Any] = {}
            if "overhead" in sections:
                results["overhead"] = overhead(arena, serve_port, upstreams[0], args.requests)
            if "burst" in sections:
                results["burst"] = burst(binary, serve_port, upstreams, args.burst)
            return results
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)


def overhead(arena: Path, serve_port: int, upstream: int, n: int) -> dict[str, Any]:
    """A resident, directly / through its wrapper's proxy / through serve."""
    conn = http.client.HTTPConnection("127.0.0.1", serve_port, timeout=60)
    post(conn, "/v1/completions", {"model": "a", "prompt": "Hi", "max_tokens": 1})
    conn.close()
    # the wrapper listens on a socket serve handed it: who says its address
    who_argv = [sys.executable, "-m", "vramlock", "who", "--arena", str(arena), "--json"]
    who = subprocess.run(who_argv, capture_output=True, text=True, check=True)
    wrapper_port = next(
        int(m["listen"].rsplit(":", 1)[1])
        for m in json.loads(who.stdout)["members"]
        if m["name"] == "a"
    )
    paths = {"server": upstream, "run proxy": wrapper_port, "serve": serve_port}
    over: dict[str, Any] = {}
    for what, seconds in latencies(paths, n).items():
        ms = [x * 1000 for x in seconds]
        q = statistics.quantiles(ms, n=10)
        over[what] = {"p50_ms": statistics.median(ms), "p90_ms": q[8]}
    for what in ("run proxy", "serve"):
        over[what]["added_p50_ms"] = over[what]["p50_ms"] - over["server"]["p50_ms"]
    return over


def burst(binary: str, serve_port: int, upstreams: list[int], n: int) -> dict[str, Any]:
    """``n`` requests at once over the three models, from the settled state."""
    before = wait_settled(serve_port)
    resident = next(name for name, s in before.items() if s == "resident")
    by_port = {str(p): name for name, p in zip(NAMES, upstreams, strict=True)}
    runs: list[str] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = alive(binary, by_port)
            if len(now) == 1 and (not runs or runs[-1] != now[0]):
                runs.append(now[0])
            time.sleep(0.003)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def one(i: int) -> int:
        c = http.client.HTTPConnection("127.0.0.1", serve_port, timeout=300)
        try:
            body = {"model": NAMES[i % 3], "prompt": "Hi", "max_tokens": 4}
            return post(c, "/v1/completions", body)[0]
        finally:
            c.close()

    started = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        statuses = list(pool.map(one, range(n)))
    took = time.monotonic() - started
    stop.set()
    sampler.join(5)
    swaps = len(runs) - 1 if runs and runs[0] == resident else len(runs)
    return {
        "requests": n,
        "answered_200": statuses.count(200),
        "seconds": took,
        "resident_before": resident,
        "servers_in_order": runs,
        "swaps": swaps,
        "minimum_swaps": len(set(NAMES) - {resident}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--burst", type=int, default=30)
    parser.add_argument("--startups", type=int, default=10)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"of {', '.join(SECTIONS)}")
    parser.add_argument("--switches", type=int, default=20, help="switch: requests per model")
    parser.add_argument("--binary", help="switch: llama-server (default: the cached CPU build)")
    parser.add_argument("--model", help="switch: its GGUF (default: tools/tiny_gguf.py's)")
    parser.add_argument("--ngl", type=int, help="switch: layers on the GPU")
    parser.add_argument("--ctx", type=int, default=4096, help="switch: -c")
    parser.add_argument("--release", default="auto", help="switch: every model's release")
    parser.add_argument("--profile", type=Path, help="run serve under cProfile, its stats here")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sections = set(args.only.split(","))
    if not sections <= set(SECTIONS):
        parser.error(f"--only: of {', '.join(SECTIONS)}")
    # The CPU build for every section but a switch given its own --binary (a GPU machine
    # need not build one).
    needs_cpu = bool(sections - {"switch"}) or not args.binary
    binary = str(llama_server.cached_binary() or llama_server.ensure()) if needs_cpu else ""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if sections & {"overhead", "burst"}:
            results.update(overhead_and_burst(binary, work, args, sections))
        if "startup" in sections:
            results["startup"] = startup(binary, work, args.startups)
        if "switch" in sections:
            model = args.model or str(tiny_gguf.cached_model())
            server = [args.binary or binary, "-m", model, "-np", "1", "-c", str(args.ctx)]
            server += ["-t", "2"] if args.ngl is None else ["-ngl", str(args.ngl)]
            tokens = args.ctx * 5 // 6
            results["switch"] = switch(server, work, args.switches, tokens, args.release)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
