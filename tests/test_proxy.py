"""``--demand listen``: the TCP proxy in front of a server, end to end with real processes.

The wrapped command is a small HTTP server (the standard library's) under ``--release
restart``, so that "released" means the server process is gone. It logs every start.
The witness is a separate process that joins the arena with plain flock calls, checks
whether anything answers on the server's port while it holds the token, and stamps
when it held it: whatever vramlock believes about itself.
"""

from __future__ import annotations

import functools
import http.client
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from helpers.commands import vramlock, who_json
from helpers.net import free_ports
from helpers.processes import Spawn, kill_group, token_free, wait_until
from helpers.stamps import witness_script

from vramlock import procfs
from vramlock.net.address import same_socket

pytestmark = pytest.mark.timeout(90)

SERVER = textwrap.dedent(
    """
    import os, socket, struct, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlsplit

    port, log = int(sys.argv[1]), sys.argv[2]

    def note(what):
        with open(log, "a") as f:
            f.write(f"{time.monotonic():.6f} {os.getpid()} {what}\\n")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def chunk(self, data):
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
            self.wfile.flush()

        def do_GET(self):
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path == "/big":  # one body of `size` bytes
                size = int(query["size"])
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                self.wfile.write(b"x" * size)
                return
            if url.path == "/hello":
                body = f"hello {os.getpid()}\\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            # /stream: SSE-like, n events `gap` seconds apart; /reset: one, then a reset.
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(int(query.get("n", "1"))):
                self.chunk(f"data: {i} {os.getpid()}\\n\\n".encode())
                if url.path == "/reset":
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.connection.close()
                    self.close_connection = True
                    return
                time.sleep(float(query.get("gap", "0")))
            self.chunk(b"")

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            answer = f"got {len(body)}\\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            pass  # a client that went away, a connection /reset closed

    time.sleep(float(os.environ.get("SERVER_DELAY", "0")))
    server = Server(("127.0.0.1", port), Handler)
    note("running")
    server.serve_forever()
    """
)

WITNESS = witness_script(
    """
    import fcntl, os, socket, sys, time
    arena, out, hold, port = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    """,
    """
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        server = "up"
    except ConnectionRefusedError:
        server = "gone"
    open(out + ".held", "w").close()
    time.sleep(hold)
    t1 = time.monotonic()
    with open(out, "w") as f:
        f.write(f"{t0} {t1} {server}")
    """,
)


@dataclass
class Witness:
    """Holds the token for ``hold`` seconds; says whether the server answered meanwhile."""

    proc: subprocess.Popen[str]
    out: Path

    @classmethod
    def start(cls, tmp: Path, arena: Path, hold: float, port: int, name: str = "w") -> Witness:
        script = tmp / "witness.py"
        script.write_text(WITNESS)
        out = tmp / name
        args = [sys.executable, str(script), str(arena), str(out), str(hold), str(port)]
        return cls(subprocess.Popen(args, start_new_session=True, text=True), out)

    def wait_held(self) -> None:
        wait_until(lambda: Path(f"{self.out}.held").exists(), timeout=30)

    def result(self) -> tuple[float, float, str]:
        self.proc.wait(60)
        t0, t1, server = self.out.read_text().split()
        return float(t0), float(t1), server


def answer(conn: http.client.HTTPConnection) -> str:
    """The body of the answer to the request sent on ``conn`` (200), which is then closed."""
    try:
        response = conn.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        conn.close()


@dataclass
class Served:
    job: subprocess.Popen[str]
    port: int  # the proxy's
    upstream: int
    log: Path

    def starts(self) -> list[tuple[float, int]]:
        """(time, pid) of every start of the server."""
        if not self.log.exists():
            return []
        lines = [ln.split() for ln in self.log.read_text().splitlines()]
        return [(float(t), int(pid)) for t, pid, what in lines if what == "running"]

    def get(self, path: str = "/hello", timeout: float = 30) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            return answer(conn)
        finally:
            conn.close()  # where the request failed (answer closes it otherwise)


