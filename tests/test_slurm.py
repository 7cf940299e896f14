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

import contextlib
import fcntl
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import Spawn, queued, wait_until
from helpers.slurm import CONTRIB, Cluster, missing, running
from helpers.swap_rig import HOLDER, Fakes, build_fakes, let_go, read_line
from prometheus_client.parser import text_string_to_metric_families

from vramlock import procfs
from vramlock.gpu import swap

pytestmark = pytest.mark.timeout(120)


@dataclass
class Gpu:
    """The fake GPU's programs and the environment that gives a job it."""

    cluster: Cluster
    fakes: Fakes
    env: dict[str, str]
    logs: Path
    overtime: str = ""  # a job over its time limit (Slurm's least: a minute), meanwhile

    def job(
        self, user: str, script: str, *options: str, env: dict[str, str] | None = None
    ) -> tuple[str, Path]:
        """Submit ``script`` as ``user`` on a shard of the GPU, ``env`` added to its
        environment: (job id, its launch log)."""
        tag = os.urandom(4).hex()
        log = self.logs / f"{tag}.launches"
        env = {**self.env, **(env or {}), "FAKE_CUDA_LAUNCH_LOG": str(log),
               "FAKE_CUDA_PHYS": str(self.logs / f"{tag}.phys")}  # fmt: skip
        out = self.logs / f"{tag}.out"
        job = self.cluster.sbatch(user, script, "--gres=shard:1", "-o", str(out), *options,
                                  env=env)  # fmt: skip
        return job, log


@pytest.fixture(scope="module")
def gpu() -> Iterator[Gpu]:
    why = missing()
    if why is not None:
        pytest.skip(why)
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
        made = Gpu(cluster, fakes, env, logs)
        # A process that leaves the job's tree and ignores SIGTERM, and a member that
        # takes turns with the other tests' jobs until the limit ends it.
        stray = "(setsid sh -c 'trap \"\" TERM; exec sleep 1000' &)"
        script = f"#!/bin/sh\n{stray}\nexec {fakes.program} 1000\n"
        made.overtime, _ = made.job(cluster.users[1], script, "--time=1")
        yield made


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
    changes = sum(1 for a, b in itertools.pairwise(merged) if a[1] != b[1])
    return changes, len(merged)


def test_two_users_jobs_on_one_gpu_take_turns(gpu: Gpu, spawn: Spawn) -> None:
    alice, bob, _ = gpu.cluster.users
    program = gpu.fakes.program
    jobs = [gpu.job(user, f"#!/bin/sh\nexec {program} 4\n") for user in (alice, bob)]
    logs = [log for _, log in jobs]
    wait_until(lambda: all(len(launches(log)) > 0 for log in logs), timeout=60, step=0.1)
    held_quietly(gpu, spawn, logs)
    for job, log in jobs:
        state = gpu.cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60)
        assert state == "COMPLETED", log.with_suffix(".out").read_text()
        assert "run --arena" not in gpu.cluster.cmd("squeue", "-h", "-j", job, "-o", "%o").stdout
    # Turns, not launches interleaved: the GPU changed jobs seldom (a third job, the one
    # over its time limit, takes turns too).
    changes, total = switches(logs)
    assert 1 <= changes <= total // 100, (changes, total)


def test_a_job_that_opts_out_says_so(gpu: Gpu) -> None:
    job, log = gpu.job(gpu.cluster.users[0], "#!/bin/sh\necho ran\n", "--vramlock=off")
    assert gpu.cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60) == "COMPLETED"
    out = log.with_suffix(".out").read_text()
    assert out.splitlines()[-1] == "ran", out
    assert f"vramlock: job {job} opted out (--vramlock=off)" in out, out


def test_a_step_inside_a_member_batch_job_runs_on_its_turn(gpu: Gpu) -> None:
    # A second member, the step's, would wait for the token its own batch step holds.
    script = f"#!/bin/sh\nsrun {gpu.fakes.program} 1\necho end $?\n"
    job, log = gpu.job(gpu.cluster.users[0], script)
    assert gpu.cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60) == "COMPLETED"
    out = log.with_suffix(".out").read_text()
    # The batch member's own words may follow (another job of the module's GPU waiting).
    ours = [line for line in out.splitlines() if not line.startswith("vramlock: ")]
    assert ours[-1:] == ["end 0"], out
    assert launches(log), out


def test_a_step_of_its_own_is_a_member(gpu: Gpu) -> None:
    # srun outside any batch job: an allocation of its own, one step, a member.
    member = "echo ${VRAMLOCK_TOKEN_FD:+member} $VRAMLOCK_ARENA"  # as vramlock run sets them
    cluster = gpu.cluster
    done = cluster.cmd("srun", "--gres=shard:1", "sh", "-c", member, user=cluster.users[1],
                       env={**cluster.env, **gpu.env})  # fmt: skip
    arena = cluster.arenas / "gpu0"
    assert (done.returncode, done.stdout) == (0, f"member {arena}\n"), done.stderr


