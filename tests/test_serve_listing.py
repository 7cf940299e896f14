"""``vramlock serve``'s listings as llama-swap's: ``/v1/models`` with the fields a
model's capabilities render and its ``status.value``, ``/running`` with each model's
command, proxy, ttl, name and description in llama-swap's states.

The models are tests/echo_server.py; a model is loaded once it answered a request.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from helpers.processes import Spawn
from helpers.serve import ECHO, call_json, echo_model, start, write_config

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)

SEEN = (
    "    name: ' Seer '\n    description: sees\n    ttl: 300\n"
    "    metadata: {architecture: mine, family: x}\n"
    "    capabilities: {in: [text, image], out: [text], tools: true, context: 4096}\n"
)


def test_a_model_is_listed_with_what_its_capabilities_render(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    text = "models:\n" + echo_model("see", "release: restart") + SEEN + echo_model("b")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    listed = {e["id"]: e for e in call_json(port, "GET", "/v1/models")["data"]}
    see = listed["see"]
    assert (see["name"], see["description"], see["object"]) == ("Seer", "sees", "model")
    assert see["architecture"] == {"input_modalities": ["text", "image"],
                                   "output_modalities": ["text"],
                                   "modality": "text+image->text"}  # fmt: skip
    assert see["capabilities"] == {"vision": True, "function_calling": True}
    assert see["supported_parameters"] == ["tools", "tool_choice"]
    assert see["context_length"] == 4096
    # a metadata key that the capabilities render is theirs
    assert see["meta"] == {"llamaswap": {"family": "x", "type": "model"}, "n_ctx": 4096}
    assert isinstance(see["created"], int)
    assert see["status"] == listed["b"]["status"] == {"value": "unloaded"}
    assert "architecture" not in listed["b"] and "capabilities" not in listed["b"]
    assert call_json(port, "GET", "/running") == {"running": []}

    assert call_json(port, "POST", "/v1/chat/completions", {"model": "see"})["id"] == "see"
    listed = {e["id"]: e for e in call_json(port, "GET", "/v1/models")["data"]}
    assert (listed["see"]["status"], listed["b"]["status"]) == (
        {"value": "loaded"}, {"value": "unloaded"})  # fmt: skip
    assert call_json(port, "GET", "/v1/models/see")["status"] == {"value": "loaded"}
    (running,) = call_json(port, "GET", "/running")["running"]
    proxy = running.pop("proxy")
    assert proxy.startswith("http://127.0.0.1:")
    cmd = shlex.split(running.pop("cmd"))
    assert cmd[:2] == [sys.executable, str(ECHO)] and cmd[3] == "see"
    assert running == {"model": "see", "state": "ready", "ttl": 300, "name": " Seer ",
                       "description": "sees"}  # fmt: skip
