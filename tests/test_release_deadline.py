"""Every release has a deadline: a process of the command that does not answer one
(stopped, or connected and deaf) makes it refused, and the command stays resident.

Witnesses: the test's own member (helpers/swap_rig.py's HOLDER), which queues for the
token and says when it holds it; the fake driver's physical memory count; ``who``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, queued, wait_until
from helpers.swap_rig import DEAF_PEER, Rig, let_go, read_line

from vramlock import procfs

pytestmark = pytest.mark.timeout(120)


def _note(arena: Path, name: str) -> str:
    rows = [r for r in who_json(arena) if r["name"] == name]
    return (rows[0]["note"] or "") if rows else ""


def _holds(holder: subprocess.Popen[str]) -> bool:
    """Has the test's member said it holds the token (without waiting for it)?"""
    assert holder.stdout is not None
    return bool(select.select([holder.stdout], [], [], 0)[0])


def test_a_stopped_cuda_process_makes_the_release_refused(rig: Rig, spawn: Spawn) -> None:
    """The release waited for ever, saying nothing, while who said "child stopped"."""
    stop = rig.tmp / "stop"
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--name", "job", "--release", "swap", "--",
                 str(rig.fakes.program), "60"),
        env=dict(rig.env, SWAP_PROG_STOP=str(stop)),
    )  # fmt: skip
    assert read_line(job) == ["ready"]
    (program,) = procfs.children(job.pid)
    held = int(rig.phys.read_text())
    os.kill(program, signal.SIGSTOP)
    holder = rig.holder(spawn)
    refused = f"release refused: process {program} of the command is stopped"
    note = f"release refused: process {program} is stopped"
    wait_until(lambda: note in _note(rig.arena, "job"), timeout=20)
    assert "child stopped" in _note(rig.arena, "job")
    assert queued(holder.pid) and not _holds(holder)  # the waiter waits on
    assert int(rig.phys.read_text()) == held  # nothing was released
    os.kill(program, signal.SIGCONT)
    assert read_line(holder)[0] == "held"  # the next try releases it
    assert int(rig.phys.read_text()) < held
    assert _note(rig.arena, "job") == ""  # said no more once a release went through
    let_go(holder)
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-2] == "done", err
    assert err.splitlines() == [
        f"vramlock: {refused} and cannot release its memory; staying resident"
    ]


def test_a_process_that_said_hello_and_then_nothing_makes_the_release_refused(
    rig: Rig, spawn: Spawn
) -> None:
    """The release waited for ever for its answer; now --release-within bounds it."""
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--name", "job", "--release", "swap",
                 "--release-within", "0.5", "--", sys.executable, "-c", DEAF_PEER),
        env=rig.env, graceful=True,
    )  # fmt: skip
    assert read_line(job) == ["resident"]
    (deaf,) = procfs.children(job.pid)
    holder = rig.holder(spawn)
    refused = (
        f"release refused: process {deaf} of the command did not answer the release"
        " within 0.5 s (--release-within)"
    )
    note = f"release refused: process {deaf} did not answer in 0.5 s"
    wait_until(lambda: _note(rig.arena, "job") == note, timeout=20)
    assert queued(holder.pid) and not _holds(holder)  # the waiter waits on
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    assert f"vramlock: {refused}; staying resident" in err.splitlines()
    assert "Traceback" not in err


def test_a_stopped_cuda_process_has_its_checkpoint_refused(rig: Rig, spawn: Spawn) -> None:
    """A checkpoint's lock waited on a stopped process (30 s, then failed, again and
    again); now it is refused at once, and the waiter told."""
    states = rig.tmp / "checkpoint"
    states.mkdir()
    stop = rig.tmp / "stop"
    env = dict(rig.env, LD_LIBRARY_PATH=str(rig.fakes.checkpoint_directory),
               FAKE_CUDA_CKPT_DIR=str(states), SWAP_PROG_STOP=str(stop))  # fmt: skip
    job = spawn(
        vramlock("run", "--arena", str(rig.arena), "--name", "job", "--release", "checkpoint",
                 "--", str(rig.fakes.program), "60"),
        env=env,
    )  # fmt: skip
    assert read_line(job) == ["ready"]
    (program,) = procfs.children(job.pid)
    os.kill(program, signal.SIGSTOP)
    waiter = spawn(vramlock("wait", "--arena", str(rig.arena), "-w", "30"))
    assert waiter.stderr is not None
    brief = f"process {program} is stopped"
    told = f"vramlock: the resident job (pid {job.pid}) could not release: {brief}; still waiting"
    assert waiter.stderr.readline().rstrip("\n") == told
    assert f"release refused: {brief}" in _note(rig.arena, "job")
    assert (states / str(program)).read_text().strip() == "0"  # never locked: running
    assert queued(waiter.pid)
    os.kill(program, signal.SIGCONT)
    assert waiter.wait(30) == 0  # the next try checkpoints it
    assert waiter.stderr.read() == ""
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-2] == "done", err
    refused = f"release refused: process {program} of the command is stopped"
    assert (
        err.splitlines().count(
            f"vramlock: {refused} and cannot release its memory; staying resident"
        )
        == 1
    ), err
