"""Loopback helpers shared by the tests and the benchmarks."""

from __future__ import annotations

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


def accepts(port: int) -> bool:
    """Does something accept connections on the loopback port?"""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
