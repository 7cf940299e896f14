"""Two real llama-servers taking turns behind ``--demand listen``: restart vs the preset,
and on a GPU swap, checkpoint and the Vulkan layer too.

    python bench/servers.py [--alternations 50] [--ctx 4096] [--json PATH] [--timeout S] [--trace]
    python bench/servers.py --binary CUDA_SERVER --model GGUF --ngl 99 --ctx 8192 \
        --prompt-tokens 3900 --alternations 20 --modes swap,checkpoint,preset,restart
    python bench/servers.py --binary VULKAN_SERVER --model GGUF --ngl 99 --ctx 8192 \
        --prompt-tokens 3900 --alternations 20 --modes swap-vulkan,preset

Each server's first release comes after its warm request and ``--settle`` idle seconds
(under swap its host copies are made ready meanwhile): the *first switch* is the request
server 1's first release served (the first alternation), beside the later ones' p50.
Server 0's first release served server 1's warm request, which is not shown there: it may
hold server 1's start too (its model's load), as server 1 may have taken the token first
and loaded before server 0, or not (the JSON has it, as ``warm_s``). *Released keeps* is
what NVML shows the server just released holding, after each request (a GPU only), and
after ``--pause`` idle seconds, if given, before the next request goes to it (long enough
under ``VRAMLOCK_PARK_AFTER=0`` for it to park: a cold parked return); the JSON has what
the one that answered held then (``held``): the difference is what a restore copies back.

By default it runs the CPU llama-server that ``tools/llama_server.py`` builds and caches,
with the tiny model ``tools/tiny_gguf.py`` writes (``--binary`` and ``--model`` name
others; ``--ngl`` puts that many layers on the GPU). For each of ``--modes`` (one after
the other, in one run: ``restart`` is ``--release restart``, ``preset`` is ``--release
http --preset llama-server``, ``swap``, ``checkpoint`` and ``swap-vulkan`` are those
releases, ``auto`` names none: vramlock's default, which picks one), two servers are
wrapped as

    vramlock run --demand listen --listen L --upstream U --min-hold 0 --idle 100ms ...

and a client alternates between them ``--alternations`` times, each time sending the same
long prompt (about ``--prompt-tokens`` tokens, by default most of ``--ctx``) to the server
that was just released. Per request:

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
import re
import shutil
import signal
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
from helpers.net import accepts, free_port  # noqa: E402

LOOKUP = re.compile(r"vramlock-swap: pid \d+: (dlsym|cuGetProcAddress) ")

MODES = {
    "restart": ["--release", "restart"],
    "preset": ["--release", "http", "--preset", "llama-server"],
    "swap": ["--release", "swap"],
    "checkpoint": ["--release", "checkpoint"],
    # A Vulkan llama-server (llama.cpp built with -DGGML_VULKAN=ON): the Vulkan layer.
    "swap-vulkan": ["--release", "swap-vulkan"],
    "auto": [],
}


def request(port: int, prompt: str, timeout: float = 120.0, **fields: object) -> dict[str, Any]:
    """POST /completion of ``prompt`` (one token, from the prompt cache, unless ``fields``
    say otherwise), waiting ``timeout`` seconds at most: the server's ``timings``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = json.dumps({"prompt": prompt, "n_predict": 1, "cache_prompt": True, **fields})
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        status, data = reply.status, reply.read()
    finally:
        conn.close()
    if status != 200:  # a 503 too: the proxy holds clients until the server has loaded
        raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
    timings: dict[str, Any] = json.loads(data)["timings"]
    return timings


def warm_request(port: int, prompt: str, timeout: float) -> dict[str, Any]:
    """``request``, again while the server answers 503 (loading its model: under swap
    the proxy lets a client in once the port accepts, which llama-server does as it
    loads)."""
    end = time.monotonic() + timeout
    while True:
        try:
            return request(port, prompt, max(1.0, end - time.monotonic()))
        except RuntimeError as err:
            if not str(err).startswith("HTTP 503") or time.monotonic() > end:
                raise
        time.sleep(0.2)


def held_by(wrapper: int) -> int | None:
    """What NVML shows the wrapper's command holding on the GPU (None: no NVML here)."""
    from vramlock.gpu import nvml
    from vramlock.procfs import descendants

    try:
        if not nvml.available():
            return None
        ours = set(descendants(wrapper))
        return sum(n for pid, n in nvml.processes().items() if pid in ours)
    except (nvml.NvmlUnavailable, nvml.NvmlError):
        return None


