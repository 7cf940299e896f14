"""Three real llama-servers on a VRAM budget: how many swaps, against an oracle's minimum.

    python bench/budget.py [--requests 60] [--seed 1] [--json PATH]

Needs the CPU llama-server that ``tools/llama_server.py`` builds and caches, and the tiny
model ``tools/tiny_gguf.py`` writes. No GPU is used: the footprints are declared, and the
budget is what the kernel locks enforce. Three servers are wrapped as

    vramlock run --vram 1G --demand listen --listen L --upstream U --release restart \\
        --min-hold 0 --idle 50ms -- sh -c 'echo >> STARTS; exec llama-server ...'

in one arena, and a client sends ``--requests`` requests, one at a time, in two orders:
round robin (A B C A B C ...) and a seeded random one. Each is run without a budget (the
token: one server at a time, as before budgets), on a budget of 3G (all three fit) and of
2G (two fit). A **swap** is a server started again after the
first three starts (each start appends a line to STARTS). The **oracle** is Belady's
schedule for the same order: with room for k servers, on a miss evict the one whose next
request is furthest away; its misses after the first k loads are the fewest swaps any
schedule needs. vramlock asks the least recently used idle server to step aside, which
cannot know the future: its policy gives the **LRU** schedule's swaps for the same order
(on a miss, evict the server whose last request is the oldest). Swaps above LRU are a bug
or a race in the waiter's choice; between Belady and LRU, luck (a choice made on stale
information that happened to suit the order).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
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
from helpers.net import accepts, free_port  # noqa: E402
from servers import end_jobs  # noqa: E402  (beside this file)

SERVERS = 3
FOOTPRINT = "1G"


def belady(order: list[int], room: int) -> int:
    """The fewest swaps (loads after the first ``room`` distinct ones) for ``order``."""
    loaded: set[int] = set()
    loads = 0
    for i, s in enumerate(order):
        if s in loaded:
            continue
        loads += 1
        if len(loaded) >= room:
            rest = order[i + 1 :]
            loaded.remove(max(loaded, key=lambda x: rest.index(x) if x in rest else len(rest)))
        loaded.add(s)
    return max(0, loads - min(room, len(set(order))))


def lru(order: list[int], room: int) -> int:
    """Swaps (loads after the first ``room`` distinct ones) when the least recently used
    server steps aside on a miss."""
    last: dict[int, int] = {}  # the loaded servers, and when each was last requested
    loads = 0
    for i, s in enumerate(order):
        if s not in last:
            loads += 1
            if len(last) >= room:
                del last[min(last, key=lambda x: last[x])]
        last[s] = i
    return max(0, loads - min(room, len(set(order))))


def request(port: int) -> None:
    end = time.monotonic() + 120
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            body = json.dumps({"prompt": "Hello", "n_predict": 1})
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            status, data = reply.status, reply.read()
        except (ConnectionError, OSError):
            status, data = 0, b""
        finally:
            conn.close()
        if status == 200:
            return
        if status not in (0, 503) or time.monotonic() > end:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        time.sleep(0.02)  # restarting: loading its model


def start_servers(
    binary: str, model: str, arena: Path, starts: list[Path], env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> list[int]:  # fmt: skip
    """``SERVERS`` llama-servers, each under ``vramlock run --release restart`` behind
    its proxy (appended to ``procs`` as they start; each start is a line in its file of
    ``starts``): their proxies' ports once all listen."""
    ports: list[int] = []
    for i in range(SERVERS):
        port, upstream = free_port(), free_port()
        server = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(upstream),
                  "-np", "1", "-c", "512", "-t", "1"]  # fmt: skip
        argv = [sys.executable, "-m", "vramlock", "run", "--arena", str(arena),
                "--vram", FOOTPRINT, "--name", f"s{i}",
                "--demand", "listen", "--listen", str(port), "--upstream", str(upstream),
                "--release", "restart", "--min-hold", "0", "--idle", "50ms", "--",
                "sh", "-c", f'echo >> {starts[i]}; exec "$0" "$@"', *server]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True,
                                      env=env))  # fmt: skip
        ports.append(port)
    for port in ports:
        end = time.monotonic() + 60
        while not accepts(port):
            if time.monotonic() > end:
                raise RuntimeError("a wrapper did not listen")
            time.sleep(0.01)
    return ports


def run_once(binary: str, model: str, budget: str, order: list[int]) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        arena = Path(tmp) / "arena"
        arena.mkdir(mode=0o700)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if budget != "none":
            subprocess.run(
                [sys.executable, "-m", "vramlock", "arena", "--arena", str(arena),
                 "--budget", budget],
                check=True,
                capture_output=True,
                env=env,
            )  # fmt: skip
        starts = [Path(tmp) / f"starts{i}" for i in range(SERVERS)]
        try:
            ports = start_servers(binary, model, arena, starts, env, procs)
            for i in range(SERVERS):
                request(ports[i])  # each loaded once: these are not swaps
            before = sum(len(p.read_text().splitlines()) for p in starts if p.exists())
            t0 = time.monotonic()
            for s in order:
                request(ports[s])
            seconds = time.monotonic() - t0
            after = sum(len(p.read_text().splitlines()) for p in starts if p.exists())
        finally:
            end_jobs(procs)
    room = 1 if budget == "none" else int(budget.rstrip("G")) // int(FOOTPRINT.rstrip("G"))
    # The warm-up loaded all three: with room for two, one was already out.
    warm = list(range(SERVERS))
    return {
        "budget": budget,
        "requests": len(order),
        "swaps": after - before,
        "oracle": belady(warm + order, room) - belady(warm, room),
        "lru": lru(warm + order, room) - lru(warm, room),
        "seconds": round(seconds, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    binary = llama_server.cached_binary()
    if binary is None:
        print("no llama-server built: run python tools/llama_server.py", file=sys.stderr)
        return 1
    import tiny_gguf

    model = str(tiny_gguf.cached_model())
    rng = random.Random(args.seed)
    orders = {
        "round robin": [k % SERVERS for k in range(args.requests)],
        "random": [rng.randrange(SERVERS) for _ in range(args.requests)],
    }
    results = []
    print(f"{SERVERS} llama-servers (CPU, tiny model), each --vram {FOOTPRINT}, --release restart")
    print("| order | budget | requests | swaps | LRU | oracle (Belady) | seconds |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, order in orders.items():
        for budget in ("none", "3G", "2G"):
            r = run_once(str(binary), model, budget, order)
            r["order"] = name
            results.append(r)
            print(
                f"| {name} | {budget} | {r['requests']} | {r['swaps']} | {r['lru']} | {r['oracle']}"
                f" | {r['seconds']} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
