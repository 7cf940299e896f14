"""llama-swap's router tests (its ``internal/router`` groups and loading stream), as
cases against a real ``vramlock serve``.

The group cases' witness is the fake model servers' own log: each says when it starts
("up") and when it is ended ("down"). One serve runs every group case: its groups keep
the cases' models apart, and each case begins with every model unloaded.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.conformance import Reply, Served, case, echo, refused, serving
from helpers.net import free_ports
from helpers.processes import wait_until
from helpers.serve import sse
from helpers.serving import FAKE_SERVER, server_events, up

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(120)

# Each case's groups, as llama-swap's tests have them (swap, exclusive, persistent).
GROUPS = """\
healthCheckTimeout: 30
groups:
  swap: {swap: true, exclusive: true, members: [s1, s2]}
  noswap: {swap: false, exclusive: false, members: [n1, n2]}
  ex1: {swap: true, exclusive: true, members: [x1]}
  ex2: {swap: true, exclusive: true, members: [x2]}
  par1: {swap: true, exclusive: false, members: [p1]}
  par2: {swap: true, exclusive: false, members: [p2]}
  ser: {swap: true, exclusive: false, members: [r1, r2]}
  persist: {swap: true, exclusive: false, persistent: true, members: [k1]}
  other: {swap: true, exclusive: true, members: [k2]}
  exa: {swap: true, exclusive: true, members: [e1]}
  nonex: {swap: true, exclusive: false, members: [e2]}
"""
NAMES = ["s1", "s2", "n1", "n2", "x1", "x2", "p1", "p2", "r1", "r2", "k1", "k2", "e1", "e2"]


def models(tmp: Path) -> str:
    """The fake servers' entries; p1 and p2 each wait (3 s at most) for the other to
    begin starting, and say in a file whether it did: if serve started them one after
    the other, the first would not see the second begin."""
    script = tmp / "fake_server.py"
    script.write_text(FAKE_SERVER)
    lines = ["models:"]
    for name, port in zip(NAMES, free_ports(len(NAMES)), strict=True):
        cmd = f"{sys.executable} {script} {port} {name} {tmp / 'servers.log'}"
        if name in ("p1", "p2"):
            peer = "p2" if name == "p1" else "p1"
            other, i = tmp / f"{peer}.began", "i=$((i+1))"
            wait = f"i=0; until [ -e {other} ] || [ $i -ge 300 ]; do sleep 0.01; {i}; done"
            met = f"if [ -e {other} ]; then touch {tmp / name}.met; fi"
            cmd = f"sh -c 'touch {tmp / name}.began; {wait}; {met}; exec {cmd}'"
        lines += [f"  {name}:", f"    cmd: {cmd}", f"    proxy: http://127.0.0.1:{port}",
                  "    release: restart", "    vram: 1G"]  # fmt: skip
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("groups")
    with serving(tmp, GROUPS + models(tmp)) as served:
        yield served


def fresh(served: Served) -> None:
    """Every model unloaded, by the servers' own log."""
    assert served.ask("GET", "/unload").status == 200
    wait_until(lambda: not up(served.dir), 30)


def load(served: Served, model: str) -> None:
    reply = served.ask("POST", "/v1/completions", {"model": model})
    assert reply.status == 200, reply
    assert reply.json()["model"] == model


def starts(served: Served, model: str) -> int:
    return sum(1 for _, name, what in server_events(served.dir) if name == model and what == "up")


# (loaded first, then asked for, the models up after, the models that were ended)
SEQUENTIAL = [
    case("groups/swap-stops-previous", "s1", "s2", {"s2"}, {"s1"}),
    case("groups/non-swap-group-no-stop", "n1", "n2", {"n1", "n2"}, set()),
    case("groups/cross-group-exclusive", "x1", "x2", {"x2"}, {"x1"}),
    case("groups/persistent-not-evicted", "k1", "k2", {"k1", "k2"}, set()),
    case("groups/non-exclusive-does-not-unload-exclusive", "e1", "e2", {"e1", "e2"}, set()),
]


@pytest.mark.parametrize(("first", "then", "after", "ended"), SEQUENTIAL)
def test_a_group_s_rules_decide_who_is_stopped(
    groups: Served, first: str, then: str, after: set[str], ended: set[str]
) -> None:
    fresh(groups)
    load(groups, first)
    before = starts(groups, then)
    load(groups, then)
    assert up(groups.dir) == after
    assert starts(groups, then) == before + 1  # started once for the request
    for name in ended:
        assert starts(groups, name) >= 1 and name not in up(groups.dir)


