"""What ``--demand listen``'s proxy adds to a request to a resident server, in one run.

A small HTTP server (this file with ``--role server``: a thread per connection, a fixed
answer of ``--size`` bytes) runs under ``vramlock run --demand listen --release restart``,
alone in a temporary arena, so it stays resident. The client sends the same GET to the
server directly and through the proxy, alternating request by request, so that drift on the
machine hits both alike, and times each one (send to last byte, ``time.perf_counter``):

- ``keep-alive``: one connection each way, reused for every request;
- ``new connection``: connect, one request, close: what a client without a pool pays.

Reported: p50 and p99 of each, and what the proxy adds (proxied minus direct, per
percentile). Loopback addresses only.

    python bench/proxy.py [--requests 2000] [--size 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.net import accepts, free_ports  # noqa: E402

REQUEST = b"GET /x HTTP/1.1\r\nHost: bench\r\n\r\n"


def serve(port: int, size: int) -> None:
    body = b"x" * size
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (size, body)

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                pending = pending.split(b"\r\n\r\n", 1)[1]
                conn.sendall(answer)

    listener = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def exchange(sock: socket.socket, expect: int) -> None:
    """One request, and its whole answer (``expect`` bytes)."""
    sock.sendall(REQUEST)
    got = 0
    while got < expect:
        data = sock.recv(65536)
        if not data:
            raise SystemExit("the server closed the connection")
        got += len(data)


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99, in milliseconds."""
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


def measure(
    requests: int, direct: int, proxied: int, expect: int, *, reuse: bool
) -> dict[str, tuple[float, float]]:
    times: dict[str, list[float]] = {"direct": [], "proxied": []}
    open_: dict[str, socket.socket] = {}
    if reuse:
        open_ = {"direct": connect(direct), "proxied": connect(proxied)}
    try:
        for i in range(requests * 2):
            which = ("direct", "proxied")[i % 2]
            port = direct if which == "direct" else proxied
            start = time.perf_counter()
            if reuse:
                exchange(open_[which], expect)
            else:
                with connect(port) as sock:
                    exchange(sock, expect)
            times[which].append(time.perf_counter() - start)
    finally:
        for sock in open_.values():
            sock.close()
    return {which: percentiles(samples) for which, samples in times.items()}


def wait_for(what: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not what():
        if time.monotonic() > end:
            raise SystemExit("the wrapped server did not come up")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("bench", "server"), default="bench")
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=2000, help="per mode and path")
    parser.add_argument("--size", type=int, default=512, help="answer body, bytes")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.role == "server":
        serve(args.port, args.size)
        return 0

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("VRAMLOCK_ARENA", None)
    listen, upstream = free_ports(2)
    expect = len(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % args.size) + args.size
    with tempfile.TemporaryDirectory(prefix="vramlock-proxy-") as arena:
        wrapper = subprocess.Popen(
            [sys.executable, "-m", "vramlock", "run", "--arena", arena, "--release", "restart",
             "--demand", "listen", "--listen", str(listen), "--upstream", str(upstream), "--",
             sys.executable, __file__, "--role", "server", "--port", str(upstream),
             "--size", str(args.size)],
            env=env,
        )  # fmt: skip
        try:
            wait_for(lambda: accepts(upstream), 30)
            measure(200, upstream, listen, expect, reuse=True)  # warm-up
            results = {
                "keep-alive": measure(args.requests, upstream, listen, expect, reuse=True),
                "new connection": measure(args.requests, upstream, listen, expect, reuse=False),
            }
        finally:
            wrapper.terminate()
            wrapper.wait(30)

    print(f"{args.requests} requests per mode and path, {args.size}-byte answers, alternating")
    print(f"{'mode':<16}{'direct p50/p99':>18}{'proxied p50/p99':>19}{'added p50/p99':>17}  ms")
    for mode, r in results.items():
        (d50, d99), (p50, p99) = r["direct"], r["proxied"]
        print(
            f"{mode:<16}{d50:>9.3f} /{d99:>7.3f}{p50:>10.3f} /{p99:>7.3f}"
            f"{p50 - d50:>8.3f} /{p99 - d99:>7.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "size": args.size, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
