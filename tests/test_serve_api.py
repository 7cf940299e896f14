"""``vramlock serve``'s llama-swap /api/version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.processes import Spawn
from helpers.serve import call, echo_model, start, write_config

import vramlock

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


def test_version_says_vramlock_s(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    _, port = start(spawn, write_config(tmp_path, "models:\n" + echo_model("m")), arena)
    status, headers, body = call(port, "GET", "/api/version")
    assert (status, headers["Content-Type"]) == (200, "application/json; charset=utf-8")
    assert json.loads(body) == {"version": vramlock.__version__, "commit": "", "build_date": ""}


def test_version_wants_the_api_key(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    text = "apiKeys: [sk-1]\nmodels:\n" + echo_model("m", "release: restart")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    status, _, body = call(port, "GET", "/api/version")
    assert status == 401, body
    assert json.loads(body)["error"]["type"] == "authentication_error"
    assert call(port, "GET", "/api/version", headers={"x-api-key": "sk-1"})[0] == 200


def test_another_method_is_a_405(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    _, port = start(spawn, write_config(tmp_path, "models:\n" + echo_model("m")), arena)
    for method in ("POST", "PUT", "DELETE"):
        status, headers, body = call(port, method, "/api/version", {"model": "m"})
        assert (status, headers.get("Allow")) == (405, "GET, HEAD"), body
        assert json.loads(body)["error"]["message"] == (
            f"{method} /api/version: method not allowed; allowed: GET, HEAD")  # fmt: skip