def both(served: Served, a: str, b: str) -> list[int]:
    """Requests for ``a`` and ``b`` at once: their statuses."""
    statuses: list[int] = []

    def one(model: str) -> None:
        statuses.append(served.ask("POST", "/v1/completions", {"model": model}).status)

    threads = [threading.Thread(target=one, args=(m,)) for m in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return statuses


@pytest.mark.parametrize("_", [case("groups/cross-group-non-exclusive-parallel", None)])
def test_two_non_exclusive_groups_load_in_parallel(groups: Served, _: None) -> None:
    fresh(groups)
    assert both(groups, "p1", "p2") == [200, 200]
    assert up(groups.dir) == {"p1", "p2"}
    assert (groups.dir / "p1.met").exists() and (groups.dir / "p2.met").exists()


def overlapped(served: Served, a: str, b: str) -> bool:
    """Were ``a``'s and ``b``'s servers ever up at once, by their log?"""
    running: set[str] = set()
    for _, name, what in server_events(served.dir):
        (running.add if what == "up" else running.discard)(name)
        if {a, b} <= running:
            return True
    return False


@pytest.mark.parametrize("_", [case("groups/same-group-swap-serialises", None)])
def test_one_swapping_group_runs_one_model_even_when_asked_for_two_at_once(
    groups: Served, _: None
) -> None:
    fresh(groups)
    assert both(groups, "r1", "r2") == [200, 200]
    assert len(up(groups.dir) & {"r1", "r2"}) == 1
    assert not overlapped(groups, "r1", "r2")


@pytest.mark.parametrize("_", [case("groups/duplicate-membership-refused", None)])
def test_a_model_in_two_groups_is_refused(tmp_path: Path, _: None) -> None:
    text = "groups:\n  g1: {members: [a]}\n  g2: {members: [a]}\nmodels:\n" + echo("a")
    status, said = refused(tmp_path, text)
    assert status == 2, said
    lines = said.strip().splitlines()
    assert len(lines) == 1 and "a" in lines[0] and "Traceback" not in said, said


# -- the loading stream (sendLoadingState) -----------------------------------------------


@pytest.fixture(scope="module")
def loading(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("loading")
    text = "sendLoadingState: true\nmodels:\n" + "".join(echo(m) for m in ("a", "b", "c"))
    with serving(tmp, text) as served:
        yield served


def reasoning(body: bytes) -> str:
    """The loading stream's text: its chunks' reasoning_content."""
    said = ""
    for chunk in sse(body):
        delta = chunk.get("choices", [{}])[0].get("delta", {})
        said += delta.get("reasoning_content", "")
    return said


@pytest.fixture(scope="module")
def first_stream(loading: Served) -> Reply:
    """A streaming chat for model a, not loaded: answered while it loads."""
    return loading.chat("a", stream=True)


def _contents(reply: Reply) -> list[str | None]:
    return [c["choices"][0]["delta"].get("content") for c in sse(reply.body)]


STREAM_FACTS = [
    case("loading/sse-headers", lambda r: r.status == 200
         and r.headers["Content-Type"] == "text/event-stream"
         and r.headers["Cache-Control"] == "no-cache"),
    case("loading/initial-separator", lambda r: r.body.startswith(b"data: ")
         and reasoning(r.body).startswith("━━━━━\n")),
    case("loading/send-data-format", lambda r: b'"reasoning_content": ' in r.body),
    case("loading/done-when-loaded", lambda r: "\nDone! (" in reasoning(r.body)),
    case("loading/write-passthrough", lambda r: _contents(r)[-2:] == ["a", " done"]),
    case("loading/send-line", lambda r: "loading model: a\n" in reasoning(r.body)),
]  # fmt: skip


@pytest.mark.parametrize("holds", STREAM_FACTS)
def test_a_chat_stream_for_a_model_not_loaded_says_it_loads(
    first_stream: Reply, holds: Callable[[Reply], bool]
) -> None:
    assert holds(first_stream), (first_stream.headers, first_stream.body[:2000])


LOADING_PATHS = [
    case("loading/is-loading-path-chat", "/v1/chat/completions", True),
    case("loading/is-loading-path-chat-extra", "/v1/chat/completions/extra", True),
    case("loading/is-loading-path-completions", "/v1/completions", False),
    case("loading/is-loading-path-embeddings", "/v1/embeddings", False),
]


@pytest.mark.parametrize(("path", "streams"), LOADING_PATHS)
def test_only_chat_paths_get_the_loading_stream(loading: Served, path: str, streams: bool) -> None:
    assert loading.ask("GET", "/unload").status == 200
    reply = loading.ask("POST", path, {"model": "b", "stream": True})
    assert reply.status == 200
    assert ("loading model: b" in reasoning(reply.body)) is streams


@pytest.mark.parametrize(
    "_", [case("loading/initial-message-names-llama-swap", None, diverges=True)]
)  # fmt: skip
def test_the_loading_message_names_vramlock(loading: Served, _: None) -> None:
    assert loading.ask("GET", "/unload").status == 200
    said = reasoning(loading.chat("c", stream=True).body)
    assert "vramlock loading model: c\n" in said


@pytest.mark.parametrize("_", [case("loading/write-header-once", None)])
def test_the_loading_stream_answers_200_whatever_the_model_says(loading: Served, _: None) -> None:
    assert loading.ask("GET", "/unload").status == 200
    reply = loading.chat("a", stream=True, status=201)
    assert reply.status == 200 and "Done!" in reasoning(reply.body)
