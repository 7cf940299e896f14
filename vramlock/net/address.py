"""Network addresses as the options give them: ``--listen``, ``--upstream``, the URLs.

    parse        HOST:PORT, [IPv6]:PORT or PORT (on 127.0.0.1) -> (host, port)
    resolve      every (family, sockaddr) an address names
    Address      where a server answers HTTP (host, port, path prefix)
    split_url    http://HOST[:PORT]/PATH -> (Address, path)
    same_socket  would connecting to one address reach a socket listening on the other?

A server's own address may be a wildcard (``0.0.0.0``, ``::``): a client connects to
loopback instead (``connect_host``).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import AddressError, UsageError

_ADDRESS = re.compile(r"(?:(?P<host>[^\[\]:]*)|\[(?P<v6>[^\[\]]+)\]):(?P<port>[0-9]+)")

Target = tuple[int, tuple[Any, ...]]  # (address family, socket address)


def parse(text: str, option: str) -> tuple[str, int]:
    """(host, port) from ``HOST:PORT``, ``[IPv6]:PORT`` or ``PORT`` (127.0.0.1); UsageError."""
    text = text.strip()
    m = _ADDRESS.fullmatch(f"127.0.0.1:{text}" if text.isascii() and text.isdigit() else text)
    host = (m.group("host") or m.group("v6")) if m else ""
    if not m or not host or not 0 < int(m.group("port")) < 65536:
        raise UsageError(
            f"{option}: bad address {text!r} (HOST:PORT, [IPv6]:PORT, or PORT for 127.0.0.1:PORT)"
        )
    return host, int(m.group("port"))


def connect_host(host: str) -> str:
    """The host to connect to for a server listening on ``host`` (a wildcard: loopback)."""
    host = host.strip().strip("[]")
    if host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def resolve(text: str, option: str, *, connect: bool = False) -> list[Target]:
    """Every (family, sockaddr) that ``text`` names (to connect to, with ``connect``: a
    wildcard is loopback); AddressError when it names none."""
    host, port = parse(text, option)
    if connect:
        host = connect_host(host)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise AddressError(option, text, err.strerror or str(err)) from None
    return [(family, sockaddr) for family, _, _, _, sockaddr in found]


def show(sockaddr: tuple[Any, ...]) -> str:
    """``host:port``, or ``[host]:port`` for IPv6."""
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(sockaddr: tuple[Any, ...]) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _is_local(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Is ``ip`` an address of this host? (Binding to it succeeds only then.)"""
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


def inherited(text: str) -> int | None:
    """The descriptor ``fd:N`` names (a listening socket handed down by the parent);
    None for an address."""
    kind, colon, number = text.partition(":")
    if kind == "fd" and colon and number.isascii() and number.isdigit():
        return int(number)
    return None


def same_socket(listen: str, upstream: str) -> bool:
    """Would a connection to ``upstream`` reach a socket bound to ``listen``? (A proxy
    that forwards to itself loops.) False when either does not resolve: that is said
    where the address is used."""
    if inherited(listen) is not None:
        return False  # bound by the parent, which chose both
    try:
        _, where = resolve(listen, "--listen")[0]
        targets = resolve(upstream, "--upstream", connect=True)
    except AddressError:
        return False
    bound = _ip(where)
    for _, sockaddr in targets:
        if sockaddr[1] != where[1]:
            continue
        ip = _ip(sockaddr)
        if ip == bound:
            return True
        # A wildcard takes every local address of its family; IPv6's takes IPv4's too
        # (unless the system binds IPv6 only: then the two would not both bind anyway).
        if bound.is_unspecified and _is_local(ip) and (bound.version == 6 or ip.version == 4):
            return True
    return False


@dataclass(frozen=True)
class Address:
    """Where a server answers HTTP: host, port, and a path prefix (no trailing slash)."""

    host: str
    port: int
    prefix: str = ""

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}{self.prefix}"


def server(text: str, option: str) -> Address:
    """A server's address given as ``HOST:PORT``, ``[IPv6]:PORT`` or ``PORT``, to connect to."""
    host, port = parse(text, option)
    return Address(connect_host(host), port)


def split_url(url: str, what: str) -> tuple[Address, str]:
    """``http://host[:port]/path`` as the address and the path (with its query); UsageError."""
    bad = UsageError(f"{what}: bad URL {url!r} (http://HOST[:PORT]/PATH)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise bad from None
    # port 0 is no port to connect to (urlsplit gives 0, which reads as "none given")
    if parts.scheme != "http" or not parts.hostname or port == 0:
        raise bad
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Address(connect_host(parts.hostname), port or 80), path
