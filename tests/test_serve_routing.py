"""``vramlock serve``'s routing in a budget arena: which models stay resident together,
whom serve releases for a request, unloading one model. The witness is the fake servers'
own log (each says when it starts and ends) and ``vramlock who``, not serve's view."""

from __future__ import annotations

import http.client
import itertools
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.containers import Containers
from helpers.processes import Spawn, wait_until
from helpers.serving import (
    ask,
    complete,
    fake_models,
    serve_log,
    server_events,
    start_serve,
    up,
)

from vramlock import procfs

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def budget_arena(arena: Path) -> Path:
    subprocess.run(vramlock("arena", "--arena", str(arena), "--budget", "8G"),
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


GROUPS = """\
groups:
  pair:
    swap: false
    members: [a, b]
  solo:
    members: [c, d]
  forever:
    persistent: true
    swap: false
    exclusive: false
    members: [e]
"""


def downs_before_up(tmp_path: Path, downs: set[str], model: str) -> bool:
    """Did the servers of ``downs`` end before ``model``'s last start?"""
    events = server_events(tmp_path)
    started = max(at for at, name, what in events if name == model and what == "up")
    ended = {name for at, name, what in events if what == "down" and at < started}
    return downs <= ended


def test_groups_decide_who_stays_resident_in_a_budget_arena(
    spawn: Spawn, tmp_path: Path, budget_arena: Path
) -> None:
    models = fake_models(tmp_path, ["a", "b", "c", "d", "e"])
    port = start_serve(spawn, tmp_path, GROUPS + models, budget_arena)
    for name in "eab":
        complete(port, name)
    # a and b together (swap: false), e beside them (persistent, not exclusive)
    assert up(tmp_path) == {"a", "b", "e"}
    assert resident(budget_arena) == ["a", "b", "e"]
    complete(port, "c")  # exclusive: the pair is released first; e persists
    assert up(tmp_path) == {"c", "e"}
    assert downs_before_up(tmp_path, {"a", "b"}, "c")
    complete(port, "d")  # swap: c goes
    assert up(tmp_path) == {"d", "e"}
    assert downs_before_up(tmp_path, {"c"}, "d")
    assert resident(budget_arena) == ["d", "e"]
    assert "model c: releasing it for model d (routing)" in serve_log(tmp_path)


MATRIX = """\
routing:
  router:
    use: matrix
    settings:
      matrix:
        evict_costs: {c: 10}
        sets:
          pairs: "(a | b) & c"
"""


def test_the_matrix_decides_who_stays_resident_in_a_budget_arena(
    spawn: Spawn, tmp_path: Path, budget_arena: Path
) -> None:
    port = start_serve(spawn, tmp_path, MATRIX + fake_models(tmp_path, ["a", "b", "c", "d"]),
                       budget_arena)  # fmt: skip
    for name in "ac":
        complete(port, name)
    assert up(tmp_path) == {"a", "c"}
    complete(port, "b")  # [b, c]: a goes, c stays
    assert up(tmp_path) == {"b", "c"}
    assert downs_before_up(tmp_path, {"a"}, "b")
    complete(port, "d")  # in no set: alone
    assert up(tmp_path) == {"d"}
    assert resident(budget_arena) == ["d"]


def test_rules_an_arena_without_a_budget_cannot_honour_are_said_once(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = start_serve(spawn, tmp_path, GROUPS + fake_models(tmp_path, list("abcde")), arena)
    complete(port, "a")
    complete(port, "c")
    assert up(tmp_path) == {"c"}
    said = [line for line in serve_log(tmp_path).splitlines() if "routing lets" in line]
    assert said == [f"vramlock: {tmp_path / 'serve.yaml'}:2: routing lets a and b be resident"
                    " together, but their arena has no budget (vramlock arena --budget): one"
                    " model is resident there at a time"]  # fmt: skip


def test_a_model_not_released_within_unload_timeout_is_stopped_hard(
    spawn: Spawn, tmp_path: Path, budget_arena: Path
) -> None:
    # a refuses to step aside for a minute (min_hold); unloadTimeout 0 is the top level's
    models = fake_models(tmp_path, ["a", "b"], a="min_hold: 60\nunloadTimeout: 0")
    port = start_serve(spawn, tmp_path, "unloadTimeout: 1\n" + models, budget_arena)
    pids = {name: complete(port, name)["pid"] for name in "ab"}
    started = time.monotonic()
    assert ask(port, "POST", "/models/unload/a") == (200, {"model": "a", "released": True})
    assert time.monotonic() - started < 15
    assert not procfs.living(pids["a"])
    assert resident(budget_arena) == ["b"]
    assert "model a: not released within unloadTimeout, 1 s; stopping it" in serve_log(tmp_path)
    assert complete(port, "a")["pid"] != pids["a"]  # started again on its next request
    assert complete(port, "b")["pid"] == pids["b"]


def test_a_response_head_later_than_timeouts_response_header_is_a_504(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    slow = 'env: ["DELAY=5"]\ntimeouts:\n  responseHeader: 1\n  connect: 0\n  keepalive: 30'
    port = start_serve(spawn, tmp_path, fake_models(tmp_path, ["a"], a=slow), arena)
    started = time.monotonic()
    status, reply = ask(port, "POST", "/v1/completions", {"model": "a"})
    assert time.monotonic() - started < 4.5
    assert status == 504
    assert reply["error"]["message"] == (
        "model a: no response head within timeouts.responseHeader, 1 s"
    )
    assert "timeouts: keepalive ignored: serve reaches each model on loopback" in serve_log(
        tmp_path
    )


def test_cmd_stop_is_a_container_s_release_and_the_token_waits_for_it(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    boxes = Containers(spawn, tmp_path / "containers")
    port = start_serve(spawn, tmp_path, boxes.models(["a", "b"]), arena)
    first = complete(port, "a")
    cmd_pid = int(boxes.read("a.cmd"))
    complete(port, "b")  # a's turn ends: cmdStop stops its container first
    assert boxes.read("a.stopped-for") == str(cmd_pid)  # ${PID}: a's cmd
    assert complete(port, "a")["pid"] != first["pid"]  # a new container on its turn
    spans = boxes.on_gpu()
    assert [s[0] for s in spans] == ["a", "b", "a"]
    for before, after in itertools.pairwise(spans):  # each stopped before the next began
        assert before[3] < after[2], spans


def test_a_failing_cmd_stop_keeps_the_model_resident_and_says_why(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    boxes = Containers(spawn, tmp_path / "containers")
    config = "unloadTimeout: 2\n" + boxes.models(["a"], stop="3")
    port = start_serve(spawn, tmp_path, config, arena)
    pid = complete(port, "a")["pid"]
    status, said = ask(port, "POST", "/models/unload/a")
    assert status == 500, said
    assert said["error"]["message"] == (
        "not unloaded: model a: cmdStop did not stop it within unloadTimeout, 2 s; it keeps the GPU"
    )
    log = serve_log(tmp_path)
    assert "release failed: --on-release command exited with status 3; staying resident" in log
    assert "model a: cmdStop did not stop it within unloadTimeout, 2 s; it keeps the GPU" in log
    assert resident(arena) == ["a"]
    before = boxes.on_gpu()[-1][3]
    wait_until(lambda: boxes.on_gpu()[-1][3] > before)  # still running
    assert complete(port, "a")["pid"] == pid


def test_queued_requests_of_a_higher_priority_model_go_first(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    scheduler = "routing:\n  scheduler:\n    settings:\n      fifo:\n        priority: {c: 10}\n"
    models = fake_models(tmp_path, ["a", "b", "c"], a='env: ["DELAY=1.5"]')
    port = start_serve(spawn, tmp_path, scheduler + models, arena)
    complete(port, "a")
    with ThreadPoolExecutor(3) as pool:
        held = pool.submit(complete, port, "a")  # a's turn, for 1.5 s
        time.sleep(0.4)
        low = pool.submit(complete, port, "b")  # queued first
        time.sleep(0.4)
        high = pool.submit(complete, port, "c")  # queued later, higher priority
        for done in (held, low, high):
            done.result()
    ups = [name for _, name, what in server_events(tmp_path) if what == "up"]
    assert ups == ["a", "c", "b"]


def test_a_websocket_through_upstream_evicts_as_a_request_does(
    spawn: Spawn, tmp_path: Path, budget_arena: Path
) -> None:
    text = "groups:\n  g:\n    members: [a, b]\n" + fake_models(tmp_path, ["a", "b"])
    port = start_serve(spawn, tmp_path, text, budget_arena)
    complete(port, "a")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/upstream/b/ws", headers={
        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})  # fmt: skip
    assert conn.getresponse().status == 502  # b's server speaks no websocket; it started
    conn.close()
    assert up(tmp_path) == {"b"}
    assert downs_before_up(tmp_path, {"a"}, "b")


def test_an_exclusive_model_releases_a_non_exclusive_one_between_its_requests(
    spawn: Spawn, tmp_path: Path, budget_arena: Path
) -> None:
    # The models of two non-exclusive groups are served side by side; an exclusive
    # model releases them, but only once the request one of them is serving has ended.
    groups = ("groups:\n  par1: {swap: true, exclusive: false, members: [p1]}\n"
              "  par2: {swap: true, exclusive: false, members: [p2]}\n"
              "  ex: {swap: true, exclusive: true, members: [x1]}\n")  # fmt: skip
    # p1's request outlasts its unloadTimeout: released while serving it, it is cut
    slow = 'env: ["DELAY=1.5"]\nunloadTimeout: 0.5'
    models = fake_models(tmp_path, ["p1", "p2", "x1"], p1=slow)
    port = start_serve(spawn, tmp_path, groups + models, budget_arena)
    assert complete(port, "p2")["model"] == "p2"
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(complete, port, "p1")  # 1.5 s in p1's server
        wait_until(lambda: "p1" in up(tmp_path), timeout=30)
        assert up(tmp_path) == {"p1", "p2"}  # side by side
        assert complete(port, "x1")["model"] == "x1"
        assert asked.result(timeout=30)["model"] == "p1"  # answered, not cut
    assert up(tmp_path) == {"x1"}
    ended = {name: at for at, name, what in server_events(tmp_path) if what == "down"}
    began = {name: at for at, name, what in server_events(tmp_path) if what == "up"}
    assert ended["p1"] >= began["p1"] + 1.5  # its request was over before it was released
