"""``vramlock run --release restart --on-release CMD``: CMD is what ends the command (a
container's stop), and the token is given up only once the container is gone: for a
waiter's turn, and when the wrapper is told to end, since a signal to the container's
client would leave the container running on the GPU."""

from __future__ import annotations

import itertools
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.containers import Containers
from helpers.net import free_port
from helpers.processes import Spawn, token_free, wait_until

pytestmark = pytest.mark.timeout(60)


def wrapped(spawn: Spawn, boxes: Containers, arena: Path, name: str) -> subprocess.Popen[str]:
    """A wrapper of container ``name`` (it queues for the token at once)."""
    args = vramlock("run", "--arena", str(arena), *boxes.run_args(name, free_port()))
    return spawn(args, graceful=True)


def test_containers_take_turns_each_stopped_before_the_next_runs(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    boxes = Containers(spawn, tmp_path / "containers")
    a = wrapped(spawn, boxes, arena, "a")
    wait_until(lambda: boxes.running("a"), timeout=30)
    cmd = boxes.read("a.cmd")
    b = wrapped(spawn, boxes, arena, "b")
    wait_until(lambda: len(boxes.on_gpu()) >= 4, timeout=40)  # turns taken
    for proc in (a, b):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    spans = boxes.on_gpu()
    for before, after in itertools.pairwise(spans):  # never two on the GPU at once
        assert before[3] < after[2], spans
    assert {"a", "b"} <= {s[0] for s in spans}
    # each stop was given its command's pid ($VRAMLOCK_CHILD_PID): the last one a's last
    assert boxes.read("a.stopped-for") == boxes.read("a.cmd") != cmd


def test_told_to_end_it_stops_the_container_before_the_token_goes(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    boxes = Containers(spawn, tmp_path / "containers")
    proc = wrapped(spawn, boxes, arena, "a")
    wait_until(lambda: boxes.running("a") and boxes.on_gpu(), timeout=30)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not boxes.running("a")  # stopped by its stop command, not left running
    assert token_free(arena)
