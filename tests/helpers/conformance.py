"""llama-swap's own tests, as cases against a real ``vramlock serve``.

One serve is started per configuration (a module's fixture) and many cases are asked of
it. Its models are tests/echo_server.py, which answers with what it received (method,
path, headers, body): the witness of what the upstream got is the upstream's own word.
A case that differs from llama-swap on purpose has an id ending in ``~diverges`` and its
reason in docs/serve.md; bench/conformance.py counts the cases from these ids.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from . import ROOT
from .commands import vramlock
from .net import accepts, answers_health, free_port, start_port
from .processes import kill_group, sigint_default, wait_until
from .serve import ECHO, Events, echo_model

DIVERGES = "~diverges"


def echo(name: str, *extra: str, delay: float = 0) -> str:
    """An echo model's entry, released by ending it, 1G of a budget arena's GPU."""
    return echo_model(name, "release: restart", "vram: 1G", *extra, delay=delay)


def xfail(what: str) -> pytest.MarkDecorator:
    """A case that fails today: ``what`` serve does otherwise."""
    return pytest.mark.xfail(strict=True, reason=what)


def case(id: str, *values: object, diverges: bool = False, fails: Any = None) -> Any:
    """One case of a table: its values, its id (``AREA/NAME``), its marks."""
    marks = [fails] if fails is not None else []
    return pytest.param(*values, id=id + (DIVERGES if diverges else ""), marks=marks)


def failing(cases: list[Any], mark: pytest.MarkDecorator, *ids: str) -> list[Any]:
    """``cases``, those whose id ends with one of ``ids`` marked ``mark``."""
    out = []
    for c in cases:
        hit = any(c.id.endswith(i) for i in ids)
        out.append(pytest.param(*c.values, id=c.id, marks=[*c.marks, mark]) if hit else c)
    return out


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def got(self) -> dict[str, Any]:
        """What the echo upstream said it received (its JSON answer)."""
        doc = self.json()
        assert isinstance(doc, dict) and "method" in doc, doc
        return doc

    def sent_body(self) -> Any:
        """The JSON body the echo upstream received."""
        return json.loads(self.got()["body"])


@dataclass
class Served:
    """A running ``vramlock serve``: its port, directory and output."""

    port: int
    dir: Path
    proc: subprocess.Popen[str]

    def ask(
        self,
        method: str,
        path: str,
        body: object = None,
        headers: dict[str, str] | None = None,
        data: bytes | None = None,
    ) -> Reply:
        """One request on a fresh connection (``body`` as JSON, or ``data`` as is)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            raw = data if data is not None else None if body is None else json.dumps(body)
            conn.request(method, path, body=raw, headers=headers or {})
            reply = conn.getresponse()
            return Reply(reply.status, dict(reply.getheaders()), reply.read())
        finally:
            conn.close()

    def chat(self, model: str, **more: Any) -> Reply:
        return self.ask("POST", "/v1/chat/completions", {"model": model, **more})

    def output(self) -> str:
        return (self.dir / "serve.log").read_text()


def environment(tmp: Path) -> dict[str, str]:
    """serve's environment: the test's own runtime and scratch directories."""
    for sub in ("runtime", "tmp"):
        (tmp / sub).mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp / "runtime"), "TMPDIR": str(tmp / "tmp")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    return env


@contextlib.contextmanager
def serving(tmp: Path, text: str, *args: str, budget: str | None = "16G") -> Iterator[Served]:
    """serve on the configuration ``text`` (a startPort added) in an arena of its own
    (with a GPU budget where ``budget``), once it answers; ended and reaped after."""
    env = environment(tmp)
    arena = tmp / "arena"
    arena.mkdir(mode=0o700)
    env["VRAMLOCK_ARENA"] = str(arena)
    if budget:
        subprocess.run(vramlock("arena", "--arena", str(arena), "--budget", budget),
                       check=True, capture_output=True, timeout=30, env=env)  # fmt: skip
    config = tmp / "serve.yaml"
    config.write_text(f"startPort: {start_port()}\n{text}")
    port = free_port()
    with open(tmp / "serve.log", "wb") as log:
        proc = subprocess.Popen(vramlock("serve", str(config), "--listen", str(port), *args),
                                stdout=log, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                preexec_fn=sigint_default)  # fmt: skip
    served = Served(port, tmp, proc)
    try:
        wait_until(lambda: proc.poll() is not None or answers_health(port), 30)
        assert proc.poll() is None, served.output()
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        kill_group(proc)


def refused(tmp: Path, text: str) -> tuple[int, str]:
    """serve on a configuration it must refuse: (exit status, its output)."""
    config = tmp / "refused.yaml"
    config.write_text(text)
    env = environment(tmp)
    env["VRAMLOCK_ARENA"] = str(tmp / "arena-refused")
    done = subprocess.run(vramlock("serve", str(config), "--listen", str(free_port())),
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def peer_server(name: str) -> tuple[subprocess.Popen[str], int]:
    """An echo server standing in for a peer llama-swap, once it listens."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ECHO), str(port), name], text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    wait_until(lambda: proc.poll() is not None or accepts(port), 30)
    return proc, port


def listed(served: Served) -> dict[str, dict[str, Any]]:
    reply = served.ask("GET", "/v1/models")
    assert reply.status == 200, reply
    return {m["id"]: m for m in reply.json()["data"]}


def status_of(served: Served) -> dict[str, dict[str, Any]]:
    """/api/events' first modelStatus, by id."""
    events = Events(served.port)
    try:
        return {m["id"]: m for m in events.until("modelStatus")}
    finally:
        events.close()
