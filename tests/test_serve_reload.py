"""``vramlock serve --watch-config``: a changed file served without restarting the rest.

Each model is tests/echo_server.py in an arena of its own (so that both stay resident),
which says ``NAME listening`` each time it starts: an unchanged model's history holds
it once, however often the file changes.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers.net import free_port
from helpers.processes import Spawn, wait_until
from helpers.serve import call, call_json, echo_model, start

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(120)


def models(tmp_path: Path) -> str:
    """a and b (whose server has ``B=old`` in its environment), each in an arena of its
    own; a asks its server for ``a``."""
    for name in ("a", "b", "c"):
        (tmp_path / f"arena-{name}").mkdir(mode=0o700, exist_ok=True)
    text = "models:\n" + echo_model("a", "release: restart", "arena: arena-a", "useModelName: a")
    return text + echo_model("b", "release: restart", "arena: arena-b", "env: [B=old]")


def history(port: int) -> str:
    return call(port, "GET", "/logs")[2].decode()


def model_of(port: int, name: str) -> str:
    got = call_json(port, "POST", "/v1/completions", {"model": name})
    return f"{got['id']}:{json.loads(got['body'])['model']}"


def resident(port: int) -> list[str]:
    running = call_json(port, "GET", "/running")["running"]
    return sorted(r["model"] for r in running if r["state"] == "ready")


def rewrite(path: Path, text: str) -> None:
    """Write ``text`` so that the watcher sees a change (a size or time that differs)."""
    before = path.stat()
    path.write_text(text)
    while (path.stat().st_mtime_ns, path.stat().st_size) == (before.st_mtime_ns, before.st_size):
        time.sleep(0.01)
        path.write_text(text)


def test_a_changed_file_restarts_only_what_changed(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = tmp_path / "serve.yaml"
    # logToStdout both: /logs, the combined log, holds the models' output too
    head = f"logToStdout: both\nstartPort: {free_port()}\n"
    first = head + models(tmp_path)
    path.write_text(first)
    _, port = start(spawn, path, arena, "--watch-config")
    assert model_of(port, "a") == "a:a" and model_of(port, "b") == "b:b"
    wait_until(lambda: resident(port) == ["a", "b"], 30)

    c = echo_model("c", "release: restart", "arena: arena-c")
    # b's environment changes: its server restarts; a's useModelName and aliases are
    # serve's own: they change at once, a keeps running
    second = first.replace("B=old", "B=new").replace("useModelName: a", "useModelName: a2")
    rewrite(path, second.replace("arena: arena-a", "arena: arena-a\n    aliases: [aa]") + c)
    wait_until(lambda: "reloaded; models started afresh: b, c" in history(port), 30)
    assert resident(port) == ["a"]  # a kept running, resident all along; b ended
    assert model_of(port, "b") == "b:b" and model_of(port, "c") == "c:c"
    assert model_of(port, "a") == "a:a2" and model_of(port, "aa") == "a:a2"
    assert history(port).count("a listening") == 1
    assert history(port).count("b listening") == 2

    rewrite(path, head + "models: [not, a, mapping\n")
    wait_until(lambda: "the configuration in use is kept" in history(port), 30)
    assert f"{path}:4: not valid YAML" in history(port)
    assert model_of(port, "c") == "c:c" and model_of(port, "b") == "b:b"
    assert history(port).count("a listening") == 1


def test_without_the_option_the_file_is_read_once(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = tmp_path / "serve.yaml"
    # logToStdout both: /logs, the combined log, holds the models' output too
    head = f"logToStdout: both\nstartPort: {free_port()}\n"
    first = head + models(tmp_path)
    path.write_text(first)
    _, port = start(spawn, path, arena)
    rewrite(path, first.replace("useModelName: a", "useModelName: a2"))
    time.sleep(1.5)  # three polls' time
    assert model_of(port, "a") == "a:a"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_file_that_is_no_regular_file_is_refused_and_serve_answers(
    spawn: Spawn, tmp_path: Path, arena: Path, kind: str
) -> None:
    """A FIFO (a read would wait for a writer) or a link to /dev/zero (a read would never
    end) in the file's place: refused with the reason, /health answered all along."""
    path = tmp_path / "serve.yaml"
    path.write_text(f"startPort: {free_port()}\nmodels:\n" + echo_model("a"))
    proc, port = start(spawn, path, arena, "--watch-config")
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    what = "a FIFO" if kind == "fifo" else "a character device"
    began = time.monotonic()
    while time.monotonic() - began < 2.0:  # four looks of the watcher
        assert _health(port) == 200
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    said = (f"vramlock: {path}: cannot read it: {what}, not a regular file; the configuration"
            " in use is kept")  # fmt: skip
    assert err.count(said) == 1, err


def test_sighup_reads_the_file_again_and_serve_goes_on(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """As llama-swap: SIGHUP reloads the configuration (with or without --watch-config)."""
    path = tmp_path / "serve.yaml"
    path.write_text(f"startPort: {free_port()}\nmodels:\n" + echo_model("a"))
    proc, port = start(spawn, path, arena)
    path.write_text(path.read_text() + echo_model("b"))
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "b" in [m["id"] for m in call_json(port, "GET", "/v1/models")["data"]])
    assert proc.poll() is None
    assert call_json(port, "POST", "/v1/completions", {"model": "b"})["id"] == "b"


def _health(port: int) -> int:
    """GET /health's status, answered within a second."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()
