"""An HTTP server that keeps its state on the GPU, for the GPU tests: weights and a cache.

    python tests/gpu_server.py --port 9000 [--gib 1] [--device cuda|cpu] [--seed 1234]

The stand-in for an inference server run unmodified under ``vramlock run --release
checkpoint`` (tests/test_gpu_server.py). It fills ``--gib`` GiB of device memory with
seeded random data (the weights), then listens on 127.0.0.1:PORT and prints
``ready <pid>``. It binds only once the weights are loaded, so a client that gets a
connection gets an answer. Requests (JSON in, JSON out):

- ``GET /health``: ``{"status": "ok"}``;
- ``POST /complete`` with ``{"prompt": "..."}``: the prompt's cache entry, computed on
  the device from the prompt and the weights (a few MiB) the first time and kept on the
  device in a dict from then on, like a KV cache. The answer says ``pid``, ``cached``
  (the entry was already there: it comes from memory kept since an earlier request),
  ``value`` (an exact checksum of the entry, computed on the device now), ``weights``
  (the same for the weights), ``consistent`` (the entry equals one computed afresh
  from the weights now) and ``started`` (when the process started, as a nanosecond
  monotonic clock reading: a restarted server says a different one);
- ``GET /stats``: ``{"pid", "entries", "weights"}``.

``--device cpu`` serves the same from host memory, to try the HTTP side without a GPU.
SIGTERM ends it with status 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, cast

from gpu_worker import checksum, fill, torch

STARTED = time.monotonic_ns()
# Weights read for one cache entry, as 32-bit integers; the entry holds them as 64-bit
# integers (8 MiB).
ENTRY_INTS = 1 << 20
# The entry's scale is at most this: 2**30 (a float in [0, 1) read as an integer) times
# the scale times ENTRY_INTS stays below 2**63, so the running sum never overflows.
SCALE_MOD = 1021


class Model:
    """The weights and the cache, on ``device``."""

    def __init__(self, gib: float, device: str, seed: int) -> None:
        self.device = device
        self.weights = fill(gib, device, seed)
        self.cache: dict[str, Any] = {}
        self.lock = threading.Lock()  # the cache, and one request's work on it at a time
        self.sync()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def derive(self, prompt: str) -> Any:
        """The prompt's cache entry: a running sum, on the device, of a stretch of the
        weights that the prompt picks, scaled by its bytes. Exact: integers only."""
        data = prompt.encode()
        digest = hashlib.sha256(data).digest()
        ints = self.weights[int.from_bytes(digest[:4], "little") % len(self.weights)]
        ints = ints.view(torch.int32)
        n = min(ENTRY_INTS, ints.numel())
        start = int.from_bytes(digest[4:12], "little") % (ints.numel() - n + 1)
        tokens = torch.tensor(list(data) or [0], dtype=torch.int64, device=self.device)
        scale = tokens.sum() % SCALE_MOD + 1
        return torch.cumsum(ints[start : start + n].to(torch.int64) * scale, 0)

    def complete(self, prompt: str) -> dict[str, Any]:
        with self.lock:
            entry = self.cache.get(prompt)
            cached = entry is not None
            if entry is None:
                entry = self.cache[prompt] = self.derive(prompt)
            consistent = bool(torch.equal(entry, self.derive(prompt)))
            value = checksum([entry])
            weights = checksum(self.weights)
        return {
            "pid": os.getpid(),
            "cached": cached,
            "value": value,
            "weights": weights,
            "consistent": consistent,
            "started": STARTED,
        }

    def stats(self) -> dict[str, Any]:
        with self.lock:
            entries = len(self.cache)
            weights = checksum(self.weights)
        return {"pid": os.getpid(), "entries": entries, "weights": weights}


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], model: Model) -> None:
        super().__init__(address, Handler)
        self.model = model


class Handler(BaseHTTPRequestHandler):
    server_version = "gpu_server"

    @property
    def model(self) -> Model:
        return cast(Server, self.server).model

    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/stats":
            self.reply(200, self.model.stats())
        else:
            self.reply(404, {"error": f"no {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/complete":
            self.reply(404, {"error": f"no {self.path}"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
        except (ValueError, UnicodeDecodeError) as err:
            self.reply(400, {"error": f"bad request: {err}"})
            return
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            self.reply(400, {"error": 'expected {"prompt": "..."}'})
            return
        self.reply(200, self.model.complete(prompt))

    def reply(self, status: int, data: dict[str, Any]) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: nobody reads a wrapped server's stderr while it runs (a full pipe would
        block it)."""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    model = Model(args.gib, args.device, args.seed)
    with Server(("127.0.0.1", args.port), model) as server:

        def stop(signum: int, frame: FrameType | None) -> None:
            # shutdown() waits for serve_forever(), which runs in this thread.
            threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        print("ready", os.getpid(), flush=True)
        server.serve_forever(poll_interval=0.1)  # how soon it notices a SIGTERM
    return 0


if __name__ == "__main__":
    sys.exit(main())