def serve(
    spawn: Spawn,
    arena: Path,
    tmp: Path,
    *options: str,
    env: dict[str, str] | None = None,
    ready: bool = True,
) -> Served:
    """``vramlock run --demand listen --release restart`` around SERVER; once the server
    runs (unless ``ready`` is False) and ``who`` shows the proxy."""
    script = tmp / "server.py"
    script.write_text(SERVER)
    (port, upstream), log = free_ports(), tmp / "server.log"
    job = spawn(
        vramlock("run", "--arena", str(arena), "--release", "restart", "--min-hold", "0",
                 "--demand", "listen", "--listen", str(port), "--upstream", str(upstream),
                 *options, "--", sys.executable, str(script), str(upstream), str(log)),
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    served = Served(job, port, upstream, log)
    if ready:
        wait_until(lambda: len(served.starts()) == 1 or job.poll() is not None, timeout=30)
        assert job.poll() is None, job.communicate()
    wait_until(lambda: [m.get("listen") for m in who_json(arena)] == [f"127.0.0.1:{port}"])
    return served


def in_thread(work: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``work`` in a thread; the returned call joins it (with a deadline) and gives its
    result, or raises what it raised."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(("ok", work()))
        except BaseException as err:  # handed to the joining test
            result.append(("error", err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(60)
        assert result, "the client thread did not finish"
        kind, value = result[0]
        if kind == "error":
            raise value
        return value

    return join


def cpu_seconds(pid: int) -> float:
    fields = procfs.proc_stat(pid)
    assert fields is not None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_request_to_a_released_server_waits_and_is_answered(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path)
    first = served.starts()[0][1]
    kept = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    kept.request("GET", "/hello")  # a keep-alive connection, open across the release
    assert kept.getresponse().read() == f"hello {first}\n".encode()

    witness = Witness.start(tmp_path, arena, hold=0.6, port=served.upstream)
    witness.wait_held()
    answer = served.get()  # through the proxy, while the server is gone
    _, t1, server = witness.result()
    assert server == "gone"  # released means released
    second = served.starts()[1]
    assert answer == f"hello {second[1]}\n" and second[1] != first
    assert second[0] > t1  # started again only after the witness let go
    # The kept connection's server was ended: it is over, and nothing else is hurt.
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        kept.request("GET", "/hello")
        kept.getresponse()
    kept.close()
    assert served.job.poll() is None

    # Released again, and nobody asks: it stays away (the proxy, not a timer, brings it back).
    witness = Witness.start(tmp_path, arena, hold=0.0, port=served.upstream, name="w2")
    assert witness.result()[2] == "gone"
    wait_until(lambda: who_json(arena)[0]["state"] == "released")
    time.sleep(0.5)  # a negative: give a wrong restart the time to show
    assert len(served.starts()) == 2 and token_free(arena)
    assert served.get().startswith("hello ")
    assert len(served.starts()) == 3


def test_many_concurrent_clients_are_all_answered(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path)
    witness = Witness.start(tmp_path, arena, hold=1.0, port=served.upstream)
    witness.wait_held()
    clients = [in_thread(served.get) for _ in range(20)]
    answers = [join() for join in clients]
    _, t1, server = witness.result()
    assert server == "gone"
    pid = served.starts()[-1][1]
    assert answers == [f"hello {pid}\n"] * 20  # all held, then all served by the new server
    assert served.starts()[-1][0] > t1
    # Resident: twenty more at once.
    clients = [in_thread(served.get) for _ in range(20)]
    assert [join() for join in clients] == [f"hello {pid}\n"] * 20


def slow_post(port: int, size: int, pause: float) -> str:
    """A POST whose body trickles in a byte at a time."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
        for _ in range(size):
            s.sendall(b"x")
            time.sleep(pause)
        answer = b""
        while not answer.endswith(b"\n") or b"\r\n\r\n" not in answer:
            data = s.recv(4096)
            assert data, answer
            answer += data
        return answer.decode().split("\r\n\r\n", 1)[1]


def read_some_then_vanish(port: int, events: int) -> None:
    """Start a stream, read a few events, then drop the connection (with a reset)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /stream?n=200&gap=0.01 HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while got.count(b"data:") < events:
        data = s.recv(4096)
        assert data
        got += data
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_slow_and_vanishing_clients_do_not_break_others(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path)
    slow = in_thread(lambda: slow_post(served.port, 30, 0.02))
    vanishing = [in_thread(lambda: read_some_then_vanish(served.port, 3)) for _ in range(5)]
    for _ in range(5):  # connect and hang up without a word
        socket.create_connection(("127.0.0.1", served.port), timeout=30).close()
    for _ in range(20):  # meanwhile, ordinary requests go through
        assert served.get().startswith("hello ")
    for join in vanishing:
        join()
    assert slow() == "got 30\n"
    wait_until(lambda: who_json(arena)[0]["connections"] == 0)
    assert served.get().startswith("hello ") and served.job.poll() is None
    assert len(served.starts()) == 1

    # A client that gives up while it is held is no reason to wake the server, nor a problem.
    witness = Witness.start(tmp_path, arena, hold=0.3, port=served.upstream)
    witness.wait_held()
    for _ in range(3):
        socket.create_connection(("127.0.0.1", served.port), timeout=30).close()
    assert witness.result()[2] == "gone"
    assert served.get().startswith("hello ") and served.job.poll() is None


def read_stream(port: int, path: str) -> tuple[int, str]:
    """How many events a streamed response brought, and how it ended: "complete" (its
    last chunk came), "closed", or the error."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        got = b""
        try:
            while not got.endswith(b"\r\n0\r\n\r\n"):
                data = s.recv(65536)
                if not data:
                    return got.count(b"data:"), "closed"
                got += data
        except OSError as err:
            return got.count(b"data:"), type(err).__name__
        return got.count(b"data:"), "complete"


def test_an_upstream_connection_reset_mid_response_closes_the_client(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path)
    started = time.monotonic()
    events, end = read_stream(served.port, "/reset?n=5")
    assert events <= 1 and end != "complete"
    assert time.monotonic() - started < 10  # closed, not left hanging
    assert served.get().startswith("hello ")


def test_an_upstream_that_dies_mid_stream_closes_the_client(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path)
    pid = served.starts()[0][1]
    stream = in_thread(lambda: read_stream(served.port, "/stream?n=1000&gap=0.01"))
    wait_until(lambda: who_json(arena)[0]["connections"] == 1)
    os.kill(pid, signal.SIGKILL)
    events, end = stream()
    assert 0 < events < 1000 and end != "complete"
    _, err = served.job.communicate(timeout=30)
    assert served.job.returncode == 128 + signal.SIGKILL
    assert "Traceback" not in err


def test_held_clients_are_closed_when_the_upstream_never_gets_ready(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(
        spawn, arena, tmp_path, "--ready-within", "1", env={"SERVER_DELAY": "600"}, ready=False
    )
    # The deadline counts from the start of the command: this one waits for the rest of it.
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
        served.get()
    # The next client waits again, the whole deadline.
    started = time.monotonic()
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
        served.get()
    assert 1.0 <= time.monotonic() - started < 10
    assert served.job.poll() is None
    served.job.send_signal(signal.SIGTERM)
    _, err = served.job.communicate(timeout=30)
    warning = (
        f"vramlock: the upstream 127.0.0.1:{served.upstream} did not accept a connection"
        " within 1 s; closing 1 waiting connection(s)"
    )
    assert err.splitlines().count(warning) == 2, err


def stream_and_witness(
    served: Served, arena: Path, tmp: Path, events: int, gap: float = 0.1
) -> tuple[int, str, float, float]:
    """A stream of ``events`` events ``gap`` s apart; a witness queues after the first one.
    The events, how the stream ended, when it ended, when the witness got the token."""
    stream = in_thread(lambda: read_stream(served.port, f"/stream?n={events}&gap={gap}"))
    wait_until(lambda: who_json(arena)[0]["connections"] == 1)
    witness = Witness.start(tmp, arena, hold=0.0, port=served.upstream)
    got, end = stream()
    ended = time.monotonic()
    t0, _, server = witness.result()
    assert server == "gone"
    return got, end, ended, t0


def test_traffic_in_flight_puts_the_release_off(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    # Events 0.1 s apart, --idle 1 s: a busy machine must not make a gap look idle.
    served = serve(spawn, arena, tmp_path, "--idle", "1s")
    got, end, ended, t0 = stream_and_witness(served, arena, tmp_path, events=10)
    assert (got, end) == (10, "complete")  # not cut by the waiter
    assert t0 > ended  # the witness had to wait for the stream, then --idle


def test_a_stream_with_gaps_longer_than_idle_keeps_the_server(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    # Events 1 s apart, --idle 0.3 s (the default): a gap is no end of the response.
    served = serve(spawn, arena, tmp_path)
    got, end, ended, t0 = stream_and_witness(served, arena, tmp_path, events=3, gap=1.0)
    assert (got, end) == (3, "complete")
    assert t0 > ended
    assert len(served.starts()) == 1


def test_a_slow_reader_gets_the_whole_download(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    served = serve(spawn, arena, tmp_path)
    size = 64 << 20
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(f"GET /big?size={size} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        received = len(got.split(b"\r\n\r\n", 1)[1])
        witness = Witness.start(tmp_path, arena, hold=0.0, port=served.upstream)
        time.sleep(1.0)  # the reader stalls (the proxy has had no traffic for a while)
        while received < size:
            data = s.recv(1 << 20)
            assert data, f"cut after {received} of {size} bytes"
            received += len(data)
        done = time.monotonic()
    t0, _, server = witness.result()
    assert server == "gone" and t0 > done
    assert len(served.starts()) == 1


def test_an_idle_keep_alive_connection_does_not_put_the_release_off(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path, "--idle", "0.2")
    kept = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    for path in ("/hello", "/stream?n=3", "/hello"):  # keep-alive: open after its answers
        kept.request("GET", path)
        assert kept.getresponse().read()
    time.sleep(0.3)  # past --idle
    asked = time.monotonic()
    t0, _, server = Witness.start(tmp_path, arena, hold=0.0, port=served.upstream).result()
    assert server == "gone" and t0 - asked < 1.5
    kept.close()


def test_yield_within_cuts_traffic_in_flight(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    served = serve(spawn, arena, tmp_path, "--yield-within", "0.5")
    got, end, ended, t0 = stream_and_witness(served, arena, tmp_path, events=100)
    assert got < 100 and end != "complete"
    assert t0 < ended + 5
    assert served.job.poll() is None
    kill_group(served.job)
    assert served.job.stderr is not None
    assert (
        "still busy 0.5 s after somebody began to wait; releasing anyway"
        in served.job.stderr.read()
    )


def test_who_shows_the_address_and_open_connections(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path)
    assert who_json(arena)[0]["connections"] == 0
    conns = [http.client.HTTPConnection("127.0.0.1", served.port, timeout=30) for _ in range(2)]
    for conn in conns:  # keep-alive: each stays open after its answer
        conn.request("GET", "/hello")
        conn.getresponse().read()
    wait_until(lambda: who_json(arena)[0]["connections"] == 2)
    row = who_json(arena)[0]
    assert row["note"] == f"listen 127.0.0.1:{served.port}, 2 connection(s)"
    plain = subprocess.run(
        vramlock("who", "--arena", str(arena)), capture_output=True, text=True, timeout=30
    ).stdout
    assert f"listen 127.0.0.1:{served.port}, 2 connection(s)" in plain
    for conn in conns:
        conn.close()
    wait_until(lambda: who_json(arena)[0]["connections"] == 0)

    # Idle, resident, with a proxy: the wrapper sleeps.
    before = cpu_seconds(served.job.pid)
    time.sleep(1.0)
    assert cpu_seconds(served.job.pid) - before < 0.05


def test_a_listen_address_in_use_is_one_line_and_125(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            vramlock("run", "--arena", str(arena), "--demand", "listen", "--listen", str(port),
                     "--upstream", str(free_ports(1)[0]), "--", "touch", str(marker)),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert out.returncode == 125
    assert out.stderr == f"vramlock: --listen {port}: Address already in use\n"
    assert not marker.exists()


@pytest.mark.parametrize(
    ("fd", "reason"),
    [("0", "not a listening TCP socket"), ("99", "Bad file descriptor")],
    ids=["not-listening", "closed"],
)
def test_an_inherited_listen_descriptor_that_is_no_listener_is_125(
    arena: Path, tmp_path: Path, fd: str, reason: str
) -> None:
    marker = tmp_path / "ran"
    with socket.socket() as sock:  # fd 0: a socket, but not listening
        out = subprocess.run(
            vramlock("run", "--arena", str(arena), "--demand", "listen", "--listen", f"fd:{fd}",
                     "--upstream", str(free_ports(1)[0]), "--", "touch", str(marker)),
            stdin=sock.fileno(), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert out.returncode == 125
    assert out.stderr == f"vramlock: --listen fd:{fd}: {reason}\n"
    assert not marker.exists()


def test_an_inherited_listening_socket_takes_the_clients(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    upstream, log = free_ports(1)[0], tmp_path / "server.log"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        spawn(vramlock("run", "--arena", str(arena), "--release", "restart", "--demand", "listen",
                       "--listen", f"fd:{listener.fileno()}", "--upstream", str(upstream), "--",
                       sys.executable, str(script), str(upstream), str(log)),
              pass_fds=(listener.fileno(),))  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/hello")
        assert conn.getresponse().read().startswith(b"hello ")
        conn.close()
    assert [m.get("listen") for m in who_json(arena)] == [f"127.0.0.1:{port}"]


class _Record:
    """A member's record as ``run`` describes it, where the proxy's first report wins
    the race with the rest of ``run``'s setup: ``run``'s change naming the listen address
    lands only once the proxy's thread has reported its count."""

    def __init__(self) -> None:
        self.fields: dict[str, object] = {}
        self.reported = threading.Event()

    def describe(self, **changes: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.reported.set()  # the proxy's thread: its count
        elif "listen" in changes:
            assert self.reported.wait(10), "the proxy never reported its client"
        self.fields.update(changes)

    def working(self, busy: bool) -> None:
        pass


def test_a_client_in_the_backlog_before_the_proxy_runs_stays_counted() -> None:
    """serve connects to a model's address before it starts the model's wrapper (it
    passes the listener): the proxy takes that client as soon as its thread runs, and
    reports 1 once, the count changing only then. ``run`` must not write its initial 0
    over that report: who would show the model's kept-alive connection as none."""
    from vramlock.run.options import RunOptions
    from vramlock.run.runner import Runner

    record = _Record()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname(), timeout=30):  # in the backlog
            opts = RunOptions(command=["true"], demand="listen", upstream=str(free_ports(1)[0]),
                              listen=f"fd:{os.dup(listener.fileno())}")  # fmt: skip
            runner = Runner(opts)
            runner.proxy = runner._listen(cast(Any, record))
            try:
                assert record.fields["connections"] == 1
            finally:
                runner._close()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--demand", "listen", "--listen", "8080"], "--demand listen needs --listen ADDR and"),
        (["--listen", "8080", "--upstream", "8081"], "need --demand listen"),
        (["--idle", "1s"], "need --demand listen"),
        (["--ready-url", "/health"], "need --demand listen"),
        (
            ["--demand", "listen", "--listen", "80", "--upstream", "81", "--ready-url", "health"],
            "--ready-url: a path is wanted (/health), not 'health'",
        ),
        (["--demand", "listen", "--listen", "::1:80", "--upstream", "81"], "bad address '::1:80'"),
        (["--demand", "listen", "--listen", "70000", "--upstream", "81"], "bad address '70000'"),
        (["--demand", "listen", "--listen", "81", "--upstream", "127.0.0.1:81"], "the same"),
        (["--demand", "listen", "--listen", "80", "--upstream", "81", "--idle", "x"], "--idle"),
    ],
)
def test_listen_usage_errors(arena: Path, args: list[str], fragment: str) -> None:
    out = subprocess.run(
        vramlock("run", "--arena", str(arena), *args, "--", "true"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr


def has_ipv6() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("listen", "upstream"),
    [
        ("18115", "localhost:18115"),
        ("18115", "127.0.0.1:18115"),
        ("0.0.0.0:18115", "127.0.0.1:18115"),
        ("127.0.0.1:18115", "0.0.0.0:18115"),  # a server's wildcard is reached on loopback
        ("0.0.0.0:18115", "localhost:18115"),
        ("[::]:18115", "[::1]:18115"),
        ("[::]:18115", "127.0.0.1:18115"),  # IPv6's wildcard takes IPv4 too
        ("[::1]:18115", "[::]:18115"),
        ("[::1]:18115", "[0:0:0:0:0:0:0:1]:18115"),
    ],
)
def test_a_proxy_to_itself_is_refused(arena: Path, listen: str, upstream: str) -> None:
    if "[" in listen + upstream and not has_ipv6():
        pytest.skip("no IPv6 loopback here")
    out = subprocess.run(
        vramlock("run", "--arena", str(arena), "--demand", "listen", "--listen", listen,
                 "--upstream", upstream, "--", "true"),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == (
        f"vramlock: --listen {listen} and --upstream {upstream} are the same socket:"
        " the proxy would forward to itself\n"
    )


@pytest.mark.parametrize(
    ("listen", "upstream"),
    [
        ("18115", "18116"),
        ("127.0.0.2:18115", "127.0.0.1:18115"),  # another loopback address, another socket
        ("127.0.0.1:18115", "192.0.2.1:18115"),  # not an address of this host
    ],
)
def test_other_sockets_are_not_the_proxy(listen: str, upstream: str) -> None:
    assert not same_socket(listen, upstream)


def test_ipv6_loopback(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    """``[::1]:PORT`` listens on IPv6; the upstream may be IPv4."""
    if not has_ipv6():
        pytest.skip("no IPv6 loopback here")
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    (port, upstream), log = free_ports(), tmp_path / "server.log"
    spawn(
        vramlock("run", "--arena", str(arena), "--demand", "listen", "--listen", f"[::1]:{port}",
                 "--upstream", f"127.0.0.1:{upstream}", "--", sys.executable, str(script),
                 str(upstream), str(log))
    )  # fmt: skip
    wait_until(lambda: [m.get("listen") for m in who_json(arena)] == [f"[::1]:{port}"])
    conn = http.client.HTTPConnection("::1", port, timeout=30)
    conn.request("GET", "/hello")
    assert conn.getresponse().read().startswith(b"hello ")
    conn.close()


def test_out_of_descriptors_clients_wait_and_are_served(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    served = serve(spawn, arena, tmp_path)
    pid = served.job.pid
    kept = []
    for _ in range(4):  # keep-alive connections, each two descriptors of the wrapper
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
        conn.request("GET", "/hello")
        assert conn.getresponse().read().startswith(b"hello ")
        kept.append(conn)
    # Room for one more client, not for its connection to the server.
    used = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 1, used + 1))
    waiting = []  # room enough for them once the kept ones go
    for _ in range(4):  # each connected and asking before any descriptor comes back
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
        conn.request("GET", "/hello")
        waiting.append(in_thread(functools.partial(answer, conn)))
    time.sleep(1.0)  # a negative: ten pauses' worth of failed attempts
    for conn in kept:
        conn.close()
    assert [join() for join in waiting] == [f"hello {served.starts()[0][1]}\n"] * 4
    # Their descriptors closed, there is room for a client and its connection again: it goes
    # on accepting, with no second shortage to say.
    wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= used - 1)
    assert served.get().startswith("hello ")
    kill_group(served.job)
    assert served.job.stderr is not None
    err = served.job.stderr.read()
    warning = (
        f"vramlock: cannot accept a connection on 127.0.0.1:{served.port}: Too many open"
        " files; clients wait until descriptors are free"
    )
    assert err.splitlines() == [warning], err
