"""``vramlock serve``'s newer llama-swap keys: upstream.ignorePaths, peers, sendLoadingState.

The models and the peers are tests/echo_server.py, which answers what it received.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.net import accepts, free_port
from helpers.processes import Spawn, wait_until
from helpers.serve import ECHO, call, call_json, echo_model, sse, start, write_config

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


def running(port: int) -> list[str]:
    return [r["model"] for r in call_json(port, "GET", "/running")["running"]]


@pytest.mark.parametrize("listed", [None, ["^/ws$"]], ids=["default", "given"])
def test_ignored_paths_do_not_bring_a_model_in(
    spawn: Spawn, tmp_path: Path, arena: Path, listed: list[str] | None
) -> None:
    text = "" if listed is None else f"upstream:\n  ignorePaths: {json.dumps(listed)}\n"
    path = write_config(tmp_path, text + "models:\n" + echo_model("m", "release: restart"))
    _, port = start(spawn, path, arena)
    ignored = "/upstream/m/static/app.js" if listed is None else "/upstream/m/ws"
    status, _, body = call(port, "GET", ignored)
    assert status == 409, body
    message = json.loads(body)["error"]["message"]
    assert message == "model m is not loaded; path matches upstream.ignorePaths"
    assert running(port) == []
    if listed is not None:  # the default is replaced: app.js brings it in
        assert call_json(port, "GET", "/upstream/m/static/app.js")["path"] == "/static/app.js"
    else:
        call_json(port, "POST", "/v1/completions", {"model": "m"})
    wait_until(lambda: running(port) == ["m"], 30)
    # resident: passed through
    assert call_json(port, "GET", ignored)["path"] == ignored[len("/upstream/m") :]


def test_a_bad_ignore_path_is_a_config_error(spawn: Spawn, tmp_path: Path) -> None:
    from vramlock.serve.config import ConfigError, load

    path = write_config(tmp_path, "upstream:\n  ignorePaths: ['(x']\nmodels:\n" + echo_model("m"))
    with pytest.raises(ConfigError) as err:
        load(str(path), lambda text, what: 1.0)
    assert str(err.value).startswith(f"{path}:3: upstream.ignorePaths: invalid regular")


def peer(spawn: Spawn, name: str) -> int:
    port = free_port()
    spawn([sys.executable, str(ECHO), str(port), name])
    wait_until(lambda: accepts(port), 30)
    return port


PEERS = """\
peers:
  p:
    proxy: http://127.0.0.1:{p}/api
    apiKey: sk-peer
    models: [remote-a, shared, local]
    filters:
      stripParams: top_k
      setParams: {{temperature: 0.5}}
  q:
    proxy: http://127.0.0.1:{q}
    models: [shared, only-q]
models:
"""


def test_peers_get_their_requests_with_their_key(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    text = PEERS.format(p=peer(spawn, "peer-p"), q=peer(spawn, "peer-q"))
    _, port = start(
        spawn, write_config(tmp_path, text + echo_model("local", "release: restart")), arena
    )

    def ask(model: str, **headers: str) -> dict[str, Any]:
        body = {"model": model, "top_k": 3, "messages": []}
        got: dict[str, Any] = call_json(port, "POST", "/v1/chat/completions", body,
                                        headers=headers)  # fmt: skip
        return got

    for name in ("p/remote-a", "remote-a"):
        got = ask(name, Authorization="Bearer from-the-client")
        assert got["id"] == "peer-p" and got["path"] == "/api/v1/chat/completions"
        assert json.loads(got["body"]) == {"model": "remote-a", "temperature": 0.5, "messages": []}
        assert got["headers"]["Authorization"] == "Bearer sk-peer"
        assert got["headers"]["x-api-key"] == "sk-peer"
    got = ask("only-q", Authorization="Bearer from-the-client")
    assert got["id"] == "peer-q" and "x-api-key" not in got["headers"]
    assert got["headers"]["Authorization"] == "Bearer from-the-client"
    assert json.loads(got["body"])["top_k"] == 3  # p's filters are p's
    assert ask("q/shared")["id"] == "peer-q"
    assert running(port) == []  # no process, no arena for a peer
    status, _, _ = call(port, "POST", "/v1/chat/completions", {"model": "shared"})
    assert status == 404  # two peers have it: it must be qualified
    assert ask("local")["id"] == "local"  # locals first
    assert ask("p/local")["id"] == "peer-p"
    # /upstream/PEER/MODEL/PATH: passed through to the peer, with its key
    got = call_json(port, "GET", "/upstream/p/remote-a/v1/props?x=1")
    assert got["id"] == "peer-p" and got["path"] == "/api/v1/props?x=1"
    assert got["headers"]["x-api-key"] == "sk-peer"
    assert call_json(port, "GET", "/upstream/only-q/health")["path"] == "/health"
    listed = {m["id"]: m for m in call_json(port, "GET", "/v1/models")["data"]}
    assert list(listed) == sorted(["local", "p/remote-a", "p/shared", "p/local", "q/shared",
                                   "q/only-q"])  # sorted by id, as llama-swap's  # fmt: skip
    assert listed["p/remote-a"]["name"] == "p: remote-a"
    assert listed["p/remote-a"]["meta"] == {"llamaswap": {"type": "peer", "peerID": "p"}}
    # retrieved as it is listed (the openai client's models.retrieve)
    assert call_json(port, "GET", "/v1/models/p/remote-a") == listed["p/remote-a"]


def chat(port: int, model: str) -> tuple[str, str]:
    """A streaming chat: (its reasoning_content, its content), as a client reads them."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    status, headers, data = call(port, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    deltas = [c["choices"][0]["delta"] for c in sse(data)]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if "content" in d]
    if reasoning:  # all of the loading state comes first
        assert all("content" not in d for d in deltas[: len(reasoning)])
    return "".join(reasoning), "".join(content)


