"""``--release auto`` and the swap library, against the fake driver of test_swap.py.

Where swap can work, auto puts its library in front of the command and, once the
command's CUDA processes joined it, releases by swap ahead of an engine's preset and of
checkpoint; where swap is refused it goes to the next way that fits. The witnesses
are those of test_swap.py: the fake driver's physical-memory file and launch log
against a member the test owns; the command's own environment (it prints it); a fake
engine's request log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.commands import strategy_of, vramlock, who_json
from helpers.net import free_port
from helpers.processes import Spawn, wait_until
from helpers.swap_rig import (
    Rig,
    Turn,
    _driver_here,
    during,
    kept_the_gpu,
    read_line,
    resumed,
    swap_marks,
    swap_turns,
    take_turn,
)

from vramlock.procfs import descendants
from vramlock.strategies.presets import PRESETS

pytestmark = swap_marks()


def auto(rig: Rig, spawn: Spawn, *command: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """``vramlock run -- COMMAND``: no --release, so auto."""
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--", *command)
    return spawn(argv, env=env)


def script(path: Path, text: str) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\n{text}\n")
    path.chmod(0o755)
    return path


def test_auto_swaps_a_cuda_program(rig: Rig, spawn: Spawn) -> None:
    stop = rig.tmp / "stop"
    job = auto(
        rig, spawn, str(rig.fakes.program), "60", env=dict(rig.env, SWAP_PROG_STOP=str(stop))
    )
    assert read_line(job) == ["ready"]
    (program,) = descendants(job.pid)
    first = take_turn(rig, spawn)
    assert first.phys == (0, 0)
    wait_until(lambda: strategy_of(rig.arena) == "auto:swap")
    wait_until(resumed(rig, len(rig.launches())))
    assert descendants(job.pid) == [program]  # the same process: nothing restarted
    out, err = swap_turns(rig, spawn, job, stop, 3)  # memory gone, no launch, each turn
    assert not during(rig.launches(), [first])
    assert out.split().count("done") == 1
    assert err == ""  # nothing said: auto chose, nothing failed


def test_auto_swaps_a_program_that_reached_cuda_after_a_waiter_came(rig: Rig, spawn: Spawn) -> None:
    """A waiter queues while the command is still starting (a framework's import takes
    seconds before its first CUDA call): auto finds no way yet and says so, but once the
    program's process joins the library it is swapped; the waiter does not wait until
    the command exits (it waited for good before: a budget arena's released member
    queues again at once, so the next command met a waiter from its start)."""
    stop = rig.tmp / "stop"
    late = script(rig.tmp / "bin" / "late", f"sleep 2; exec {rig.fakes.program} 60")
    job = auto(rig, spawn, str(late), env=dict(rig.env, SWAP_PROG_STOP=str(stop)))
    wait_until(lambda: [r["strategy"] for r in who_json(rig.arena) if r["member"]] == ["auto:none"])
    holder = rig.holder(spawn)  # queues before the program reached CUDA
    assert read_line(job) == ["ready"]
    held = read_line(holder)
    assert held[0] == "held", held
    assert job.poll() is None, "the waiter got the GPU only once the command exited"
    wait_until(lambda: strategy_of(rig.arena) == "auto:swap")
    assert holder.stdin is not None
    holder.stdin.write("\n")
    holder.stdin.close()
    left = read_line(holder)
    assert holder.wait(10) == 0
    assert not during(rig.launches(), [Turn(int(held[1]), int(left[1]), (0, 0))])
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert out.split()[-2] == "done"  # every round ran, contents intact


def test_a_vulkan_layer_that_cannot_be_built_costs_a_cuda_program_nothing(
    rig: Rig, spawn: Spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap library is cached, the Vulkan layer cannot be built (no compiler): auto
    swaps the CUDA program as ever. (A cluster's read-only cache did this: the command
    ended in 'the Vulkan layer is not built' the first time somebody waited.)"""
    from vramlock.gpu import swap

    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    swap.library_path()  # built where the command will find it
    stop = rig.tmp / "stop"
    env = dict(rig.env, SWAP_PROG_STOP=str(stop), XDG_CACHE_HOME=str(cache),
               CC=str(tmp_path / "no-such-cc"))  # fmt: skip
    job = auto(rig, spawn, str(rig.fakes.program), "60", env=env)
    assert read_line(job) == ["ready"]
    turn = take_turn(rig, spawn)
    assert turn.phys == (0, 0)  # its memory gone while the test's member held the GPU
    wait_until(resumed(rig, len(rig.launches())))
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert err == ""  # nothing said: auto chose, nothing failed
    assert not during(rig.launches(), [turn])