def start_pair(
    mode: str,
    server: list[str],
    arena: str,
    logs: list[Path],
    env: dict[str, str],
    procs: list[subprocess.Popen[Any]],
) -> list[int]:
    """Two wrappers of ``server`` under ``mode`` in ``arena`` (appended to ``procs`` as
    they start), their proxies' ports once both listen."""
    ports = []
    for log in logs:
        port, upstream = free_port(), free_port()
        argv = [sys.executable, "-m", "vramlock", "run", "--arena", arena,
                "--demand", "listen", "--listen", str(port), "--upstream", str(upstream),
                "--min-hold", "0", "--idle", "100ms", *MODES[mode], "--",
                *server, "--host", "127.0.0.1", "--port", str(upstream)]  # fmt: skip
        with open(log, "w") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=out,
                                          start_new_session=True, env=env))  # fmt: skip
        ports.append(port)
    for port in ports:
        end = time.monotonic() + 30
        while not accepts(port):
            if time.monotonic() > end:
                raise RuntimeError("the wrapper did not listen")
            time.sleep(0.01)
    return ports


def alternate(
    ports: list[int], procs: list[subprocess.Popen[Any]], prompt_tokens: int, n: int,
    timeout: float, settle: float, pause: float,
) -> dict[str, Any]:  # fmt: skip
    """Warm each server once, then ``n`` requests to each in turn: the figures."""
    # About ten tokens a repetition.
    words = "the quick brown fox jumps over the lazy dog " * (prompt_tokens // 10)
    prompts = [f"Server {i}: {words}" for i in range(2)]
    # Warm: each has its prompt in its slot once, then stays idle --settle seconds
    # (under swap the library makes its host copies ready meanwhile). Server 1's
    # warm request is server 0's first release (and may be server 1's start: which
    # loads first is the token's order), the first alternation server 1's.
    warm, firsts = [], []
    for i in range(2):
        t0 = time.perf_counter()
        warm.append(int(warm_request(ports[i], prompts[i], timeout)["prompt_n"]))
        firsts.append(time.perf_counter() - t0)
        time.sleep(settle)
    latency, prefill, cached, kept, held = [], [], [], [], []
    for k in range(n):
        i = k % 2
        t0 = time.perf_counter()
        try:
            timings = request(ports[i], prompts[i], timeout)
        except Exception as err:
            raise RuntimeError(f"request {k + 1} of {n}, to server {i}: {err}") from err
        latency.append(time.perf_counter() - t0)
        prefill.append(float(timings["prompt_ms"]) / 1000)
        cached.append(int(timings.get("cache_n", 0)))
        mine = held_by(procs[i].pid)  # the one that answered, resident
        if mine is not None:
            held.append(mine)
        time.sleep(pause)  # the one just released is asked next: idle that long
        other = held_by(procs[1 - i].pid)  # the one just released, as NVML sees it
        if other is not None:
            kept.append(other)
    return {"latency": latency, "prefill": prefill, "cache_n": cached, "prompt_n": warm,
            "first": [latency[0]], "warm_s": firsts, "kept": kept, "held": held}  # fmt: skip


def explain(mode: str, arena: str, logs: list[Path], env: dict[str, str]) -> None:
    """Why a mode failed, before the arena and the logs go: each member's state, each
    log's end."""
    who = [sys.executable, "-m", "vramlock", "who", "--arena", arena]
    shown = subprocess.run(who, env=env, capture_output=True, text=True, timeout=30)
    print(f"--- {mode}, vramlock who:", shown.stdout + shown.stderr, sep="\n")
    for log in logs:
        lines = log.read_text(errors="replace").splitlines()
        # The wrapper's own words whole, the rest's end without the library's
        # lookups (with --trace they are hundreds of lines).
        said = [ln for ln in lines if ln.startswith("vramlock:")]
        rest = [ln for ln in lines if not LOOKUP.search(ln)][-40:]
        print(f"--- {mode}, {log.name}, vramlock's lines:", *said, sep="\n")
        print(f"--- {mode}, {log.name}, its end:", *rest, sep="\n")


def run_mode(
    mode: str,
    server: list[str],
    prompt_tokens: int,
    n: int,
    timeout: float,
    trace: bool,
    settle: float = 0.0,
    keep: str | None = None,
    pause: float = 0.0,
) -> dict[str, Any]:
    procs: list[subprocess.Popen[Any]] = []
    # The tree under test first, then whatever the caller put on the path (pinned wheels).
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""))
    if trace:  # the swap library's trace of each release and restore, in the logs
        env["VRAMLOCK_SWAP_DEBUG"] = "1"
    with tempfile.TemporaryDirectory() as top:
        # The logs beside the arena, not in it: an arena holds only its own files.
        arena = str(Path(top) / "arena")
        os.mkdir(arena)
        logs = [Path(top) / f"server{i}.log" for i in range(2)]
        try:
            ports = start_pair(mode, server, arena, logs, env, procs)
            return alternate(ports, procs, prompt_tokens, n, timeout, settle, pause)
        except Exception:
            explain(mode, arena, logs, env)
            raise
        finally:
            end_jobs(procs)
            if keep:  # the wrappers' and servers' logs, where the caller asked
                for log in logs:
                    if log.exists():
                        shutil.copy(log, Path(keep) / f"{mode}-{log.name}")


