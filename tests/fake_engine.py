"""A fake of one inference engine's HTTP API, run as the command ``vramlock run`` wraps.

    python fake_engine.py ENGINE [the engine's own options: --host, --port, ...]

ENGINE is llama-server, vllm, sglang, comfyui, ollama, or generic (``POST /off`` and
``POST /on``). Each fake holds pretend GPU memory and frees it the way the real engine
does: at once, later (vLLM's sleep as a worst case, ComfyUI's worker, Ollama's
scheduler), or by exiting (llama-server). It appends to ``$FAKE_LOG`` one line per
event, ``<CLOCK_MONOTONIC> <event>``:

    start PID | req METHOD PATH | gpu 1 | gpu 0 | chunk N | aborted | exit

``gpu 0`` is written *before* the freed state can be seen through the API, so a
token handed over after the API said "free" comes after it in the log.

Every engine streams ``GET /stream?n=N&gap=S``: N chunked server-sent events S seconds
apart, each logged (``chunk I``) before it is written; a client that went away ends
the stream (``aborted``), as engines stop generating for one.

Scripted by the environment:
  FAKE_FAULTS      JSON {"PATH-PREFIX": {"status": N, "delay": S, "die": true,
                   "body": "TEXT", "trickle": S, "times": N}}: a request whose path
                   starts with PATH-PREFIX is delayed, answered N with TEXT (a byte
                   every S seconds with ``trickle``), or kills the server; ``times``
                   limits how many requests the fault hits
  FAKE_FREE_DELAY  how long an asynchronous free takes (seconds; default 0.3)
  FAKE_LOADING     every request answers 503 (as a loading server does: GET /health
                   too, 200 otherwise) this long after start, and for generic after
                   POST /on (default 0.2 for llama-server, else 0)
  FAKE_EXIT_DELAY  llama-server: how long it takes to exit after SIGTERM (default 0.2)
  FAKE_BUSY        comfyui: a prompt runs this long after start (default 0)
  FAKE_KEEP        comfyui: bytes a custom node keeps reserved after /free (default 0)
  FAKE_MODELS      ollama: NAME:SIZE_VRAM,... loaded at start (default m1:1000)
  FAKE_COOPERATIVE generic: "1" to release and restore through vramlock's control
                   channel (--release signal) as well; a restore loads again
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

GiB = 1 << 30
Reply = tuple[int, Any]

_log_lock = threading.Lock()


def log(event: str) -> None:
    path = os.environ.get("FAKE_LOG")
    if path:
        with _log_lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, f"{time.monotonic():.6f} {event}\n".encode())
            os.close(fd)


def option(argv: list[str], name: str, default: str | None = None) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def later(delay: float, action: Callable[[], None]) -> None:
    timer = threading.Timer(delay, action)
    timer.daemon = True
    timer.start()


FREE_DELAY = float(os.environ.get("FAKE_FREE_DELAY", "0.3"))


class Engine:
    """The pretend GPU memory and the routes; subclasses are the engines."""

    LOADING = "0"
    unaffected: frozenset[str] = frozenset()  # paths that answer while it loads

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.loading_for = float(os.environ.get("FAKE_LOADING", self.LOADING))
        self.ready_at = time.monotonic() + self.loading_for
        self.gpu = False
        self.lock = threading.Lock()
        self.routes: dict[tuple[str, str], Callable[[dict[str, list[str]], Any], Reply]] = {}

    def hold(self, on: bool) -> None:
        with self.lock:
            if self.gpu != on:
                log(f"gpu {int(on)}")  # before the state can be seen
                self.gpu = on

    def start(self) -> None:
        self.hold(True)

    def authorised(self, path: str, header: str | None) -> bool:
        return True

    def stop(self) -> None:
        self.hold(False)


class LlamaServer(Engine):
    LOADING = "0.2"

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.slot_dir = option(argv, "--slot-save-path")
        self.slots: dict[int, str] = {i: "" for i in range(int(option(argv, "-np", "1") or 1))}
        self.keys = (option(argv, "--api-key") or "").split(",")
        self.routes = {
            ("GET", "/props"): lambda q, b: (200, {"is_sleeping": False,
                                                   "total_slots": len(self.slots)}),
            ("GET", "/slots"): lambda q, b: (200, [{"id": i, "is_processing": False}
                                                   for i in self.slots]),
            ("POST", "/completion"): self.completion,
        }  # fmt: skip
        for i in self.slots:
            self.routes[("POST", f"/slots/{i}")] = functools.partial(self.slot, i)

    def start(self) -> None:
        later(max(0.0, self.ready_at - time.monotonic()), lambda: self.hold(True))

    def authorised(self, path: str, header: str | None) -> bool:
        keys = [f"Bearer {k}" for k in self.keys]
        return self.keys == [""] or path == "/health" or header in keys

    def completion(self, query: dict[str, list[str]], body: Any) -> Reply:
        words = str(body["prompt"]).split()
        cached = self.slots[0].split()
        n = 0
        while n < min(len(words), len(cached)) and words[n] == cached[n]:
            n += 1
        self.slots[0] = " ".join(words)
        return 200, {"timings": {"cache_n": n, "prompt_n": len(words) - n}}

    def slot(self, i: int, query: dict[str, list[str]], body: Any) -> Reply:
        if self.slot_dir is None:
            return 501, {"error": {"code": 501, "message": "slot save path not set"}}
        path = os.path.join(self.slot_dir, body["filename"])
        action = query.get("action", [""])[0]
        if action == "save":
            with open(path, "w") as f:
                f.write(self.slots[i])
            return 200, {"id_slot": i, "n_saved": len(self.slots[i].split())}
        if action == "restore":
            if not os.path.exists(path):
                return 400, {"error": {"code": 400, "message": "Unable to restore slot"}}
            with open(path) as f:
                self.slots[i] = f.read()
            return 200, {"id_slot": i, "n_restored": len(self.slots[i].split())}
        return 400, {"error": {"code": 400, "message": "bad action"}}

    def stop(self) -> None:
        time.sleep(float(os.environ.get("FAKE_EXIT_DELAY", "0.2")))
        super().stop()


class Vllm(Engine):
    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.sleeping = False
        if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":  # as vLLM: no endpoints without it
            self.routes = {
                ("POST", "/sleep"): self.sleep,
                ("GET", "/is_sleeping"): lambda q, b: (200, {"is_sleeping": self.sleeping}),
                ("POST", "/wake_up"): self.wake_up,
            }

    def sleep(self, query: dict[str, list[str]], body: Any) -> Reply:
        def done() -> None:
            self.hold(False)
            self.sleeping = True

        later(FREE_DELAY, done)  # answered at once, asleep later: the worst case
        return 200, None

    def wake_up(self, query: dict[str, list[str]], body: Any) -> Reply:
        self.hold(True)
        self.sleeping = False
        return 200, None


class Sglang(Engine):
    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.routes = {
            ("POST", "/release_memory_occupation"): self.release,
            ("POST", "/resume_memory_occupation"): self.resume,
        }

    def release(self, query: dict[str, list[str]], body: Any) -> Reply:
        time.sleep(FREE_DELAY)  # answers once it is done
        self.hold(False)
        return 200, None

    def resume(self, query: dict[str, list[str]], body: Any) -> Reply:
        self.hold(True)
        return 200, None


class ComfyUI(Engine):
    """Its PyTorch holds ``reserved`` bytes, ``active`` of them in use; ``/free`` sets a
    flag that the worker acts on once no prompt runs: it unloads the models (active
    drops, the freed memory stays cached: vram_free grows, the device's free memory
    does not), and after a pause (gc) empties the cache (reserved drops)."""

    TOTAL, OTHER = 24 * GiB, 2 * GiB  # OTHER: a process that is not ComfyUI

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.reserved, self.active = 10 * GiB, 9 * GiB
        self.busy_until = 0.0  # the prompt runs from start(), once "start" is logged
        self.keep = int(os.environ.get("FAKE_KEEP", "0"))
        self.routes = {
            ("GET", "/queue"): self.queue,
            ("POST", "/free"): self.free,
            ("GET", "/system_stats"): self.stats,
        }

    def start(self) -> None:
        # After the "start" line: a test counts the prompt's time from it.
        self.busy_until = time.monotonic() + float(os.environ.get("FAKE_BUSY", "0"))
        super().start()

    def queue(self, query: dict[str, list[str]], body: Any) -> Reply:
        running = [[1, "prompt-1"]] if time.monotonic() < self.busy_until else []
        return 200, {"queue_running": running, "queue_pending": []}

    def stats(self, query: dict[str, list[str]], body: Any) -> Reply:
        with self.lock:
            cached = self.reserved - self.active
            device_free = self.TOTAL - self.OTHER - self.reserved
            device = {
                "name": "cuda:0 fake",
                "type": "cuda",
                "index": 0,
                "vram_total": self.TOTAL,
                "vram_free": device_free + cached,
                "torch_vram_total": self.reserved,
                "torch_vram_free": cached,
            }
        return 200, {"system": {"os": "posix"}, "devices": [device]}

    def free(self, query: dict[str, list[str]], body: Any) -> Reply:
        def worker() -> None:
            time.sleep(max(0.0, self.busy_until - time.monotonic()))
            while self.active > self.keep:  # unloading, model by model
                with self.lock:
                    self.active = max(self.keep, self.active - 3 * GiB)
                time.sleep(0.05)
            time.sleep(FREE_DELAY)  # gc, then the cache is emptied
            with self.lock:
                log("gpu 0")
                self.gpu = False
                self.reserved = self.keep

        threading.Thread(target=worker, daemon=True).start()
        return 200, None


class Ollama(Engine):
    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        spec = os.environ.get("FAKE_MODELS", "m1:1000")
        self.models = {name: int(size) for name, size in (m.split(":") for m in spec.split(","))}
        self.routes = {
            ("GET", "/api/ps"): self.ps,
            ("POST", "/api/generate"): self.generate,
        }

    def start(self) -> None:
        self.hold(any(self.models.values()))

    def ps(self, query: dict[str, list[str]], body: Any) -> Reply:
        with self.lock:
            models = [{"name": m, "model": m, "size": 2 * v + 1, "size_vram": v}
                      for m, v in self.models.items()]  # fmt: skip
        return 200, {"models": models}

    def generate(self, query: dict[str, list[str]], body: Any) -> Reply:
        model = body["model"]
        if body.get("keep_alive") != 0 or model not in self.models:
            return 400, {"error": f"model {model!r} not found"}

        def unload() -> None:
            with self.lock:
                if not any(v for m, v in self.models.items() if m != model):
                    log("gpu 0")
                    self.gpu = False
                del self.models[model]

        later(FREE_DELAY, unload)
        return 200, {"model": model, "response": "", "done": True, "done_reason": "unload"}


class Generic(Engine):
    unaffected = frozenset({"/off", "/on"})

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.routes = {("POST", "/off"): self.off, ("POST", "/on"): self.on}

    def off(self, query: dict[str, list[str]], body: Any) -> Reply:
        self.hold(False)
        return 200, None

    def on(self, query: dict[str, list[str]] | None = None, body: Any = None) -> Reply:
        self.hold(True)
        self.ready_at = time.monotonic() + self.loading_for  # loads its model again
        return 204, None

    def start(self) -> None:
        super().start()
        if os.environ.get("FAKE_COOPERATIVE") == "1":
            from vramlock import child

            ctl = child.connect()
            assert ctl is not None, "not run by vramlock"
            ctl.serve(release=lambda: self.hold(False), restore=self.on)


ENGINES: dict[str, type[Engine]] = {
    "llama-server": LlamaServer,
    "vllm": Vllm,
    "sglang": Sglang,
    "comfyui": ComfyUI,
    "ollama": Ollama,
    "generic": Generic,
}
DEFAULT_PORTS = {"llama-server": 8080, "vllm": 8000, "sglang": 30000, "comfyui": 8188,
                 "ollama": 11434, "generic": 8099}  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    """The engine's HTTP side; ``engine`` and ``faults`` are set per server by
    ``handler``."""

    engine: Engine
    faults: dict[str, dict[str, Any]]
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.handle_one("GET")

    def do_POST(self) -> None:
        self.handle_one("POST")

    def handle_one(self, method: str) -> None:
        url = urlsplit(self.path)
        log(f"req {method} {self.path}")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.faulted():
            return None
        if time.monotonic() < self.engine.ready_at and url.path not in self.engine.unaffected:
            log(f"503 {self.path}")
            return self.answer(503, b'{"error": {"code": 503, "message": "Loading model"}}')
        if (method, url.path) == ("GET", "/stream"):
            return self.stream(parse_qs(url.query))
        if (method, url.path) == ("GET", "/health"):
            return self.answer(200, b'{"status": "ok"}')
        route = self.engine.routes.get((method, url.path))
        if route is None:
            return self.answer(404, b'{"detail": "Not Found"}')
        if not self.engine.authorised(url.path, self.headers.get("Authorization")):
            return self.answer(401, b'{"error": {"message": "Invalid API Key"}}')
        status, data = route(parse_qs(url.query), json.loads(raw) if raw else None)
        self.answer(status, b"" if data is None else json.dumps(data).encode())

    def faulted(self) -> bool:
        """A fault of ``FAKE_FAULTS`` for this path, taken: answered (or died)."""
        fault = next((f for p, f in self.faults.items() if self.path.startswith(p)), None)
        left = None if fault is None else fault.get("times")
        if fault is None or (left is not None and left <= 0):
            return False
        if left is not None:
            fault["times"] = left - 1
        time.sleep(fault.get("delay", 0.0))
        if fault.get("die"):
            log("died")
            os._exit(3)
        if "status" not in fault:
            return False
        body = fault.get("body", "fault").encode()
        self.answer(fault["status"], body, fault.get("trickle", 0.0))
        return True

    def stream(self, query: dict[str, list[str]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(int(query.get("n", ["1"])[0])):
            if i:
                time.sleep(float(query.get("gap", ["0"])[0]))
            conn = self.connection
            if select.select([conn], [], [], 0)[0] and not conn.recv(1, socket.MSG_PEEK):
                log("aborted")
                self.close_connection = True
                return
            log(f"chunk {i}")
            data = f"data: {i}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def answer(self, status: int, body: bytes, trickle: float = 0.0) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not trickle:
            self.wfile.write(body)
            return
        for i in range(len(body)):
            self.wfile.write(body[i : i + 1])
            self.wfile.flush()
            time.sleep(trickle)


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    faults: dict[str, dict[str, Any]] = json.loads(os.environ.get("FAKE_FAULTS", "{}"))
    return type("Handler", (Handler,), {"engine": engine, "faults": faults})


def main(name: str, argv: list[str]) -> None:
    engine = ENGINES[name](argv)
    if name == "ollama":
        host, _, port = os.environ.get("OLLAMA_HOST", "127.0.0.1:11434").rpartition(":")
    else:
        host = option(argv, "--listen" if name == "comfyui" else "--host") or "127.0.0.1"
        port = option(argv, "--port") or str(DEFAULT_PORTS[name])
    # SIGTERM is taken by sigwait below, in this thread; the threads inherit the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    server = ThreadingHTTPServer((host, int(port)), handler(engine))
    server.daemon_threads = True
    log(f"start {os.getpid()}")
    engine.start()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    signal.sigwait({signal.SIGTERM})
    engine.stop()
    log("exit")
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
