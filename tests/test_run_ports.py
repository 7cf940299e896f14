"""A model's port is its own: ``vramlock run --demand listen`` forwards clients only to
a listener of its command's own processes. Another program on the upstream's port (the
test's own socket here) gets no connection, and the wrapper, or serve's client, is told
why. The witness is that socket's backlog: nothing is ever queued in it."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.net import free_port, free_ports
from helpers.processes import Spawn, wait_until
from helpers.serve import ECHO, call, start, write_config

pytestmark = pytest.mark.timeout(90)


def untouched(stranger: socket.socket) -> bool:
    """Has nobody connected to ``stranger`` (its backlog is empty)?"""
    stranger.setblocking(False)
    try:
        conn, _ = stranger.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def test_run_refuses_an_upstream_port_in_use_before_it_starts(arena: Path, spawn: Spawn) -> None:
    listen = free_port()
    with socket.create_server(("127.0.0.1", 0)) as stranger:
        up = stranger.getsockname()[1]
        job = spawn(vramlock("run", "--arena", str(arena), "--demand", "listen", "--listen",
                             str(listen), "--upstream", str(up), "--", sys.executable, str(ECHO),
                             str(up), "m"))  # fmt: skip
        _, err = job.communicate(timeout=30)
        assert job.returncode == 125
        assert err == (
            f"vramlock: --upstream {up}: port {up} is in use already, by"
            f" {_comm()} (pid {os.getpid()}): the command could not listen there, and its"
            " clients would reach that program\n"
        )
        assert untouched(stranger)


def test_run_forwards_nothing_to_a_stranger_that_took_the_port(arena: Path, spawn: Spawn) -> None:
    """The port was free when the wrapper started; somebody took it before the server
    listened (the server waits 3 s): the client is closed, not forwarded there."""
    listen, up = free_ports(2)
    job = spawn(vramlock("run", "--arena", str(arena), "--demand", "listen", "--listen",
                         str(listen), "--upstream", str(up), "--", sys.executable, str(ECHO),
                         str(up), "m", "3"))  # fmt: skip
    # Its port looked at and found free: the wrapper says where it listens only after.
    wait_until(lambda: job.poll() is not None or any(m["listen"] for m in who_json(arena)))
    assert job.poll() is None, job.communicate()
    with socket.create_server(("127.0.0.1", up)) as stranger:
        with socket.create_connection(("127.0.0.1", listen), timeout=20) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _unanswered(client)
        assert untouched(stranger)
        job.terminate()
        _, err = job.communicate(timeout=30)
    said = (f"vramlock: port {up} is served by {_comm()} (pid {os.getpid()}), not by the"
            " command; its clients are not forwarded there")  # fmt: skip
    assert said in err.splitlines(), err


def test_serve_tells_the_client_whose_the_model_s_port_is(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """Another program listens on a model's port: serve's client gets a 502 that says
    so, and that program no request."""
    with socket.create_server(("127.0.0.1", 0)) as stranger:
        up = stranger.getsockname()[1]
        text = (f"models:\n  m:\n    cmd: {sys.executable} {ECHO} {up} m\n"
                f"    proxy: http://127.0.0.1:{up}\n")  # fmt: skip
        _, port = start(spawn, write_config(tmp_path, text), arena)
        status, _, body = call(port, "POST", "/v1/completions", {"model": "m"})
        assert status == 502
        message = json.loads(body)["error"]["message"]
        assert message.startswith("model m: its server did not answer: its wrapper exited with"
                                  f" status 125; its last output: vramlock: --upstream"
                                  f" 127.0.0.1:{up}: port {up} is in use already, by"
                                  f" {_comm()} (pid {os.getpid()})")  # fmt: skip
        assert untouched(stranger)


def _unanswered(client: socket.socket) -> bool:
    """Closed (or reset) with no answer."""
    try:
        return client.recv(100) == b""
    except ConnectionResetError:
        return True


def _comm() -> str:
    with open(f"/proc/{os.getpid()}/comm") as f:
        return f.read().strip()


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_listener_is_found_by_its_inode_both_ways(family: socket.AddressFamily) -> None:
    """The kernel's socket diagnostics and /proc/net/tcp{,6} (its fallback) name the
    same socket: the one the listener's own descriptor is."""
    from vramlock.run.proxy import owner

    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.create_server((host, 0), family=family) as sock:
        port = sock.getsockname()[1]
        inode = os.fstat(sock.fileno()).st_ino
        assert owner.listeners(port) == owner._table_listeners(port) == {inode}
    assert owner.listeners(port) == owner._table_listeners(port) == set()
