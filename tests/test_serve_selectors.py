"""``vramlock serve``'s llama-swap selectors and profiles: the name asked for, resolved.

Each model is tests/echo_server.py in an arena of its own (so that several are resident
at once), which answers with its name and the body it got.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.net import free_port
from helpers.processes import Spawn, wait_until
from helpers.serve import call, call_json, echo_model, start

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(120)

SELECTORS = """\
selectors:
  pinned: {strategy: pin, targets: [b, a]}
  warm:
    strategy: warm
    targets: [a, b]
    name: Warm one
  spill: {strategy: spillover, targets: [a, b], settings: {spillover: 1}}
profiles:
  coding:
    description: for code
    pins: {code: b, a: c, "off": ~}
models:
"""


def served(spawn: Spawn, tmp_path: Path, arena: Path) -> int:
    text = f"startPort: {free_port()}\n" + SELECTORS
    for name in ("a", "b", "c"):
        (tmp_path / f"arena-{name}").mkdir(mode=0o700)
        text += echo_model(name, "release: restart", f"arena: arena-{name}")
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return start(spawn, path, arena)[1]


def ask(port: int, model: str, **extra: object) -> str:
    """Which model's server answered a request for ``model``, and the model it was asked."""
    got = call_json(port, "POST", "/v1/completions", {"model": model, **extra})
    return f"{got['id']}:{json.loads(got['body'])['model']}"


def resident(port: int) -> set[str]:
    running = call_json(port, "GET", "/running")["running"]
    return {r["model"] for r in running if r["state"] == "ready"}


def test_pin_and_warm_pick_their_targets(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port = served(spawn, tmp_path, arena)
    assert ask(port, "pinned") == "b:b"  # the first target, whatever is resident
    wait_until(lambda: resident(port) == {"b"}, 30)
    assert ask(port, "warm") == "b:b"  # a is not resident: the first one that is
    assert ask(port, "a") == "a:a"
    wait_until(lambda: resident(port) == {"a", "b"}, 30)
    assert ask(port, "warm") == "a:a"  # both are: the first target
    listed = {m["id"]: m for m in call_json(port, "GET", "/v1/models")["data"]}
    assert listed["warm"]["name"] == "Warm one"
    assert listed["warm"]["meta"]["llamaswap"] == {
        "type": "selector", "strategy": "warm", "targets": ["a", "b"]}  # fmt: skip
    assert listed["spill"]["meta"]["llamaswap"]["spillover"] == 1
    assert call_json(port, "GET", "/v1/models/warm") == listed["warm"]


def test_spillover_starts_the_next_target_when_the_first_is_busy(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = served(spawn, tmp_path, arena)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(ask, port, "spill", sleep=3)  # a, cold: the first target
        wait_until(lambda: resident(port) == {"a"}, 30)
        # a has spillover (1) requests of the selector in progress: the next target
        assert ask(port, "spill") == "b:b"
        assert slow.result() == "a:a"
    wait_until(lambda: resident(port) == {"a", "b"}, 30)
    assert ask(port, "spill") == "a:a"  # both idle: the least busy, first in order


def profile(port: int, body: object) -> tuple[int, object]:
    status, _, data = call(port, "PUT", "/api/profiles/active", body)
    return status, json.loads(data)


def test_a_profile_pins_names_while_it_is_active(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port = served(spawn, tmp_path, arena)
    assert call_json(port, "GET", "/api/profiles") == {
        "active": None,
        "profiles": [
            {"id": "coding", "description": "for code", "pins": {"code": "b", "a": "c", "off": ""}}
        ],
    }
    assert call(port, "POST", "/v1/completions", {"model": "code"})[0] == 404
    assert profile(port, {"name": "coding"}) == (200, {"active": "coding"})
    assert ask(port, "code") == "b:b"
    assert ask(port, "a") == "c:c"  # pins come before model names and aliases
    status, _, data = call(port, "POST", "/v1/completions", {"model": "off"})
    assert status == 404
    assert json.loads(data)["error"]["message"] == "model 'off' is disabled by profile 'coding'"
    listed = {m["id"]: m for m in call_json(port, "GET", "/v1/models")["data"]}
    assert listed["code"]["meta"] == {"llamaswap": {"type": "profile"}}
    assert "off" not in listed
    assert profile(port, {"name": None}) == (200, {"active": None})
    assert ask(port, "a") == "a:a"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"name": "nope"}, 404, "profile 'nope' not found"),
        ({}, 400, "profile name is required"),
        ({"name": 3}, 400, "profile name must be a string or null"),
        ([1], 400, "invalid profile request"),
    ],
    ids=["unknown", "no-name", "not-a-string", "not-an-object"],
)
def test_a_bad_profile_switch_is_refused(
    spawn: Spawn, tmp_path: Path, arena: Path, body: object, status: int, message: str
) -> None:
    port = served(spawn, tmp_path, arena)
    got_status, got = profile(port, body)
    assert got_status == status
    assert isinstance(got, dict) and got["error"]["message"] == message
    assert call_json(port, "GET", "/api/profiles")["active"] is None
