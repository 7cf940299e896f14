"""Three PyTorch servers of 30 GiB on a 70 GiB budget of one GPU: NVML's peak against the budget.

    python bench/budget_gpu.py [--gib 30] [--budget 70G] [--vram measured|SIZE]
        [--release swap|checkpoint] [--handoffs 50] [--seed 1] [--gpu 0] [--json PATH]

Needs an NVIDIA GPU with PyTorch and NVML (nvidia-ml-py); without them it says so and
exits with status 1. Each server is tests/gpu_server.py holding ``--gib`` GiB, wrapped as

    vramlock run --arena A [--vram SIZE] --release swap --min-hold 0 \\
        --demand listen --listen L --upstream U -- python tests/gpu_server.py --gib 30

in one arena with ``--budget``. ``--vram measured`` (the default) declares nothing: each
server takes the whole budget until its first release, then NVML's peak plus 10 %. Two
servers fit in 70 GiB, three do not. After one request to each, a client sends requests
to servers picked at random (seeded) until ``--handoffs`` releases have happened, or
``--seconds`` have passed.

The witness is NVML, sampled every 5 ms by a thread of this script, not vramlock's own
account: the GPU's used memory less what was used before the servers started (which
counts what released servers keep: a swapped server keeps its CUDA context), and each
server's processes' memory. A **handoff** is a server whose memory fell from more than
half of ``--gib`` to less (a release, as NVML saw it). Reported: handoffs, the peak of
the total against the budget, the peak of the sum of the resident servers (those above
half of ``--gib``), request latency p50/p95, and PASS when the peak total never went
past the budget over at least ``--handoffs`` handoffs.
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.net import accepts, free_port  # noqa: E402
from servers import end_jobs, pct  # noqa: E402  (beside this file)

from vramlock import procfs  # noqa: E402
from vramlock.arena.budget import parse_size, show_size  # noqa: E402
from vramlock.gpu import nvml  # noqa: E402

SERVERS = 3
GIB = 1 << 30
SAMPLE_EVERY = 0.005
SERVER = ROOT / "tests" / "gpu_server.py"
PROMPTS = 4  # per server: its cache stays a few entries of 8 MiB


def cannot_run(gpu: int, budget: int) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if not nvml.available():
        return "NVML is not usable (pip install nvidia-ml-py)"
    total = nvml.gpu(gpu).total
    if total < budget:
        return f"GPU {gpu} has {total / GIB:.0f} GiB, less than the budget"
    return None


class Sampler(threading.Thread):
    """NVML every 5 ms: the GPU's used memory less ``baseline``, and each server's."""

    def __init__(self, gpu: int, baseline: int, wrappers: list[int], loaded: int) -> None:
        super().__init__(daemon=True)
        self.gpu, self.baseline, self.wrappers, self.loaded = gpu, baseline, wrappers, loaded
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.samples = 0
        self.peak_total = 0
        self.peak_resident = 0
        self.most_resident = 0
        self.handoffs = 0
        self.errors: list[str] = []
        self._was_loaded = [False] * len(wrappers)

    def run(self) -> None:
        pids: list[set[int]] = [set() for _ in self.wrappers]
        found_at = 0.0
        while not self.stop.wait(SAMPLE_EVERY):
            now = time.monotonic()
            if now - found_at > 0.2:  # a restarted server is a new pid
                pids = [{w, *procfs.descendants(w)} for w in self.wrappers]
                found_at = now
            try:
                total = nvml.gpu(self.gpu).used - self.baseline
                per_pid = nvml.processes(self.gpu)
            except nvml.NvmlError as err:
                self.errors.append(str(err))
                continue
            used = [sum(per_pid.get(p, 0) for p in mine) for mine in pids]
            resident = [u for u in used if u > self.loaded]
            with self.lock:
                self.samples += 1
                self.peak_total = max(self.peak_total, total)
                self.peak_resident = max(self.peak_resident, sum(resident))
                self.most_resident = max(self.most_resident, len(resident))
                for i, u in enumerate(used):
                    if self._was_loaded[i] and u <= self.loaded:
                        self.handoffs += 1
                    self._was_loaded[i] = u > self.loaded

    def reset_handoffs(self) -> None:
        with self.lock:
            self.handoffs = 0


def complete(port: int, prompt: str) -> float:
    """One request through a wrapper's listen port; its latency in seconds."""
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(
            "POST", "/complete", json.dumps({"prompt": prompt}),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        reply = conn.getresponse()
        body = reply.read()
    finally:
        conn.close()
    if reply.status != 200 or not json.loads(body).get("consistent"):
        raise RuntimeError(f"port {port}: HTTP {reply.status}: {body[:200]!r}")
    return time.monotonic() - start


def who(arena: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "vramlock", "who", "--arena", str(arena), "--json"],
        capture_output=True, text=True, env=env, timeout=30, check=True,
    ).stdout  # fmt: skip
    members: list[dict[str, Any]] = json.loads(out)["members"]
    return members


def footprint(member: dict[str, Any]) -> str:
    """``31G declared``, ``33.55G measured`` (as ``who`` has it at the end)."""
    if member["footprint"] is None:
        return "none"
    return f"{show_size(member['footprint'])} {member.get('footprint_from') or 'declared'}"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=30.0)
    parser.add_argument("--budget", default="70G")
    parser.add_argument("--vram", default="measured", help="measured, or a size: 31G")
    parser.add_argument("--release", choices=["swap", "checkpoint"], default="swap")
    parser.add_argument("--handoffs", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=170.0, help="for the random requests")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gpu", type=int, default=0, help="NVML index")
    parser.add_argument("--json", metavar="PATH")
    return parser.parse_args()


