"""``--release swap-vulkan`` on Mesa's lavapipe (a CPU Vulkan driver), named or taken by ``auto``.

The program (tests/vulkan/vk_prog.c) keeps a buffer of device memory that a kernel
adds one to every round, and checks every word of it each round. The witness is a
Vulkan layer of the test's own (tests/vulkan/witness_layer.c), below vramlock's,
next to the driver: it logs every submit that reaches the driver with when its work
was done, and the device memory the program holds there after every change. The
other member is a process the test owns, holding the token itself (HOLDER).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.commands import strategy_of, vramlock, who_json
from helpers.processes import Spawn, wait_until
from helpers.swap_rig import Fakes, ask, during, make_rig, read_line
from helpers.swap_rig import take_turn as cuda_turn
from helpers.vulkan import (
    BYTES,
    MARKS,
    WORDS,
    Rig,
    built,
    overlapping,
    rig,
    submitted,
    take_turn,
)

from vramlock.gpu.cbuild import VULKAN

__all__ = ["built", "rig"]  # fixtures

pytestmark = MARKS


def turns_then_stop(
    rig: Rig, spawn: Spawn, job: subprocess.Popen[str], n: int, layer_holds: int = 0
) -> str:
    """``n`` turns of the test's member while the program runs (it submits again
    between them), then the program stops: it must end well, its data checked. Its
    stderr. Checked here too, on the witness: no work of the program ran during a turn,
    and it held no more than its staging buffer then (the data buffer's memory gone), and
    ``layer_holds``: the layer's own."""
    assert read_line(job) == ["ready"]
    turns = []
    for _ in range(n):
        before = submitted(rig, "prog")
        wait_until(lambda: submitted(rig, "prog") > before + 3)  # noqa: B023
        turns.append(take_turn(rig, spawn))
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3)  # it runs again after
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-1] == "ok"  # every word right, every round
    assert not overlapping(rig.lines("prog", "submit"), turns)
    for start, end in turns:
        assert rig.held_at("prog", start) == rig.held_at("prog", end) == BYTES + layer_holds
    assert max(b for _, b in rig.lines("prog", "memory")) == 2 * BYTES + layer_holds
    return err