def test_auto_falls_back_when_swap_refuses_and_the_program_runs_on(rig: Rig, spawn: Spawn) -> None:
    # No checkpoint API in the fake driver: after swap nothing is left, the waiter waits.
    job = auto(rig, spawn, str(rig.fakes.program), "3", "managed", env=rig.env)
    assert read_line(job) == ["ready"]
    said = kept_the_gpu(rig, spawn, job)
    assert "cannot be swapped: it uses managed memory; it was left running" in said
    assert said.endswith("holding the GPU until it exits")


def test_auto_keeps_swap_off_a_program_that_runs_cuda_without_the_library(
    rig: Rig, spawn: Spawn
) -> None:
    # exec'd by the system call itself without LD_PRELOAD: the library cannot pass itself on
    prog = f"{rig.fakes.raw_exec} LD_PRELOAD -- {rig.fakes.program}"
    job = auto(rig, spawn, "sh", "-c", f"{prog} 3", env=rig.env)
    assert read_line(job) == ["ready"]
    holder = rig.holder(spawn)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert "--release auto found no way to release it" in err and err.count("\n") == 1
    held = read_line(holder)
    assert held[0] == "held"
    assert int(held[1]) > max(e for _, e in rig.launches())


def preloaded(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The variables of ours in the environment the command printed (``env``)."""
    names = ("LD_PRELOAD", "VRAMLOCK_SWAP_SOCKET")
    pairs = (line.partition("=") for line in done.stdout.splitlines())
    return {name: value for name, _, value in pairs if name in names}


@pytest.mark.parametrize("where", ["driver and library", "no library", "no driver"])
def test_auto_adds_the_library_only_where_swap_can_work(
    rig: Rig, tmp_path: Path, where: str
) -> None:
    env = dict(rig.env)
    if where == "no library":  # nothing packaged, nothing cached, no compiler
        env.update(CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    if where == "no driver":
        if _driver_here():
            pytest.skip("a CUDA driver is installed here")
        del env["LD_LIBRARY_PATH"]
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--", "sh", "-c", "env; exit 3"),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3 and done.stderr == ""
    found = preloaded(done)
    if where == "driver and library":
        assert found["LD_PRELOAD"].endswith(".so") and found["VRAMLOCK_SWAP_SOCKET"]
    else:  # (the socket may be the Vulkan layer's: tests/test_vulkan.py)
        assert "LD_PRELOAD" not in found


@pytest.mark.parametrize(
    ("options", "swapped"),
    [
        (["-tp", "1"], True),
        (["-tp", "2"], False),
        (["--tensor-parallel-size=4"], False),
        (["--data-parallel-size", "2"], False),
        (["--config", "serve.yaml"], False),
    ],
)
def test_auto_keeps_the_library_out_of_an_engine_spread_over_gpus(
    rig: Rig, tmp_path: Path, options: list[str], swapped: bool
) -> None:
    # Its processes share memory by legacy CUDA IPC, which the library cannot serve.
    vllm = script(tmp_path / "bin" / "vllm", "env; exit 3")
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--", str(vllm), "serve", "m",
                 "--enable-sleep-mode", *options),
        env=rig.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3 and done.stderr == ""
    assert "VLLM_SERVER_DEV_MODE=1" in done.stdout.splitlines()  # auto took vLLM's preset
    assert bool(preloaded(done)) is swapped


@pytest.mark.parametrize(
    ("command", "spreads"),
    [
        (["python3", "-m", "sglang.launch_server", "--tp", "2"], True),
        (["python3", "-m", "sglang.launch_server", "--ep-size=8"], True),
        (["python3", "-m", "sglang.launch_server", "--tp-size", "1"], False),
        (["vllm", "serve", "m", "-pp", "2"], True),
        (["vllm", "serve", "m"], False),
        (["llama-server", "--config", "x", "-sm", "row"], False),  # one process: it can swap
        (["sh", "-c", "vllm serve m -tp 2"], False),  # not recognised: no preset to ask
    ],
)
def test_which_engines_spread_over_gpu_processes(command: list[str], spreads: bool) -> None:
    assert any(engine.spreads(command) for engine in PRESETS.values()) is spreads


def test_a_preset_command_that_joined_swap_is_swapped_not_restarted(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    # Named llama-server, auto takes the preset at start (which would end the server and
    # start it again, after saving slots over HTTP: it serves none); it joined swap.
    stop = tmp_path / "stop"
    server = script(tmp_path / "bin" / "llama-server", f"exec {rig.fakes.program} 60")
    env = dict(rig.env, SWAP_PROG_STOP=str(stop))
    job = auto(rig, spawn, str(server), "--port", str(free_port()), env=env)
    assert read_line(job) == ["ready"]
    assert strategy_of(rig.arena) == "auto:http:llama-server"
    (program,) = descendants(job.pid)
    turn = take_turn(rig, spawn)
    assert turn.phys == (0, 0)
    assert descendants(job.pid) == [program]  # the same process: not restarted
    wait_until(lambda: strategy_of(rig.arena) == "auto:swap")
    wait_until(resumed(rig, len(rig.launches())))
    out, err = swap_turns(rig, spawn, job, stop, 2)
    assert not during(rig.launches(), [turn])
    assert out.split()[0] == "done"  # no second "ready": never started again
    assert err == ""


def test_a_preset_command_swap_refuses_falls_back_to_its_preset(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    # A llama-server (the fake engine) beside a CUDA process with managed memory.
    engine_log = tmp_path / "engine.log"
    fake = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import fake_engine;"
            " fake_engine.main('llama-server', sys.argv[1:])")  # fmt: skip
    server = script(
        tmp_path / "bin" / "llama-server",
        f'{rig.fakes.program} 600 managed &\nexec {sys.executable} -c "{fake}" "$@"',
    )
    env = dict(rig.env, FAKE_LOG=str(engine_log), FAKE_LOADING="0")
    job = auto(rig, spawn, str(server), "--port", str(free_port()), env=env)
    assert read_line(job) == ["ready"]

    def log() -> str:
        return engine_log.read_text() if engine_log.exists() else ""

    def started(times: int) -> Callable[[], bool]:
        return lambda: log().count(" start ") == times

    wait_until(lambda: " start " in log())
    turns = []
    for n in (1, 2):
        turns.append(take_turn(rig, spawn))
        # The preset saved the slot and ended the command: the program too (its launches
        # stop), then started it again on its turn.
        assert log().count(" req POST /slots/0?action=save\n") == n
        wait_until(started(n + 1), timeout=30)
        wait_until(lambda: strategy_of(rig.arena) == "auto:http:llama-server")
    assert not during(rig.launches(), turns)
    os.kill(job.pid, signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    refusals = [line for line in err.splitlines() if "cannot be swapped" in line]
    assert len(refusals) == 1, err  # tried once: a refused strategy is not tried again
    assert "it uses managed memory; it was left running;" in refusals[0]
    assert refusals[0].endswith("releasing it with auto:http:llama-server instead")
