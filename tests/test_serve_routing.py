"""``vramlock serve``'s routing in a budget arena: which models stay resident together,
whom serve releases for a request, unloading one model. The witness is the fake servers'
own log (each says when it starts and ends) and ``vramlock who``, not serve's view."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, wait_until
from helpers.serving import ask, complete, fake_models, start_serve, up

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def budget_arena(arena: Path) -> Path:
    subprocess.run(vramlock("arena", "--arena", str(arena), "--budget", "4G"),
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    return arena


def resident(arena: Path) -> list[str]:
    return sorted(r["name"] for r in who_json(arena) if r["state"] == "resident")


def test_unloading_one_model_of_a_budget_arena_leaves_the_others(
    spawn: Spawn, tmp_path: Path, budget_arena: Path
) -> None:
    port = start_serve(spawn, tmp_path, fake_models(tmp_path, ["a", "b", "c"]), budget_arena)
    pids = {name: complete(port, name)["pid"] for name in "abc"}
    wait_until(lambda: resident(budget_arena) == ["a", "b", "c"], timeout=30)
    assert ask(port, "POST", "/models/unload/b") == (200, {"model": "b", "released": True})
    assert up(tmp_path) == {"a", "c"}
    assert resident(budget_arena) == ["a", "c"]
    for name in "ac":  # still the same servers, answering
        assert complete(port, name)["pid"] == pids[name]
    assert ask(port, "POST", "/api/models/unload/a") == (200, "OK")
    assert up(tmp_path) == {"c"}
    assert complete(port, "c")["pid"] == pids["c"]