def start_servers(
    args: argparse.Namespace, arena: Path, logs: list[Path], env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> list[int]:  # fmt: skip
    """``SERVERS`` GPU servers, each under ``vramlock run`` behind its proxy (appended to
    ``procs`` as they start): their proxies' ports."""
    declared = [] if args.vram == "measured" else ["--vram", args.vram]
    ports = []
    for i in range(SERVERS):
        port, upstream = free_port(), free_port()
        argv = [sys.executable, "-m", "vramlock", "run", "--arena", str(arena),
                *declared, "--name", f"s{i}", "--release", args.release,
                "--min-hold", "0", "--demand", "listen",
                "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{upstream}",
                "--", sys.executable, str(SERVER), "--port", str(upstream),
                "--gib", str(args.gib), "--seed", str(i)]  # fmt: skip
        with open(logs[i], "wb") as log:
            procs.append(
                subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True, env=env)
            )
        ports.append(port)
    return ports


def listening(ports: list[int]) -> None:
    for port in ports:
        end = time.monotonic() + 60
        while not accepts(port):
            if time.monotonic() > end:
                raise RuntimeError("a wrapper did not listen within 60 s")
            time.sleep(0.01)


def random_requests(
    args: argparse.Namespace, ports: list[int], sampler: Sampler, latencies: list[float]
) -> tuple[int, float]:
    """Requests to servers drawn at random until ``--handoffs`` handoffs or ``--seconds``:
    how many, and in how long."""
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    requests = 0
    while sampler.handoffs < args.handoffs and time.monotonic() - t0 < args.seconds:
        i = rng.randrange(SERVERS)
        latencies.append(complete(ports[i], f"s{i} p{rng.randrange(PROMPTS)}"))
        requests += 1
    return requests, time.monotonic() - t0


def report(
    args: argparse.Namespace, budget: int, sampler: Sampler, figures: dict[str, Any],
    latencies: list[float], members: dict[str, Any],
) -> int:  # fmt: skip
    result = {
        "gib": args.gib,
        "budget_gib": budget / GIB,
        "vram": args.vram,
        "release": args.release,
        **figures,
        "handoffs": sampler.handoffs,
        "peak_total_gib": round(sampler.peak_total / GIB, 2),
        "peak_resident_sum_gib": round(sampler.peak_resident / GIB, 2),
        "most_resident": sampler.most_resident,
        "latency_p50_ms": round(pct(latencies, 0.5) * 1e3, 1),
        "latency_p95_ms": round(pct(latencies, 0.95) * 1e3, 1),
        "samples": sampler.samples,
        "nvml_errors": len(sampler.errors),
        "footprints": {n: footprint(m) for n, m in sorted(members.items())},
    }
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    within = sampler.peak_total <= budget
    enough = sampler.handoffs >= args.handoffs
    verdict = "PASS" if within and enough else "FAIL"
    print(
        f"{verdict}: peak {sampler.peak_total / GIB:.2f} GiB"
        f" {'<=' if within else '>'} budget {budget / GIB:.2f} GiB"
        f" over {sampler.handoffs} handoffs" + ("" if enough else f" (fewer than {args.handoffs})")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if verdict == "PASS" else 1


def main() -> int:
    args = parse()
    budget = parse_size(args.budget, "--budget")
    why = cannot_run(args.gpu, budget)
    if why is not None:
        print(f"budget_gpu.py: cannot run here: {why}", file=sys.stderr)
        return 1
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, CUDA_VISIBLE_DEVICES=nvml.gpu(args.gpu).uuid)
    procs: list[subprocess.Popen[bytes]] = []
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        arena = Path(tmp) / "arena"
        arena.mkdir(mode=0o700)
        subprocess.run(
            [sys.executable, "-m", "vramlock", "arena", "--arena", str(arena),
             "--budget", args.budget],
            check=True, env=env, timeout=30,
        )  # fmt: skip
        baseline = nvml.gpu(args.gpu).used
        logs = [Path(tmp) / f"s{i}.log" for i in range(SERVERS)]
        sampler: Sampler | None = None
        started = time.monotonic()
        try:
            ports = start_servers(args, arena, logs, env, procs)
            sampler = Sampler(args.gpu, baseline, [p.pid for p in procs], int(args.gib * GIB / 2))
            sampler.start()
            listening(ports)
            for i, port in enumerate(ports):  # each loaded once: not counted
                complete(port, f"s{i} p0")
            warm = time.monotonic() - started
            sampler.reset_handoffs()
            requests, seconds = random_requests(args, ports, sampler, latencies)
            members = {m["name"]: m for m in who(arena, env) if m["member"]}
        finally:
            if sampler is not None:
                sampler.stop.set()
                sampler.join(5)
            end_jobs(procs)
            for i, path in enumerate(logs):
                said = path.read_bytes().decode(errors="replace").strip() if path.exists() else ""
                if said:
                    print(f"--- s{i}:\n{said[-2000:]}", file=sys.stderr)
    assert sampler is not None
    figures = {"warm_up_s": round(warm, 1), "requests": requests, "seconds": round(seconds, 1)}
    return report(args, budget, sampler, figures, latencies, members)


if __name__ == "__main__":
    sys.exit(main())
