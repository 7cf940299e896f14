"""The Vulkan tests' own witness (tests/vulkan/witness_layer.c): building it, and reading
what it logged. It is a layer put next to the driver (below vramlock's): it writes every
submit that reached the driver, with when its work was done, and the device memory the
program holds there after every change (its header says more). And the rig of the
tests that run the tests' program (tests/vulkan/vk_prog.c) under vramlock: its build,
a member the test owns, the fixtures ``built`` and ``rig``."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT
from helpers.commands import vramlock
from helpers.processes import Spawn
from helpers.swap_rig import ask, read_line
from vramlock.gpu.cbuild import compiler
from vramlock.gpu.vulkan import loader_here

SOURCES = ROOT / "tests" / "vulkan"
STRICT = ("-std=c11", "-O2", "-Wall", "-Wextra", "-Werror")
NAME = "VK_LAYER_VRAMLOCK_TEST_witness"


def build_witness(cc: str, out: Path) -> Path:
    """The witness layer compiled into ``out`` with its manifest: the directory to name in
    VK_ADD_LAYER_PATH (and NAME in VK_INSTANCE_LAYERS, WITNESS_LOG the log's path)."""
    subprocess.run([cc, *STRICT, "-fPIC", "-shared", "-fvisibility=hidden", "-o",
                    str(out / "libwitness.so"), str(SOURCES / "witness_layer.c")],
                   check=True, timeout=120)  # fmt: skip
    manifest = {
        "file_format_version": "1.2.0",
        "layer": {"name": NAME, "type": "GLOBAL",
                  "library_path": str(out / "libwitness.so"), "api_version": "1.3.0",
                  "implementation_version": "1", "description": "the tests' witness"},
    }  # fmt: skip
    (out / "witness.json").write_text(json.dumps(manifest))
    return out


def logged(log: Path, kind: str) -> list[tuple[int, int]]:
    """The witness's lines of ``kind`` in ``log`` so far (complete lines only): ``submit``
    (start, end) or ``memory`` (when, bytes held)."""
    if not log.exists():
        return []
    text = log.read_text()
    rows = (ln.split() for ln in text[: text.rfind("\n") + 1].splitlines())
    return [(int(a), int(b)) for k, a, b in rows if k == kind]


def held_at(log: Path, ns: int) -> int:
    """The device memory the program held at the driver at ``ns``."""
    return ([b for at, b in logged(log, "memory") if at <= ns] or [0])[-1]


def overlapping(work: list[tuple[int, int]], turns: list[tuple[int, int]]) -> list[object]:
    """The pairs of intervals, one of each list, that overlap."""
    return [(w, t) for w in work for t in turns if w[0] <= t[1] and w[1] >= t[0]]


# The marks of every test file that runs the program.
MARKS = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(compiler() is None, reason="no C compiler"),
    pytest.mark.skipif(not loader_here(), reason="no Vulkan loader (libvulkan.so.1)"),
]

WORDS = 1 << 18  # the program's buffer: 1 MiB, and as much again for its staging copy
BYTES = WORDS * 4

# A member the test owns: queues as any waiter, says when it holds the token and when
# it lets go (monotonic ns), and lets go when told on stdin.
HOLDER = """
import fcntl, os, sys, time
arena = sys.argv[1]
want = os.open(os.path.join(arena, "want.lock"), os.O_RDWR | os.O_CLOEXEC)
token = os.open(os.path.join(arena, "token.lock"), os.O_RDWR | os.O_CLOEXEC)
fcntl.flock(want, fcntl.LOCK_SH)
fcntl.flock(token, fcntl.LOCK_EX)
print("held", time.monotonic_ns(), flush=True)
sys.stdin.readline()
print("leaving", time.monotonic_ns(), flush=True)
"""


@dataclass
class Built:
    program: Path
    layers: Path  # the witness layer's manifest's directory


def build_program(out: Path) -> Path:
    """The tests' program compiled into ``out``, having run once alone on the driver;
    the test is skipped where the Vulkan headers or a Vulkan device are missing."""
    cc = compiler()
    assert cc is not None
    made = subprocess.run(
        [cc, *STRICT, "-o", str(out / "vk_prog"), str(SOURCES / "vk_prog.c"), "-lvulkan"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if made.returncode != 0 and "vulkan/vulkan.h" in made.stderr:
        pytest.skip("no Vulkan headers (libvulkan-dev)")
    assert made.returncode == 0, made.stderr
    alone = subprocess.run([str(out / "vk_prog"), "64"], env=dict(os.environ, VK_PROG_STOP="/"),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    if alone.returncode != 0:
        pytest.skip(f"no Vulkan device here (a CPU one: mesa-vulkan-drivers): {alone.stderr}")
    return out / "vk_prog"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    out = tmp_path_factory.mktemp("vulkan")
    program = build_program(out)
    cc = compiler()
    assert cc is not None
    build_witness(cc, out)
    return Built(program, out)


@dataclass
class Rig:
    built: Built
    arena: Path
    tmp: Path

    def env(self, name: str, **extra: str) -> dict[str, str]:
        env = dict(os.environ, VK_ADD_LAYER_PATH=str(self.built.layers),
                   VK_INSTANCE_LAYERS="VK_LAYER_VRAMLOCK_TEST_witness",
                   WITNESS_LOG=str(self.log(name)), VK_PROG_STOP=str(self.stop(name)))  # fmt: skip
        env.update(extra)
        return env

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def stop(self, name: str) -> Path:
        return self.tmp / f"{name}.stop"

    def run(self, spawn: Spawn, name: str, *opts: str, **extra: str) -> subprocess.Popen[str]:
        argv = vramlock("run", "--arena", str(self.arena), *opts, "--",
                        str(self.built.program), str(WORDS))  # fmt: skip
        return spawn(argv, env=self.env(name, **extra))

    def lines(self, name: str, kind: str) -> list[tuple[int, int]]:
        """The witness's lines of ``kind`` so far (complete lines only)."""
        return logged(self.log(name), kind)

    def holder(self, spawn: Spawn) -> subprocess.Popen[str]:
        """A member the test owns (HOLDER), queued: it says ``held`` once it has the token
        and lets go when told on stdin."""
        script = self.tmp / "holder.py"
        script.write_text(HOLDER)
        return spawn(["python3", str(script), str(self.arena)], stdin=subprocess.PIPE)

    def held_at(self, name: str, ns: int) -> int:
        """The device memory the program held at the driver at ``ns``."""
        return held_at(self.log(name), ns)


@pytest.fixture
def rig(built: Built, arena: Path, tmp_path: Path) -> Rig:
    return Rig(built, arena, tmp_path)


def take_turn(rig: Rig, spawn: Spawn) -> tuple[int, int]:
    """The test's member queues, holds the token a moment, lets go: when it held it."""
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert held[0] == "held", held
    time.sleep(0.3)  # the program keeps trying to submit meanwhile
    left = ask(holder, "")
    assert holder.wait(10) == 0
    return int(held[1]), int(left[1])


def submitted(rig: Rig, name: str) -> int:
    return len(rig.lines(name, "submit"))