def test_send_loading_state_streams_progress_while_the_model_loads(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    text = ("sendLoadingState: true\nmodels:\n" + echo_model("m", "release: restart", delay=2)
            + echo_model("quiet", "release: restart", "sendLoadingState: false"))  # fmt: skip
    _, port = start(spawn, write_config(tmp_path, text), arena)
    reasoning, content = chat(port, "m")
    assert reasoning.startswith("━━━━━\nvramlock loading model: m\n")
    assert ".." in reasoning and "\nDone! (" in reasoning  # a dot each 0.75 s of 2 s
    assert content == "m done"
    assert chat(port, "m") == ("", "m done")  # resident now: nothing to wait for
    assert chat(port, "quiet") == ("", "quiet done")


def test_a_peer_s_response_header_bound_is_a_504_naming_it(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """A peer that takes the request and never answers: serve gives up after its
    timeouts.responseHeader, as llama-swap does (whose default for peers is 60 s)."""
    with socket.socket() as silent:  # connections wait in its backlog, never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        text = (f"peers:\n  far:\n    proxy: http://127.0.0.1:{silent.getsockname()[1]}\n"
                "    models: [m]\n    timeouts:\n      responseHeader: 1\n"
                "      keepalive: 5\nmodels:\n" + echo_model("local"))  # fmt: skip
        _, port = start(spawn, write_config(tmp_path, text), arena)
        began = time.monotonic()
        status, _, body = call(port, "POST", "/v1/chat/completions", {"model": "far/m"})
        took = time.monotonic() - began
    assert status == 504, body
    assert json.loads(body)["error"]["message"] == (
        "peer far: no response head within timeouts.responseHeader, 1 s"
    )
    assert 1.0 <= took < 10


def test_get_routes_that_name_their_model_in_the_query(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """llama-swap's /props, /v1/audio/voices and /sdapi/v1/loras take ?model=NAME; its
    /models is /v1/models."""
    text = "peers:\n  p:\n    proxy: http://127.0.0.1:{p}\n    models: [far]\nmodels:\n"
    text = text.format(p=peer(spawn, "peer-p")) + echo_model("m", "release: restart",
                                                               "aliases: [al]")  # fmt: skip
    _, port = start(spawn, write_config(tmp_path, text), arena)
    assert running(port) == []
    for path in ("/props", "/v1/audio/voices", "/sdapi/v1/loras"):
        got = call_json(port, "GET", f"{path}?model=al&x=1")
        assert (got["id"], got["method"], got["path"]) == ("m", "GET", f"{path}?model=al&x=1")
    assert running(port) == ["m"]  # brought in as a POST would
    got = call_json(port, "GET", "/props?model=p/far")
    assert (got["id"], got["path"]) == ("peer-p", "/props?model=far")
    status, _, body = call(port, "GET", "/props")
    assert (status, json.loads(body)["error"]["message"]) == (
        400, "the request must name its model: ?model=NAME")  # fmt: skip
    status, _, body = call(port, "GET", "/props?model=nope")
    assert status == 404 and json.loads(body)["models"] == ["m", "al"]
    assert call_json(port, "GET", "/models") == call_json(port, "GET", "/v1/models")
