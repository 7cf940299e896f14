"""Loopback helpers shared by the tests and the benchmarks."""

from __future__ import annotations

import random
import socket


def free_ports(n: int = 2) -> list[int]:
    """``n`` distinct loopback ports that were free an instant ago."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One loopback port that was free an instant ago."""
    return free_ports(1)[0]


def start_port(n: int = 4) -> int:
    """The first of ``n`` consecutive loopback ports that were free an instant ago, below
    the kernel's ephemeral range, as a config's ``startPort`` wants them: a port from that
    range's next ones may be taken by any connection made meanwhile (serve's own)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    if low < 10000 + 2 * n:  # no room below the range: take it as bind(0) finds it
        return free_port()
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(10000, low - n)
        socks = [socket.socket() for _ in range(n)]
        try:
            for k, s in enumerate(socks):
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row below {low}")


def accepts(port: int) -> bool:
    """Does something accept connections on the loopback port?"""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def answers_health(port: int) -> bool:
    """Does serve's /health on the loopback port answer (llama-swap's plain "OK")? Its port
    accepts before its configuration is read; this is once it has been."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        reply = conn.getresponse()
        return reply.status == 200 and reply.read() == b"OK"
    except OSError:
        return False
    finally:
        conn.close()