def test_a_user_outside_the_gpus_group_is_told_why_the_job_cannot_start(gpu: Gpu) -> None:
    cluster = gpu.cluster
    job, log = gpu.job(cluster.users[2], "#!/bin/sh\necho ran\n")
    assert cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60) == "FAILED"
    assert log.with_suffix(".out").read_text() == (
        f"vramlock: job {job}: {cluster.users[2]} is not in group {cluster.group},"
        " whose jobs take turns on GPU 0\n"
    )
    done = cluster.cmd("scontrol", "show", "job", job, "-o")
    assert "ExitCode=125:0" in done.stdout.split(), done.stdout


def test_a_batch_job_cannot_pass_itself_off_as_inside_a_member(gpu: Gpu) -> None:
    # The environment a step inside a member's job has, given to a batch job by its user.
    cluster = gpu.cluster
    held = cluster.sbatch(cluster.users[0], "#!/bin/sh\ntrue\n", "--hold", env={})
    assert cluster.cmd("scancel", held).returncode == 0
    guess = str(int(held) + 1)
    script = "#!/bin/sh\necho ${VRAMLOCK_TOKEN_FD:+member}\n"  # vramlock run sets it
    job, log = gpu.job(cluster.users[0], script, f"--export=ALL,VRAMLOCK_SLURM_JOB={guess}")
    assert job == guess
    assert cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60) == "COMPLETED"
    out = log.with_suffix(".out").read_text()
    assert out.splitlines()[-1:] == ["member"], out


def test_a_wrong_word_for_the_option_is_refused_at_submission(gpu: Gpu) -> None:
    cluster = gpu.cluster
    script = cluster.top / "refused.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    done = cluster.cmd("sbatch", "--vramlock=maybe", str(script), user=cluster.users[0])
    assert done.returncode == 255  # sbatch's status for a bad option, as for its own
    assert done.stderr == "sbatch: error: Invalid --vramlock argument: maybe\n"


def left_of(job: str) -> list[int]:
    """The processes that have ``job``'s id in their environment."""
    return [p for p in procfs.all_pids() if procfs.environ(p).get("SLURM_JOB_ID") == job]


def records_of(arena: Path, job: str) -> list[str]:
    """The member records in ``arena`` of ``job``'s members."""
    found = []
    for path in (arena / "members").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("name", "").startswith(f"job{job}."):
                found.append(path.name)
    return found


