"""``vramlock serve``'s address, listened on before anything slow is imported.

From exec to serving, serve imports the command line, aiohttp and its configuration's
modules and reads the configuration: a few hundred milliseconds in which its port would
refuse connections. ``vramlock.__main__`` calls ``early`` first: the address that
serve's ``--listen`` names (a port, ``:PORT`` or a literal IP) is bound and listened on
at once; the kernel completes the connections that arrive meanwhile, and they wait in
the backlog until serve takes them. Anything less plain (a name to resolve, ``--help``,
an address that cannot be bound): nothing happens here, and serve binds its address
later, reporting what is wrong, as it would without this module.

Imports only ``socket``: it runs before the rest of vramlock.
"""

from __future__ import annotations

import socket

DEFAULT = "127.0.0.1:8080"

_taken: tuple[str, list[socket.socket]] | None = None


def bind(host: str | None, port: int) -> list[socket.socket]:
    """Sockets listening on every address ``host`` names (None: every interface, IPv4
    and IPv6 apart, as asyncio binds them); OSError if one cannot be bound."""
    flags = socket.AI_PASSIVE if host is None else 0
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in dict.fromkeys(found):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this machine lacks
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(socket.SOMAXCONN)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def _listen_option(argv: list[str]) -> str | None:
    """``serve``'s --listen value in ``argv`` (its default when absent); None when
    the arguments are not plain enough to know it without the command line's parser."""
    found = DEFAULT
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--help", "--") or (arg.startswith("--listen") and arg[8:9] not in ("", "=")):
            return None
        if arg == "--listen":
            if i + 1 == len(argv):
                return None
            found = argv[i + 1]
            i += 1
        elif arg.startswith("--listen="):
            found = arg[9:]
        i += 1
    return found


def _literal(text: str) -> tuple[str | None, int] | None:
    """(host, port) of ``PORT``, ``:PORT``, ``IPv4:PORT`` or ``[IPv6]:PORT``, the host a
    literal address (None: every interface); None for anything else."""
    if text.isascii() and text.isdigit():
        text = f"127.0.0.1:{text}"
    host, colon, port = text.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    if host == "":
        return None, int(port)
    family = socket.AF_INET
    if host.startswith("[") and host.endswith("]"):
        host, family = host[1:-1], socket.AF_INET6
    try:
        socket.inet_pton(family, host)
    except OSError:
        return None
    return host, int(port)


def early(argv: list[str]) -> None:
    """Bind serve's address now, if ``argv`` (the arguments after ``serve``) name it
    plainly; else, or if it cannot be bound, leave it to serve."""
    global _taken
    listen = _listen_option(argv)
    where = None if listen is None else _literal(listen)
    if listen is None or where is None:
        return
    try:
        _taken = (listen, bind(*where))
    except OSError:
        return


def take(listen: str) -> list[socket.socket] | None:
    """The sockets ``early`` bound, if it bound ``listen``; those it bound for another
    text are closed, and None."""
    global _taken
    taken, _taken = _taken, None
    if taken is None:
        return None
    if taken[0] != listen:
        for sock in taken[1]:
            sock.close()
        return None
    return taken[1]