def test_the_program_runs_on_the_driver_alone(rig: Rig) -> None:
    """The baseline: without vramlock, the program, the witness and the driver agree."""
    env = rig.env("prog", VK_PROG_STOP="/")
    done = subprocess.run([str(rig.built.program), str(WORDS)], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ready", "done", "1", "ok"]
    assert rig.lines("prog", "memory")[-1][1] == BYTES  # the data buffer freed at the end


@pytest.mark.parametrize("staged", [False, True], ids=["mapped", "staged"])
def test_contents_survive_swaps_and_no_work_runs_while_released(
    rig: Rig, spawn: Spawn, staged: bool
) -> None:
    """Copied by mapping the memory (lavapipe's is all host-visible), or as a GPU's is:
    by the device's own copies into a host copy of host-visible memory of the layer's
    (kept: the data buffer's size), which VRAMLOCK_VULKAN_STAGING=1 forces."""
    extra = {"VRAMLOCK_VULKAN_STAGING": "1"} if staged else {}
    job = rig.run(spawn, "prog", "--min-hold", "0", "--release", "swap-vulkan", **extra)
    held = BYTES if staged else 0
    assert turns_then_stop(rig, spawn, job, 5, held) == ""  # nothing said on the happy path


def types_seen(rig: Rig, spawn: Spawn, *opts: str, **extra: str) -> list[str]:
    """The memory types the program sees (``type INDEX FLAGS HEAP``) and what mapping its
    data memory (device-local) returned (``map RESULT``): without vramlock when no
    ``opts``, else under ``vramlock run OPTS``; ``extra``: more of its environment."""
    env = rig.env("prog", VK_PROG_TYPES="1", **extra)
    if not opts:
        argv = [str(rig.built.program), "64"]
    else:
        argv = vramlock("run", "--arena", str(rig.arena), *opts, "--",
                        str(rig.built.program), "64")  # fmt: skip
    job = spawn(argv, env=env)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    return out.splitlines()


def test_device_local_memory_is_shown_unmappable_and_host_memory_added(
    rig: Rig, spawn: Spawn
) -> None:
    """Lavapipe has one memory type with every flag (device-local, host-visible, coherent,
    cached). Under the layer the program sees it device-local only, and cannot map memory
    of it (VK_ERROR_MEMORY_MAP_FAILED, -5); a second type, host-visible, coherent and
    cached but not device-local, in the same heap, is added for what it maps; a third,
    with every flag, is the mapped allowance, after both so that a program asking for
    device-local memory finds the first."""
    bare = types_seen(rig, spawn)
    assert bare == ["type 0 0xf 0", "map 0", "bits 0x1 0x1", "small map 0", "bits 0x1"]
    shown = types_seen(rig, spawn, "--release", "swap-vulkan")
    assert shown[:4] == ["type 0 0x1 0", "type 1 0xe 0", "type 2 0xf 0", "map -5"]


def test_small_buffers_may_take_mappable_device_local_memory_within_the_allowance(
    rig: Rig, spawn: Spawn
) -> None:
    """The third type is the mapped allowance: a storage buffer may take it while it fits
    in what is left of VRAMLOCK_VULKAN_MAPPED (256 MiB by default) on the device, so a 4
    KiB one may (bits 0x7) and a 1 GiB one may not (0x3). Asked for device-local memory
    it may map, as llama.cpp asks for its compute buffer, the 4 KiB buffer gets it, and
    maps it; with a 4K allowance that spends it all, and the next 4 KiB buffer may take
    it no more. With VRAMLOCK_VULKAN_MAPPED=0 there is no such type: the buffer finds no
    device-local memory it may map and the program, as llama.cpp would, gives up (3)."""
    shown = types_seen(rig, spawn, "--release", "swap-vulkan")
    assert shown[4:] == ["bits 0x7 0x3", "small map 0", "bits 0x7"]
    spent = types_seen(rig, spawn, "--release", "swap-vulkan", VRAMLOCK_VULKAN_MAPPED="4K")
    assert spent[4:] == ["bits 0x7 0x3", "small map 0", "bits 0x3"]
    env = rig.env("prog", VK_PROG_TYPES="1", VRAMLOCK_VULKAN_MAPPED="0")
    argv = vramlock("run", "--arena", str(rig.arena), "--release", "swap-vulkan", "--",
                    str(rig.built.program), "64")  # fmt: skip
    job = spawn(argv, env=env)
    out, err = job.communicate(timeout=60)
    assert out.splitlines() == ["type 0 0x1 0", "type 1 0xe 0", "map -5", "bits 0x3 0x3"]
    assert job.returncode == 3 and "vk_prog: no memory type" in err, (out, err)


def test_an_allowance_that_is_no_size_is_said_and_the_default_taken(rig: Rig, spawn: Spawn) -> None:
    env = rig.env("prog", VK_PROG_TYPES="1", VRAMLOCK_VULKAN_MAPPED="lots")
    argv = vramlock("run", "--arena", str(rig.arena), "--release", "swap-vulkan", "--",
                    str(rig.built.program), "64")  # fmt: skip
    job = spawn(argv, env=env)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert (
        "VRAMLOCK_VULKAN_MAPPED=lots is not a size (bytes, or K, M or G of them): "
        "256 MiB taken" in err
    )
    assert out.splitlines()[4:] == ["bits 0x7 0x3", "small map 0", "bits 0x7"]


def programs(program: Path) -> list[int]:
    """The processes running ``program`` now."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if entry.name.isdigit() and argv0 == bytes(program):
            found.append(int(entry.name))
    return found


def mapped_by(pid: int) -> set[str]:
    return {ln.split()[-1] for ln in Path(f"/proc/{pid}/maps").read_text().splitlines()}


def test_auto_swaps_a_vulkan_program(rig: Rig, spawn: Spawn) -> None:
    """Nothing named: ``auto`` puts the layer in front of the command (its process maps
    vramlock's layer above the test's witness), and a waiter gets the program swapped:
    no submit of it reaches the driver in the test's member's turns, its data memory is
    gone then, and it runs on after each with its data right, nothing said."""
    job = rig.run(spawn, "prog", "--min-hold", "0")
    assert read_line(job) == ["ready"]
    (pid,) = programs(rig.built.program)
    mapped = mapped_by(pid)
    assert str(rig.built.layers / "libwitness.so") in mapped
    assert [m for m in mapped if os.path.basename(m).startswith("libvramlock-vulkan")], mapped
    turns = []
    for _ in range(3):
        before = submitted(rig, "prog")
        wait_until(lambda: submitted(rig, "prog") > before + 3)  # noqa: B023
        turns.append(take_turn(rig, spawn))
    assert strategy_of(rig.arena) == "auto:swap-vulkan"
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3)  # it runs again after
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", (out, err)
    assert err == ""
    assert not overlapping(rig.lines("prog", "submit"), turns)
    for start, end in turns:
        assert rig.held_at("prog", start) == rig.held_at("prog", end) == BYTES


def test_auto_takes_its_next_way_at_once_when_the_layer_refuses(rig: Rig, spawn: Spawn) -> None:
    """A program that takes a buffer's device address cannot be swapped: under ``auto`` the
    first release is refused, said once with the cause (in ``who`` too), and auto takes its
    next way at once: none here (no preset knows the program), so the waiter gets the
    token when the program exits, and nothing hangs."""
    job = rig.run(spawn, "prog", "--min-hold", "0", VK_PROG_ADDRESS="1")
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    assert job.stderr is not None
    said = job.stderr.readline()
    assert said.startswith("vramlock: ") and said.endswith("holding the GPU until it exits\n")
    assert "cannot be swapped: the program uses buffer device addresses" in said, said
    (row,) = [r for r in who_json(rig.arena) if r["member"]]
    assert row["strategy"] == "auto:none"
    assert "swap-vulkan refused" in row["note"] and "device addresses" in row["note"], row
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3)  # it runs on, refused
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", (out, err)
    assert err == ""  # said once
    held = read_line(holder)
    assert held[0] == "held" and int(held[1]) > rig.lines("prog", "submit")[-1][1]
    ask(holder, "")


def test_under_auto_a_process_that_cannot_reach_vramlock_runs_without_swap(
    rig: Rig, spawn: Spawn
) -> None:
    """Its process cannot reach the run's sockets (here: the command points it elsewhere,
    and names it no abstract one): under ``auto`` it runs on, the layer stepping aside
    (never blocked), a waiter is told once why it keeps the GPU, and gets the token when
    the program exits."""
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--", "sh", "-c",
                    "unset VRAMLOCK_SWAP_ABSTRACT;"
                    ' VRAMLOCK_SWAP_SOCKET=/nonexistent/control exec "$0" "$1"',
                    str(rig.built.program), str(WORDS))  # fmt: skip
    job = spawn(argv, env=rig.env("prog"))
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    assert job.stderr is not None
    said = job.stderr.readline()
    assert said.startswith("vramlock: ") and "keeps it until it exits" in said, said
    assert "could not reach vramlock run (No such file or directory)" in said, said
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3)  # it runs on
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", (out, err)
    assert err == ""
    held = read_line(holder)
    assert held[0] == "held" and int(held[1]) > rig.lines("prog", "submit")[-1][1]
    ask(holder, "")


def test_auto_swaps_cuda_and_vulkan_processes_of_one_command_together(
    rig: Rig, spawn: Spawn, fakes: Fakes, tmp_path: Path
) -> None:
    """A command of a CUDA process (the fake driver's program) and a Vulkan one: auto puts
    the library and the layer in front, both join one socket, and a waiter gets both
    swapped by one release (``auto:swap-vulkan``, which checks both kinds of process
    before it releases): in the test's member's turns no launch reaches
    the fake driver and it holds no memory, no submit reaches lavapipe and the Vulkan
    program holds only its mapped staging memory."""
    (tmp_path / "cuda").mkdir()
    cuda = make_rig(fakes, rig.arena, tmp_path / "cuda")
    stop = tmp_path / "cuda.stop"
    env = dict(rig.env("prog"), SWAP_PROG_STOP=str(stop))
    env.update(
        (k, cuda.env[k]) for k in ("LD_LIBRARY_PATH", "FAKE_CUDA_PHYS", "FAKE_CUDA_LAUNCH_LOG")
    )
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--", "sh", "-c",
                    '"$0" 60 & "$1" "$2"; wait', str(fakes.program), str(rig.built.program),
                    str(WORDS))  # fmt: skip
    job = spawn(argv, env=env)
    assert read_line(job) == read_line(job) == ["ready"]
    turns = []
    for _ in range(3):
        before, launched = submitted(rig, "prog"), len(cuda.launches())
        wait_until(lambda: submitted(rig, "prog") > before + 3)  # noqa: B023
        wait_until(lambda: len(cuda.launches()) > launched + 20)  # noqa: B023
        turns.append(cuda_turn(cuda, spawn))
    assert strategy_of(rig.arena) == "auto:swap-vulkan"
    stop.touch()
    rig.stop("prog").touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split().count("ok") == 1, (out, err)
    assert err == ""
    assert all(t.phys == (0, 0) for t in turns), turns
    assert not during(cuda.launches(), turns)
    spans = [(t.start, t.end) for t in turns]
    assert not overlapping(rig.lines("prog", "submit"), spans)
    for start, end in spans:
        assert rig.held_at("prog", start) == rig.held_at("prog", end) == BYTES


def test_the_layer_says_nothing_in_a_command_that_makes_no_vulkan_device(
    arena: Path, tmp_path: Path
) -> None:
    """``auto`` names the layer to every command where it can be used; one that loads the
    Vulkan loader and makes an instance but no device is not held, asked or told."""
    code = (
        "import ctypes, os; v = ctypes.CDLL('libvulkan.so.1'); info = (ctypes.c_uint32 * 16)();"
        " info[0] = 1; inst = ctypes.c_void_p();"
        " assert v.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(inst)) == 0;"
        " v.vkDestroyInstance(inst, None); print(os.environ['VK_INSTANCE_LAYERS'])"
    )
    done = subprocess.run(vramlock("run", "--arena", str(arena), "--", "python3", "-c", code),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.split(":")[0].strip() == "VK_LAYER_VRAMLOCK_swap"


def test_two_programs_take_turns(rig: Rig, spawn: Spawn) -> None:
    """Two Vulkan programs in one arena, both always at work: they take turns, never
    both at work, and each keeps its data."""
    jobs = {name: rig.run(spawn, name, "--min-hold", "0.2", "--release", "swap-vulkan")
            for name in ("a", "b")}  # fmt: skip
    for job in jobs.values():
        assert read_line(job) == ["ready"]

    def handoffs() -> int:
        work = sorted((s, n) for n in jobs for s, _ in rig.lines(n, "submit"))
        return sum(1 for x, y in itertools.pairwise(work) if x[1] != y[1])

    wait_until(lambda: handoffs() >= 10, timeout=60)
    for name, job in jobs.items():
        rig.stop(name).touch()
        out, err = job.communicate(timeout=60)
        assert job.returncode == 0 and out.split()[-1] == "ok", (out, err)
    assert not overlapping(rig.lines("a", "submit"), rig.lines("b", "submit"))


def test_a_layer_that_cannot_be_built_fails_before_the_command(arena: Path, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run(
        vramlock("run", "--arena", str(arena), "--release", "swap-vulkan", "--", "touch",
                 str(marker)),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1
    assert "--release swap-vulkan cannot be used here" in done.stderr
    assert "no-such-cc" in done.stderr
    assert not marker.exists()


def test_the_layer_compiles_without_warnings(tmp_path: Path) -> None:
    VULKAN.build(tmp_path / "layer.so", "-Werror")


@pytest.mark.parametrize(
    ("knob", "why"),
    [
        ("VK_PROG_ADDRESS", "the program uses buffer device addresses"),
        ("VK_PROG_KEEP", "a command buffer recorded over its buffers is kept"),
    ],
    ids=["address", "kept-command-buffer"],
)
def test_what_cannot_be_swapped_is_refused_and_the_program_keeps_the_gpu(
    rig: Rig, spawn: Spawn, knob: str, why: str
) -> None:
    """A device address would change when its buffer is made again; a command buffer kept
    recorded would name buffers destroyed: the layer refuses (for the command buffer, after
    three releases that failed), the program runs on with its memory, and the waiter gets
    the token only once it exits."""
    job = rig.run(spawn, "prog", "--min-hold", "0", "--release", "swap-vulkan", **{knob: "1"})
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    assert job.stderr is not None
    said = [job.stderr.readline()]  # a failure a second, three in a row: refused
    while "holding the GPU until it exits" not in said[-1]:
        said.append(job.stderr.readline())
    assert all(ln.startswith("vramlock: ") and why in ln for ln in said), said
    if knob == "VK_PROG_ADDRESS":
        assert len(said) == 1, said  # refused at once
    else:
        assert "3 times in a row" in said[-1], said
    seen = submitted(rig, "prog")
    wait_until(lambda: submitted(rig, "prog") > seen + 3)  # it runs on, refused
    rig.stop("prog").touch()
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", out
    held = read_line(holder)
    assert held[0] == "held" and int(held[1]) > rig.lines("prog", "submit")[-1][1]
    ask(holder, "")


def test_a_process_that_runs_vulkan_without_the_layer_is_refused(rig: Rig, spawn: Spawn) -> None:
    """The command takes the layer out of its program's environment before the exec: that
    process would run on in another member's turn, so no release is made (the witness
    layer, named by the test, stays)."""
    env = rig.env("prog")
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release",
                    "swap-vulkan", "--", "sh", "-c",
                    'VK_INSTANCE_LAYERS=VK_LAYER_VRAMLOCK_TEST_witness exec "$0" "$1"',
                    str(rig.built.program), str(WORDS))  # fmt: skip
    job = spawn(argv, env=env)
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    assert job.stderr is not None
    said = job.stderr.readline()
    assert said.startswith("vramlock: ") and said.endswith("holding the GPU until it exits\n")
    assert "uses Vulkan without the vramlock layer" in said, said
    rig.stop("prog").touch()
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 0 and out.split()[-1] == "ok", out
    assert read_line(holder)[0] == "held"
    ask(holder, "")


def test_the_recording_benchmark_times_the_layer_on_the_driver(tmp_path: Path) -> None:
    """bench/vulkan_record.py (the figure of what the layer adds to each recorded
    dispatch) runs the program bare and under the layer and says both."""
    out = tmp_path / "record.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "vulkan_record.py"), "--pairs",
                           "1", "--dispatches", "50", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| 50 dispatches, 1 pairs |" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["bare"] > 0 and figures["swap-vulkan"] > 0
    assert figures["added"] == figures["swap-vulkan"] - figures["bare"]