def token_free(arena: Path) -> bool:
    """Nobody holds the arena's token (the test's own try at it)."""
    fd = os.open(arena / "token.lock", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def nothing_left(gpu: Gpu, job: str) -> None:
    """``job`` ended, its Epilog ran: no process of it, no record of it in the arena, and
    the node takes jobs."""
    wait_until(lambda: gpu.cluster.epilog_done(job), timeout=30, step=0.1)
    assert left_of(job) == []
    assert records_of(gpu.cluster.arenas / "gpu0", job) == []
    assert not gpu.cluster.node().startswith(("DRAIN", "DOWN")), gpu.cluster.node()


def test_a_job_cancelled_mid_turn_costs_the_other_nothing(gpu: Gpu) -> None:
    alice, bob, _ = gpu.cluster.users
    program = gpu.fakes.program
    # The other works until the test has seen it go on after the cancel (a run of fixed
    # length could be over by the time the victim's turn came).
    stop = gpu.logs / f"{os.urandom(4).hex()}.stop"
    (victim, victim_log), (other, other_log) = [
        gpu.job(user, f"#!/bin/sh\nexec {program} 60\n", env=env)
        for user, env in ((alice, {}), (bob, {"SWAP_PROG_STOP": str(stop)}))
    ]
    wait_until(lambda: len(launches(other_log)) > 0, timeout=60, step=0.05)
    seen = len(launches(victim_log))
    wait_until(lambda: len(launches(victim_log)) > seen, timeout=30, step=0.005)  # its turn
    done = gpu.cluster.cmd("scancel", victim, user=alice)
    assert done.returncode == 0, done.stderr
    cancelled = time.monotonic_ns()

    def the_other_goes_on() -> bool:
        return any(start > cancelled for start, _ in launches(other_log))

    wait_until(the_other_goes_on, timeout=30, step=0.05)
    stop.touch()
    assert gpu.cluster.wait_state(other, "COMPLETED", "FAILED", timeout=60) == "COMPLETED"
    assert gpu.cluster.state(victim) == "CANCELLED"
    out = other_log.with_suffix(".out").read_text()
    assert out.split()[:1] == ["ready"] and "done" in out, out  # its memory checked whole
    nothing_left(gpu, victim)


def test_a_job_over_its_time_limit_leaves_nothing_behind(gpu: Gpu) -> None:
    job = gpu.overtime
    assert gpu.cluster.wait_state(job, "TIMEOUT", "COMPLETED", "FAILED", timeout=110) == "TIMEOUT"
    nothing_left(gpu, job)
    assert token_free(gpu.cluster.arenas / "gpu0")  # the last job of the GPU


def test_the_node_writes_who_held_the_gpu_and_who_waited_as_metrics(gpu: Gpu) -> None:
    alice, bob, _ = gpu.cluster.users
    program = gpu.fakes.program
    jobs = {gpu.job(user, f"#!/bin/sh\nexec {program} 2\n")[0]: user for user in (alice, bob)}
    for job in jobs:
        assert gpu.cluster.wait_state(job, "COMPLETED", "FAILED", timeout=60) == "COMPLETED"
        wait_until(lambda: gpu.cluster.epilog_done(job), timeout=30, step=0.1)  # noqa: B023
    text = (gpu.cluster.textfiles / "vramlock.prom").read_text()
    held: dict[str, float] = {}
    waits: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("job") not in jobs:
                continue
            assert labels["user"] == jobs[labels["job"]] and labels["gpu"] == "0", labels
            assert labels["uuid"].startswith("GPU-"), labels  # the fake NVML's GPU 0
            if sample.name == "vramlock_job_resident_seconds_total":
                held[labels["job"]] = sample.value
            elif sample.name == "vramlock_job_waits_total":
                waits[labels["job"]] = sample.value
    assert set(held) == set(jobs) and all(v > 0 for v in held.values()), text
    assert sum(waits.values()) >= 1, text  # one of them waited for the other at least once


def node_side(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramlock.slurm", *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_the_epilog_ends_the_job_s_processes_and_no_others(spawn: Spawn, tmp_path: Path) -> None:
    def sleeper(job: str) -> subprocess.Popen[str]:
        return spawn(["sleep", "60"], env={**os.environ, "SLURM_JOB_ID": job})

    ours, theirs = sleeper("9001"), sleeper("9002")
    done = node_side("epilog", "9001", str(os.getuid()), str(tmp_path))
    assert (done.returncode, done.stderr) == (0, "")
    assert ours.wait(10) == -9
    assert theirs.poll() is None


def test_the_node_side_says_how_it_is_called() -> None:
    done = node_side("epilogue", "1")
    assert done.returncode == 2
    assert done.stderr == (
        "usage: python -m vramlock.slurm epilog JOB UID ARENAS | metrics ARENAS FILE\n"
    )


def test_metrics_that_cannot_be_written_say_why(tmp_path: Path) -> None:
    target = tmp_path / "absent" / "vramlock.prom"
    done = node_side("metrics", str(tmp_path), str(target))
    assert done.returncode == 1
    assert done.stderr == f"vramlock: {target}: No such file or directory\n"


def launcher(tmp_path: Path, gpus: str, *command: str) -> list[str]:
    """contrib/slurm/slurm-task as the plugin starts it, for a job of ``gpus``: its
    command line, and the arenas (``tmp_path/vramlock/gpu<N>``, made) in its environment."""
    arenas = tmp_path / "vramlock"
    arenas.mkdir(mode=0o755)
    for gpu in gpus.split(","):
        arena = arenas / f"gpu{gpu}"
        arena.mkdir(mode=0o700)
        done = subprocess.run([sys.executable, "-m", "vramlock", "arena", "--arena", str(arena)],
                              capture_output=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
    first = gpus.split(",")[0]
    env = (f"VRAMLOCK_SLURM_PROGRAM={command[0]}", f"VRAMLOCK_SLURM_ARENA={arenas}/gpu{first}",
           f"VRAMLOCK_SLURM_GPUS={gpus}", f"VRAMLOCK_SLURM_RUN={sys.executable} -m vramlock",
           "SLURM_JOB_ID=7", f"XDG_RUNTIME_DIR={tmp_path / 'own'}")  # fmt: skip
    return ["env", *env, str(CONTRIB / "slurm-task"), *command[1:]]


def test_a_job_of_several_gpus_waits_for_every_one_s_token(spawn: Spawn, tmp_path: Path) -> None:
    started = tmp_path / "started"
    command = launcher(tmp_path, "0,1", "/bin/sh", "-c",
                       f"echo $XDG_RUNTIME_DIR $VRAMLOCK_ARENAS_DIR > {started}")  # fmt: skip
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = spawn([sys.executable, str(script), str(tmp_path / "vramlock" / "gpu1"), "/dev/null"],
                   stdin=subprocess.PIPE)  # fmt: skip
    assert read_line(holder)[:1] == ["held"]
    job = spawn(command)
    wait_until(lambda: queued(job.pid), timeout=30)  # for GPU 1's token, the test's
    assert not started.exists()
    let_go(holder)
    assert job.wait(30) == 0
    # The job's XDG_RUNTIME_DIR is its own still; its arenas' directory is the node's.
    assert started.read_text() == f"{tmp_path / 'own'} {tmp_path / 'vramlock'}\n"


def test_the_launcher_is_for_the_plugin_only(tmp_path: Path) -> None:
    done = subprocess.run([str(CONTRIB / "slurm-task"), "true"], capture_output=True, text=True,
                          timeout=60, env={"PATH": os.defpath})  # fmt: skip
    assert done.returncode == 125
    assert done.stderr == "vramlock: slurm-task is started by the vramlock SPANK plugin only\n"
