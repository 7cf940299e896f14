"""``--release swap`` set up or refused before the command starts: the library built
without warnings, and each way it cannot be used here, told in one line with the command
never run. The fake driver and its witnesses are test_swap.py's.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.processes import Spawn
from helpers.swap_rig import Rig, _driver_here, swap_marks

from vramlock.gpu import swap

pytestmark = swap_marks()


def test_a_library_that_cannot_be_built_fails_before_the_command(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    env = dict(rig.env, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--release", "swap", "--", "touch", str(marker)),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1
    assert "--release swap cannot be used here" in done.stderr and "no-such-cc" in done.stderr
    assert not marker.exists()


def test_a_cache_directory_that_cannot_be_made_fails_before_the_command(
    rig: Rig, tmp_path: Path
) -> None:
    marker, plain = tmp_path / "started", tmp_path / "a-file"
    plain.touch()
    env = dict(rig.env, XDG_CACHE_HOME=str(plain / "cache"))
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--release", "swap", "--", "touch", str(marker)),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1
    assert "--release swap cannot be used here" in done.stderr
    assert f"{plain}/cache/vramlock cannot be made: Not a directory" in done.stderr
    assert not marker.exists()


@pytest.mark.skipif(_driver_here(), reason="a CUDA driver is installed here")
def test_no_driver_fails_before_the_command(arena: Path, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    done = subprocess.run(
        vramlock("run", "--arena", str(arena), "--release", "swap", "--", "touch", str(marker)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1
    assert "--release swap cannot be used here: cannot load libcuda.so.1" in done.stderr
    assert not marker.exists()


def test_the_library_compiles_without_warnings(tmp_path: Path) -> None:
    swap.build(tmp_path / "lib.so", "-Werror")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm here to list the library's exported names")
    exported = subprocess.run([nm, "-D", "--defined-only", str(tmp_path / "lib.so")],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    names = {line.split()[-1] for line in exported.splitlines()}
    assert {"dlsym", "cuGetProcAddress_v2", "cuMemAlloc_v2", "cuLaunchKernel"} <= names
    assert not any(n.startswith(("gate_", "own_", "real_")) for n in names)


def test_a_library_path_ld_preload_cannot_carry_fails_before_the_command(
    rig: Rig, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    env = dict(rig.env, XDG_CACHE_HOME=str(tmp_path / "my cache"))
    done = subprocess.run(
        vramlock("run", "--arena", str(rig.arena), "--release", "swap", "--", "touch", str(marker)),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 125
    assert done.stderr.count("\n") == 1 and "cannot go in LD_PRELOAD" in done.stderr
    assert not marker.exists()
