"""Slurm jobs that share a GPU take turns through vramlock, on a real single-node Slurm
(tests/helpers/slurm.py) with contrib/slurm installed: its SPANK plugin runs each task of
a job that got a GPU (here a shard of the one fake GPU) under ``vramlock run`` in the
GPU's arena, which the Prolog makes and the Epilog cleans.

The jobs run the swap test program on the fake CUDA driver (tests/fake_cuda): each job's
launches are logged, with their times, in a file of the test's. The witness that the
jobs are members of the arena, taking turns, is a member the test owns: while it holds
the token, neither job launches anything. Skipped where Slurm cannot run (not root, no
slurm-wlm, munge or libslurm-dev)."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import Spawn, wait_until
from helpers.slurm import Cluster, missing, running
from helpers.swap_rig import HOLDER, Fakes, build_fakes

from vramlock import procfs
from vramlock.gpu import swap

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]


@dataclass
class Gpu:
    """The fake GPU's programs and the environment that gives a job it."""

    cluster: Cluster
    fakes: Fakes
    env: dict[str, str]
    logs: Path

    def job(self, user: str, script: str, *options: str) -> tuple[str, Path]:
        """Submit ``script`` as ``user`` on a shard of the GPU: (job id, its launch log)."""
        tag = os.urandom(4).hex()
        log = self.logs / f"{tag}.launches"
        env = {**self.env, "FAKE_CUDA_LAUNCH_LOG": str(log),
               "FAKE_CUDA_PHYS": str(self.logs / f"{tag}.phys")}  # fmt: skip
        out = self.logs / f"{tag}.out"
        job = self.cluster.sbatch(user, script, "--gres=shard:1", "-o", str(out), *options,
                                  env=env)  # fmt: skip
        return job, log


@pytest.fixture(scope="module")
def gpu() -> Iterator[Gpu]:
    with running() as cluster:
        fakes_dir = cluster.top / "fakes"
        fakes_dir.mkdir(mode=0o755)
        fakes = build_fakes(fakes_dir)
        cache = cluster.top / "cache"
        cache.mkdir(mode=0o755)
        # The swap library, built once where both users read it (their own caches would
        # each build it: seconds of a loaded CPU inside their jobs).
        os.environ["XDG_CACHE_HOME"] = str(cache)
        try:
            swap.library_path()
        finally:
            del os.environ["XDG_CACHE_HOME"]
        subprocess.run(["chmod", "-R", "a+rX", str(cache), str(fakes_dir)], check=True)
        logs = cluster.top / "logs"
        logs.mkdir()
        logs.chmod(0o1777)
        env = {"LD_LIBRARY_PATH": str(fakes.directory), "XDG_CACHE_HOME": str(cache)}
        yield Gpu(cluster, fakes, env, logs)


def launches(log: Path) -> list[tuple[int, int]]:
    """The program's launches in ``log`` so far: (start, end), monotonic ns."""
    if not log.exists():
        return []
    text = log.read_text()
    found = []
    for line in text[: text.rfind("\n") + 1].splitlines():
        kind, start, end = line.split()
        if kind == "launch":
            found.append((int(start), int(end)))
    return found


def held_quietly(gpu: Gpu, spawn: Spawn, logs: list[Path]) -> None:
    """The test's own member takes the GPU's token for half a second: neither job
    launches anything meanwhile."""
    script = gpu.cluster.top / "holder.py"
    script.write_text(HOLDER)
    arena = gpu.cluster.arenas / "gpu0"
    holder = spawn([sys.executable, str(script), str(arena), "/dev/null"], stdin=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdin is not None
    got = int(holder.stdout.readline().split()[1])
    time.sleep(0.5)  # the quiet stretch watched: no condition ends it sooner
    holder.stdin.close()
    left = int(holder.stdout.readline().split()[1])
    assert holder.wait(10) == 0
    for log in logs:
        during = [s for s, _ in launches(log) if got <= s <= left]
        assert during == [], f"{log.name}: {len(during)} launches while the test held the GPU"


def switches(logs: list[Path]) -> tuple[int, int]:
    """(how often the GPU changed jobs, launches), in the order the launches began."""
    merged = sorted((s, i) for i, log in enumerate(logs) for s, _ in launches(log))
    changes = sum(1 for a, b in zip(merged, merged[1:], strict=False) if a[1] != b[1])
    return changes, len(merged)


def test_two_users_jobs_on_one_gpu_take_turns(gpu: Gpu, spawn: Spawn) -> None:
    alice, bob = gpu.cluster.users
    program = gpu.fakes.program
    jobs = [gpu.job(user, f"#!/bin/sh\nexec {program} 4\n") for user in (alice, bob)]
    logs = [log for _, log in jobs]
    wait_until(lambda: all(len(launches(log)) > 0 for log in logs), timeout=60, step=0.1)
    held_quietly(gpu, spawn, logs)
    for job, _ in jobs:
        assert gpu.cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60) == "COMPLETED"
    changes, total = switches(logs)
    assert 2 <= changes <= total // 20, (changes, total)


def test_a_job_that_opts_out_says_so(gpu: Gpu) -> None:
    job, log = gpu.job(gpu.cluster.users[0], "#!/bin/sh\necho ran\n", "--vramlock=off")
    assert gpu.cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60) == "COMPLETED"
    out = log.with_suffix(".out").read_text()
    assert out.splitlines()[-1] == "ran", out
    assert f"vramlock: job {job} opted out (--vramlock=off)" in out, out


def _uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


def left_of(job: str) -> list[int]:
    return [p for p in procfs.all_pids() if procfs.environ(p).get("SLURM_JOB_ID") == job]