def end_jobs(procs: list[subprocess.Popen[Any]]) -> None:
    """End the wrappers (SIGTERM to each group, so each ends its server and cleans up),
    SIGKILL what is still there 30 s later."""
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


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alternations", type=int, default=50)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, help="default: ctx * 5 / 6")
    parser.add_argument("--binary", help="llama-server (default: the cached CPU build)")
    parser.add_argument("--model", help="GGUF (default: tools/tiny_gguf.py's)")
    parser.add_argument("--ngl", type=int, help="layers on the GPU")
    parser.add_argument("--modes", default="restart,preset", help=f"of {', '.join(MODES)}")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds a request may take; past it, each member's state and each log's end",
    )
    parser.add_argument(
        "--trace", action="store_true", help="VRAMLOCK_SWAP_DEBUG=1 for the servers"
    )
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="copy each mode's server logs into DIR at its end"
    )
    parser.add_argument(
        "--settle", type=float, default=0.0, help="idle seconds after each warm request"
    )
    parser.add_argument(
        "--pause", type=float, default=0.0, help="idle seconds after each alternation"
    )
    return parser.parse_args()


def main() -> int:
    args = parse()
    binary = args.binary or llama_server.cached_binary()
    if binary is None:
        print("no llama-server built: run python tools/llama_server.py", file=sys.stderr)
        return 1
    if args.model:
        model = args.model
    else:
        import tiny_gguf

        model = str(tiny_gguf.cached_model())
    server = [str(binary), "-m", model, "-np", "1", "-c", str(args.ctx)]
    server += ["-t", "2"] if args.ngl is None else ["-ngl", str(args.ngl)]
    tokens = args.prompt_tokens or args.ctx * 5 // 6
    where = "CPU" if args.ngl is None else f"-ngl {args.ngl}"
    print(f"{args.alternations} alternations between two llama-servers ({where},"
          f" {Path(model).name}, -c {args.ctx}), times in s")  # fmt: skip
    print("| release | latency p50 | latency p95 | prefill p50 | prefill p95 | cache_n p50"
          " | prompt tokens | first switch | released keeps (MiB) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    results = {}
    for mode in args.modes.split(","):  # each row as soon as it is measured
        r = results[mode] = run_mode(
            mode,
            server,
            tokens,
            args.alternations,
            args.timeout,
            args.trace,
            args.settle,
            args.keep_logs,
            args.pause,
        )
        kept = r["kept"]
        shown = f"{min(kept) >> 20}-{max(kept) >> 20}" if kept else "-"
        print(
            f"| {mode} | {statistics.median(r['latency']):.3f} | {pct(r['latency'], 0.95):.3f}"
            f" | {statistics.median(r['prefill']):.3f} | {pct(r['prefill'], 0.95):.3f}"
            f" | {statistics.median(r['cache_n']):.0f} | {max(r['prompt_n'])}"
            f" | {' / '.join(f'{t:.3f}' for t in r['first'])} | {shown} |",
            flush=True,
        )
    if "restart" in results and "preset" in results:
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
