"""``--release http --preset llama-server`` against a real llama-server (CPU, tiny model).

A wrapped server answers a prompt; a witness takes the token (the server saved its slot
and ended: none of its processes lives when the witness holds the token); the witness
leaves; the server is started again and its slot restored; the same prompt is then
served from the restored cache (``timings.cache_n``). Also under ``--release auto``,
which recognises ``llama-server``. Skips without the binary tools/llama_server.py caches.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.engines import Witness
from helpers.llama import PROMPT, call, llama_binary, needs_llama
from helpers.net import free_port
from helpers.processes import Spawn, wait_until

BINARY = llama_binary()

pytestmark = [needs_llama(BINARY), pytest.mark.timeout(120)]


def complete(port: int) -> dict[str, Any]:
    status, reply = call(port, "POST", "/completion", {"prompt": PROMPT, "n_predict": 4})
    assert status == 200, reply
    timings: dict[str, Any] = reply["timings"]
    return timings


def healthy(port: int) -> bool:
    try:
        return call(port, "GET", "/health")[0] == 200
    except OSError:
        return False


@pytest.mark.parametrize(
    ("options", "extra", "strategy"),
    [(["--release", "http", "--preset", "llama-server"], [], "http:llama-server"),
     ([], [], "auto:http:llama-server"),
     # GET /slots answers 501; the slots are counted by /props and saved all the same.
     (["--preset", "llama-server"], ["--no-slots"], "http:llama-server")],
    ids=["preset", "auto", "no-slots"],
)  # fmt: skip
def test_the_prompt_cache_survives_a_swap(
    arena: Path,
    spawn: Spawn,
    tmp_path: Path,
    model: Path,
    options: list[str],
    extra: list[str],
    strategy: str,
) -> None:
    port = free_port()
    out = tmp_path / "run.log"
    server = [str(BINARY), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
              "-np", "1", "-c", "1024", "-t", "1", *extra]  # fmt: skip
    with open(out, "w") as log:
        job = spawn(
            vramlock("run", "--arena", str(arena), "--min-hold", "0", *options, "--", *server),
            stdout=log,
            stderr=log,
        )
    wait_until(lambda: healthy(port) or job.poll() is not None, timeout=30)
    assert job.poll() is None, out.read_text()[-2000:]
    member = who_json(arena)[0]
    assert member["strategy"] == strategy
    first = member["child_pid"]
    argv = Path(f"/proc/{first}/cmdline").read_bytes().split(b"\0")
    slots = Path(argv[argv.index(b"--slot-save-path") + 1].decode())  # added by the preset

    cold = complete(port)
    assert cold["cache_n"] == 0
    pids = tmp_path / "pids"
    pids.write_text(f"0 start {first}\n")
    turn = Witness(tmp_path, arena, pids, hold=0.5).turn()
    assert turn.alive == []  # the server had ended when the witness got the token
    wait_until(lambda: who_json(arena)[0]["state"] == "resident", timeout=30)
    assert who_json(arena)[0]["child_pid"] != first  # started again

    warm = complete(port)
    assert warm["cache_n"] == cold["prompt_n"] - 1  # all but the last token: restored
    assert warm["prompt_n"] == 1
    os.kill(job.pid, signal.SIGTERM)
    job.wait(30)
    assert not slots.exists()  # the private slot directory went with the run
    said = [ln for ln in out.read_text().splitlines() if ln.startswith("vramlock:")]
    assert said == []
