"""``--gpu 0,1``: one member of several GPUs' arenas, every token or none.

No GPU is needed: the arenas are the default ones under the test's own runtime
directory, and the witnesses are the kernel's lock table (who holds or waits for
each token.lock) and test-owned flock files the commands take.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, hold, kill_group, token_free, wait_until

from vramlock import procfs

pytestmark = pytest.mark.timeout(90)


def arena_of(gpu: int) -> Path:
    """GPU ``gpu``'s default arena, created (with its lock files) by ``vramlock arena``."""
    out = subprocess.run(
        vramlock("arena", "--gpu", str(gpu)), capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def locks(arena: Path) -> tuple[list[int], list[int]]:
    """(holders, queued) of the arena's token.lock, from /proc/locks."""
    st = (arena / "token.lock").stat()
    entries = procfs.parse_proc_locks(procfs.read_proc_locks(), st.st_dev, st.st_ino)
    return [e.pid for e in entries if not e.blocked], [e.pid for e in entries if e.blocked]


def env_of(path: Path) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in path.read_text().splitlines() if line.startswith("CUDA_")
    )


def test_the_command_starts_only_with_every_token(spawn: Spawn, tmp_path: Path) -> None:
    gpu0, gpu1 = arena_of(0), arena_of(1)
    blocker = hold(spawn, gpu1 / "token.lock")
    env_file = tmp_path / "env"
    job = spawn(
        vramlock("run", "--gpu", "1,0", "--release", "none", "--",
                 "sh", "-c", f"env > {env_file}; exec sleep 60")
    )  # fmt: skip
    # Tokens in ascending order: it holds GPU 0's and queues for GPU 1's, held by flock(1).
    wait_until(lambda: locks(gpu0)[0] == [job.pid] and locks(gpu1)[1] == [job.pid])
    time.sleep(0.3)
    assert not env_file.exists(), "the command started without GPU 1's token"
    kill_group(blocker)
    wait_until(env_file.exists)
    wait_until(lambda: "CUDA_DEVICE_ORDER" in env_of(env_file))
    # The command sees the GPUs in the order given: its device 0 is GPU 1.
    assert env_of(env_file) == {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert locks(gpu0)[0] == [job.pid] and locks(gpu1)[0] == [job.pid]
    for arena in (gpu0, gpu1):
        (me,) = who_json(arena)
        assert (me["state"], me["gpus"]) == ("resident", [1, 0])
        assert "GPUs 1,0 together" in me["note"]


def test_a_job_half_way_through_its_tokens_is_shown_waiting(spawn: Spawn) -> None:
    gpu0, gpu1 = arena_of(0), arena_of(1)
    blocker = hold(spawn, gpu1 / "token.lock")
    job = spawn(vramlock("run", "--gpu", "0,1", "--release", "none", "--", "sleep", "60"))
    wait_until(lambda: locks(gpu0)[0] == [job.pid] and locks(gpu1)[1] == [job.pid])
    for arena in (gpu0, gpu1):
        (me,) = [m for m in who_json(arena) if m["pid"] == job.pid]
        assert me["state"] == "waiting"
        assert "taking its GPUs' tokens" in me["note"]
    kill_group(blocker)
    wait_until(lambda: [m["state"] for m in who_json(gpu0)] == ["resident"])


def test_a_gpu_number_in_cuda_visible_devices_is_checked_as_gpu_is(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="99999999999")
    for args in (["run", "--", "true"], ["who"], ["wait", "-n"]):
        out = subprocess.run(vramlock(*args), capture_output=True, text=True, timeout=30, env=env)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("vramlock: CUDA_VISIBLE_DEVICES: expected a GPU number")
        assert out.stderr.count("\n") == 1
    assert not (tmp_path / "runtime" / "vramlock").exists()  # nothing was locked or made


def test_two_jobs_never_hold_each_others_token(spawn: Spawn, tmp_path: Path) -> None:
    """The order is the GPUs', not the command line's: a job asking for 1,0 queues for
    GPU 0 first, so it cannot hold GPU 1 while another job holding GPU 0 waits for it."""
    gpu0, gpu1 = arena_of(0), arena_of(1)
    blocker = hold(spawn, gpu1 / "token.lock")
    first = spawn(vramlock("run", "--gpu", "0,1", "--release", "restart", "--", "sleep", "60"))
    wait_until(lambda: first.pid in locks(gpu1)[1])
    second = spawn(vramlock("run", "--gpu", "1,0", "--release", "restart", "--", "sleep", "60"))
    wait_until(lambda: second.pid in locks(gpu0)[1])
    time.sleep(0.3)
    assert second.pid not in [*locks(gpu1)[0], *locks(gpu1)[1]]
    kill_group(blocker)
    # first gets GPU 1, starts, is asked to leave by second, which then holds both.
    wait_until(lambda: locks(gpu0)[0] == [second.pid] and locks(gpu1)[0] == [second.pid], 30)


WITNESS = (
    # Test-owned locks, one per GPU, taken without waiting by the command's processes:
    # a command that starts while another one that uses the same GPU still runs logs CLASH.
    'flock -n -E 99 "$W0" flock -n -E 99 "$W1" sh -c \'echo "$NAME" >> "$LOG"; exec sleep 60\';'
    ' test $? -eq 99 && echo "CLASH $NAME" >> "$LOG"'
)


def test_jobs_of_one_and_two_gpus_take_turns(spawn: Spawn, tmp_path: Path) -> None:
    """Two jobs of GPUs 0 and 1 (asked for in both orders) and one of GPU 1 alone, all
    under restart: they keep taking turns, none starts while one that shares a GPU
    with it runs, and none is stuck."""
    log = tmp_path / "log"
    w0, w1, unused = tmp_path / "w0", tmp_path / "w1", tmp_path / "unused"
    jobs = [
        ("a", "0,1", w0, w1),
        ("b", "1,0", w0, w1),
        ("c", "1", unused, w1),
    ]
    for name, gpus, first, second in jobs:
        env = dict(os.environ, W0=str(first), W1=str(second), NAME=name, LOG=str(log))
        spawn(
            vramlock("run", "--gpu", gpus, "--release", "restart", "--min-hold", "0.2",
                     "--", "sh", "-c", WITNESS),
            env=env,
        )  # fmt: skip

    def starts() -> dict[str, int]:
        lines = log.read_text().splitlines() if log.exists() else []
        assert not [line for line in lines if line.startswith("CLASH")], lines
        return {name: lines.count(name) for name, *_ in jobs}

    wait_until(lambda: min(starts().values()) >= 3, 60)


def test_a_killed_wrapper_leaves_every_token_to_its_command(spawn: Spawn) -> None:
    gpu0, gpu1 = arena_of(0), arena_of(1)
    job = spawn(vramlock("run", "--gpu", "0,1", "--release", "none", "--", "sleep", "60"))
    wait_until(lambda: locks(gpu1)[0] == [job.pid] and procfs.children(job.pid))
    (command,) = procfs.children(job.pid)
    job.send_signal(signal.SIGKILL)
    job.wait(10)
    assert not token_free(gpu0) and not token_free(gpu1)
    os.kill(command, signal.SIGKILL)
    wait_until(lambda: token_free(gpu0) and token_free(gpu1))


def test_wait_takes_every_token_and_gives_them_back(spawn: Spawn) -> None:
    gpu0, gpu1 = arena_of(0), arena_of(1)
    done = subprocess.run(vramlock("wait", "--gpu", "0,1", "-w", "10"), timeout=30)
    assert done.returncode == 0
    assert token_free(gpu0) and token_free(gpu1)
    blocker = hold(spawn, gpu1 / "token.lock")
    failed = subprocess.run(
        vramlock("wait", "--gpu", "1,0", "-w", "0.3", "-E", "7"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert failed.returncode == 7
    assert failed.stderr == "vramlock: token not obtained within 0.3 s\n"
    # What it got of GPU 0 was given back when GPU 1's did not come.
    assert token_free(gpu0)
    kill_group(blocker)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--gpu", "0,x", "--", "true"], "--gpu: expected a GPU number or a comma"),
        (["run", "--gpu", "", "--", "true"], "--gpu: expected a GPU number"),
        (["run", "--gpu", "-1", "--", "true"], "--gpu: expected a GPU number"),
        (["wait", "--gpu", "0,,1"], "--gpu: expected a GPU number"),
        (["run", "--arena", "ARENA", "--gpu", "0,1", "--", "true"], "--arena names one arena"),
        (["wait", "--arena", "ARENA", "--gpu", "0,1"], "--arena names one arena"),
        (["wait", "--gpu", "0,1", "--fd", "0"], "--fd locks one descriptor"),
        (["who", "--gpu", "0;1"], "--gpu: expected a GPU number"),
        (["arena", "--gpu", "1,-2"], "--gpu: expected a GPU number"),
        (["who", "--arena", "ARENA", "--gpu", "1,0"], "--arena names one arena"),
        (["arena", "--arena", "ARENA", "--gpu", "0,1"], "--arena names one arena"),
    ],
)
def test_bad_gpu_lists_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    arena = tmp_path / "arena"
    arena.mkdir(mode=0o700)
    argv = [str(arena) if a == "ARENA" else a for a in args]
    out = subprocess.run(vramlock(*argv), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"vramlock: {message}"), out.stderr
    assert out.stderr.count("\n") == 1
    assert not (tmp_path / "runtime" / "vramlock").exists()  # nothing was locked or made


def test_one_gpu_in_a_list_is_that_gpu(spawn: Spawn) -> None:
    gpu1 = arena_of(1)
    job = spawn(vramlock("run", "--gpu", "1,1", "--release", "none", "--", "sleep", "60"))
    wait_until(lambda: locks(gpu1)[0] == [job.pid])
    (me,) = who_json(gpu1)
    assert me["gpus"] is None  # a member of one arena
    out = subprocess.run(
        vramlock("who", "--gpu", "1", "--json"), capture_output=True, text=True, timeout=30
    )
    assert json.loads(out.stdout)["members"][0]["pid"] == job.pid


def test_who_and_arena_show_every_gpu_named(spawn: Spawn) -> None:
    job = spawn(vramlock("run", "--gpu", "1,0", "--release", "none", "--", "sleep", "60"))
    paths = subprocess.run(
        vramlock("arena", "--gpu", "1,0"), capture_output=True, text=True, check=True
    ).stdout.split()
    assert paths == [str(arena_of(0)), str(arena_of(1))]  # ascending, a line each
    wait_until(lambda: locks(arena_of(1))[0] == [job.pid])
    shown = subprocess.run(
        vramlock("who", "--gpu", "1,0", "--json"), capture_output=True, text=True, check=True
    ).stdout
    documents = json.loads(shown)
    assert [d["arena"] for d in documents] == paths
    assert [[m["pid"] for m in d["members"]] for d in documents] == [[job.pid], [job.pid]]
    plain = subprocess.run(
        vramlock("who", "--gpu", "0,1"), capture_output=True, text=True, check=True
    ).stdout
    blocks = plain.split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [f"arena {p}" for p in paths]
    assert all("GPUs 1,0 together" in b for b in blocks)
