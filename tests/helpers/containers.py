"""A fake container runtime: a container's process is no descendant of whoever asks for
it (as docker's are), so only its stop command, never a signal to its client, ends it."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.net import free_ports
from helpers.processes import Spawn

# A container runtime, as docker's daemon is one: ``DIR``. Started by the test, outside
# serve, so that a container's process is no descendant of serve or of any wrapper. It
# starts a container for each DIR/start-NAME file (its text: the port), ends the one of
# each DIR/stop-NAME file (SIGTERM), and writes DIR/NAME.pid while a container runs.
# A container writes "MONOTONIC NAME PID" to DIR/witness every 5 ms while it runs (on
# the GPU, as it were) and answers every POST with its name and pid.
RUNTIME = """
import os, signal, subprocess, sys, time
where = sys.argv[1]
running = {}
while True:
    for entry in sorted(os.listdir(where)):
        kind, _, name = entry.partition("-")
        path = os.path.join(where, entry)
        if kind == "start" and name not in running:
            port = open(path).read()
            running[name] = subprocess.Popen([sys.executable, sys.argv[2], port, name, where],
                                             start_new_session=True)
            open(os.path.join(where, name + ".pid"), "w").write(str(running[name].pid))
            os.unlink(path)
        elif kind == "stop":
            proc = running.pop(name, None)
            if proc is not None:
                proc.terminate()
                proc.wait()
                os.unlink(os.path.join(where, name + ".pid"))
            os.unlink(path)
    time.sleep(0.005)
"""
CONTAINER = """
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, name, where = int(sys.argv[1]), sys.argv[2], sys.argv[3]
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
witness = os.open(os.path.join(where, "witness"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
def on_the_gpu():
    while True:
        os.write(witness, f"{time.monotonic():.6f} {name} {os.getpid()}\\n".encode())
        time.sleep(0.005)
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"model": name, "pid": os.getpid()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
server = ThreadingHTTPServer(("127.0.0.1", port), H)
threading.Thread(target=on_the_gpu, daemon=True).start()
server.serve_forever()
"""
# ``docker run``: ``DIR NAME PORT``: asks the runtime for the container, then runs until
# it ends (SIGTERM to it does not reach the container). It writes its pid to DIR/NAME.cmd.
RUN = """
import os, sys, time
where, name, port = sys.argv[1:4]
open(os.path.join(where, name + ".cmd"), "w").write(str(os.getpid()))
pidfile = os.path.join(where, name + ".pid")
with open(os.path.join(where, ".start-" + name), "w") as f:  # whole, then seen
    f.write(port)
os.rename(os.path.join(where, ".start-" + name), os.path.join(where, "start-" + name))
while not os.path.exists(pidfile):
    time.sleep(0.005)
while os.path.exists(pidfile):
    time.sleep(0.005)
"""
# ``docker stop``: ``DIR NAME PID [STATUS]``: asks the runtime to end the container, and
# returns once it has (PID, the model's cmd's, is written to DIR/NAME.stopped-for).
# With STATUS, fails at once with it instead.
STOP = """
import os, sys, time
where, name, pid = sys.argv[1:4]
open(os.path.join(where, name + ".stopped-for"), "w").write(pid)
if len(sys.argv) > 4:
    sys.exit(int(sys.argv[4]))
open(os.path.join(where, "stop-" + name), "w").close()
while os.path.exists(os.path.join(where, name + ".pid")):
    time.sleep(0.005)
"""


class Containers:
    """A fake container runtime in ``where``, and the models that run in it."""

    def __init__(self, spawn: Spawn, where: Path) -> None:
        where.mkdir()
        self.where = where
        for name, text in (("runtime", RUNTIME), ("container", CONTAINER), ("run", RUN),
                           ("stop", STOP)):  # fmt: skip
            (where / f"{name}.py").write_text(text)
        self.runtime = spawn([sys.executable, str(where / "runtime.py"), str(where),
                              str(where / "container.py")])  # fmt: skip

    def models(self, names: list[str], stop: str = "", **per_model: str) -> str:
        """``models:`` for containers ``names``: cmd runs one, cmdStop stops it
        (``stop``: more arguments for STOP)."""
        lines = ["models:"]
        py, w = sys.executable, self.where
        for name, port in zip(names, free_ports(len(names)), strict=True):
            lines += [
                f"  {name}:",
                f"    cmd: {py} {w}/run.py {w} ${{MODEL_ID}} {port}",
                f"    proxy: http://127.0.0.1:{port}",
                f"    cmdStop: {py} {w}/stop.py {w} ${{MODEL_ID}} ${{PID}} {stop}",
                "    checkEndpoint: none",
                *(f"    {line}" for line in per_model.get(name, "").splitlines()),
            ]
        return "\n".join(lines) + "\n"

    def on_gpu(self) -> list[tuple[str, int, float, float]]:
        """Each container's time on the GPU by the witness: (name, pid, first, last),
        in the order they started."""
        spans: dict[int, tuple[str, int, float, float]] = {}
        witness = self.where / "witness"
        for line in (witness.read_text() if witness.exists() else "").splitlines():
            at, name, pid = line.split()
            first = spans.get(int(pid), (name, int(pid), float(at), 0.0))[2]
            spans[int(pid)] = (name, int(pid), first, float(at))
        return sorted(spans.values(), key=lambda s: s[2])

    def read(self, name: str) -> str:
        return (self.where / name).read_text()

    def run_args(self, name: str, port: int) -> list[str]:
        """``vramlock run``'s options and command for container ``name`` on ``port``."""
        py, w = sys.executable, self.where
        stop = f"{py} {w}/stop.py {w} {name} $VRAMLOCK_CHILD_PID"
        return ["--release", "restart", "--on-release", stop, "--", py, f"{w}/run.py", str(w),
                name, str(port)]  # fmt: skip

    def running(self, name: str) -> bool:
        return (self.where / f"{name}.pid").exists()
