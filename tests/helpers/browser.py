"""A headless chromium (Debian's), driven over the DevTools protocol, for the tests of
the live page (``vramlock ui``, serve's ``/ui``); ``needs_browser`` skips without one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .processes import Spawn, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium (apt-get install chromium)"
)


class Browser:
    """A headless chromium showing ``url``, asked through its DevTools websocket."""

    def __init__(self, spawn: Spawn, url: str, scratch: Path) -> None:
        assert CHROMIUM is not None
        # Its sockets go in its profile, TMPDIR and XDG_RUNTIME_DIR: a test's own
        # directories are too long a path for a socket's name.
        profile = scratch / "profile"
        env = {**os.environ, "TMPDIR": str(scratch), "XDG_RUNTIME_DIR": str(scratch)}
        self.proc = spawn([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", "--remote-debugging-port=0",
                           f"--user-data-dir={profile}", "--window-size=420,900", url],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=env)  # fmt: skip
        active = profile / "DevToolsActivePort"
        wait_until(lambda: active.exists() and active.read_text().count("\n") >= 1, 60)
        port = active.read_text().split("\n")[0]
        pages: list[dict[str, Any]] = []

        def listed() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages[:] = [t for t in json.load(r) if t["type"] == "page"]
            return bool(pages)

        wait_until(listed, 60)
        self.ws = pages[0]["webSocketDebuggerUrl"]

    def call(self, method: str, **params: Any) -> Any:
        async def once() -> Any:
            import aiohttp

            async with aiohttp.ClientSession() as s, s.ws_connect(self.ws, max_msg_size=0) as ws:
                await ws.send_json({"id": 1, "method": method, "params": params})
                async for msg in ws:
                    answer = json.loads(msg.data)
                    if answer.get("id") == 1:
                        return answer["result"]
            raise AssertionError(f"no answer to {method}")

        return asyncio.run(once())

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def members(self) -> list[list[str]]:
        found = self.evaluate(
            "JSON.stringify([...document.querySelectorAll('.member')]"
            ".map(e => [e.dataset.name, e.dataset.state]))"
        )
        return json.loads(found) if found else []
