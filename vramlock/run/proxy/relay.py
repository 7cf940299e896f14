"""The clients' connections, the gate they pass, and the bytes pumped through them.

A client arrives while the gate is open: it is forwarded, and its bytes flow both ways
(one ``recv``, one ``send``; what the other side does not take waits, and its source
is not read meanwhile). Otherwise it is held: accepted, watched only for a hang-up;
one forwarded already is parked, its bytes left with the kernel. Either one waiting is
demand, and wakes the runner.
"""

from __future__ import annotations

import enum
import socket
import threading
import time
from collections.abc import Callable
from functools import partial

from ...net.address import Target
from .conn import Conn, Flow
from .loop import PENDING, READ, WRITE, Loop, connect_to, poke

_CHUNK = 256 * 1024


class Gate(enum.Enum):
    CLOSED = "closed"
    OPENING = "opening"
    OPEN = "open"


class Relay:
    """Every client connection, in the order they came (held ones go first).

    ``lock`` guards the gate and ``conns`` (the runner's thread reads them);
    ``target()`` is the upstream address to connect to, ``starve(err)`` is told that no
    socket could be had, ``counted()`` that the number of connections changed, and
    ``working(busy)`` when the relay starts or stops being busy. ``wake_runner`` is the
    pipe that wakes the runner's loop.
    """

    def __init__(
        self,
        loop: Loop,
        wake_runner: int,
        *,
        target: Callable[[], Target],
        starve: Callable[[OSError], None],
        counted: Callable[[], None],
        working: Callable[[bool], None] | None,
    ) -> None:
        self._loop, self._wake_runner = loop, wake_runner
        self._target, self._starve, self._counted = target, starve, counted
        self._working = working
        self.lock = threading.Lock()
        self.gate = Gate.CLOSED
        self.conns: dict[Conn, None] = {}
        self.awaited = False  # the runner waits for the exchanges in progress to end
        self._active: set[Conn] = set()  # connections in an exchange or at the gate

    def admit(self, client: socket.socket) -> Conn:
        """A client just accepted: watched, and counted among ``conns``."""
        conn = Conn(client, time.monotonic())
        self._loop.handle(client, partial(self._on_client, conn))
        with self.lock:
            self.conns[conn] = None
        return conn

    def waiting(self) -> list[Conn]:
        """The connections that wait for the gate."""
        with self.lock:
            return [c for c in self.conns if c.waiting]

    def busy(self) -> list[Conn]:
        """Forwarded connections in the middle of an exchange."""
        with self.lock:
            return [c for c in self.conns if c.upstream is not None and c.in_progress()]

    def hold(self, conn: Conn, gate: Gate) -> None:
        """``conn`` waits (the gate is not open, or no socket could be had)."""
        # Watched only to see a client that hangs up while it waits (see _on_client).
        self._loop.arm(conn.client, READ)
        self._mark(conn)
        if gate is Gate.CLOSED:
            poke(self._wake_runner)

    def forward(self, conn: Conn, sock: socket.socket | None = None) -> None:
        """Connect ``conn`` to the upstream: through ``sock`` (connected already) or anew."""
        if sock is None:
            try:
                sock, code = connect_to(self._target())
            except OSError as err:  # no socket to be had (EMFILE): it waits, held
                self._starve(err)
                self.hold(conn, Gate.OPEN)
                return
            if code not in (0, *PENDING):
                sock.close()
                self._refused(conn)
                return
            conn.connecting = code != 0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.upstream = conn.up.dst = sock
        conn.down = Flow(sock, conn.client)
        self._loop.handle(sock, partial(self._on_upstream, conn))
        self.rearm(conn)

    def _refused(self, conn: Conn) -> None:
        """The upstream refused: the client's connection ends, unless the gate has closed
        meanwhile (the server is being released): then the client waits again."""
        conn.upstream, conn.up.dst, conn.down, conn.connecting = None, None, None, False
        gate = self.gate
        if gate is Gate.OPEN:
            self.drop(conn)
        else:
            self.hold(conn, gate)

    def rearm(self, conn: Conn) -> None:
        """Watch a forwarded connection's sockets for what each direction needs now."""
        up, down, upstream = conn.up, conn.down, conn.upstream
        assert down is not None and upstream is not None
        flowing = not conn.connecting
        reading = flowing and not conn.parked and not up.eof and not up.buf
        self._loop.arm(conn.client, (READ if reading else 0) | (WRITE if down.buf else 0))
        writing = conn.connecting or up.buf
        reading = flowing and not down.eof and not down.buf
        self._loop.arm(upstream, (WRITE if writing else 0) | (READ if reading else 0))
        self._mark(conn)

    def _on_client(self, conn: Conn, events: int) -> None:
        if events & WRITE and conn.down is not None:
            self._flush(conn, conn.down)
        if not events & READ or conn not in self.conns:
            return
        gate = self.gate
        waits = conn.upstream is None or gate is not Gate.OPEN
        if waits and self._at_gate(conn, gate):
            return
        # Forwarded through an open gate, or a parked client that hung up: pass its
        # bytes or its end on (the gate does not hold an end).
        self._pump(conn, conn.up)

    def _at_gate(self, conn: Conn, gate: Gate) -> bool:
        """A waiting client is readable: look without reading (its bytes stay with the
        kernel). False when a forwarded one hung up: that end is to be passed on."""
        try:
            hung_up = not conn.client.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            hung_up = True
        if hung_up:
            if conn.upstream is None:
                self.drop(conn)
                return True
            return False
        if conn.upstream is None:
            self._loop.arm(conn.client, 0)  # it spoke: no more watching for a hang-up
        else:
            with self.lock:
                conn.parked = True
            self.rearm(conn)
        if gate is Gate.CLOSED:
            poke(self._wake_runner)
        return True

    def _on_upstream(self, conn: Conn, events: int) -> None:
        sock = conn.upstream
        assert sock is not None
        if conn.connecting:
            conn.connecting = False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._loop.forget(sock)
                self._refused(conn)
            else:
                self.rearm(conn)
            return
        if events & WRITE:
            self._flush(conn, conn.up)
        if events & READ and conn in self.conns and conn.down is not None:
            self._pump(conn, conn.down)

    def _pump(self, conn: Conn, flow: Flow) -> None:
        """Read what ``flow.src`` has and pass it on; what ``dst`` does not take waits."""
        try:
            data = flow.src.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.drop(conn)  # reset: the other side learns it by its connection ending
            return
        if flow is conn.up:
            conn.last_up = time.monotonic()
            conn.requests.feed(data)
        else:
            conn.last_down = time.monotonic()
            conn.responses.feed(data)
        if not data:
            flow.eof = True
            if flow is conn.down:
                conn.responses.end()
        else:
            sent = self._send(conn, flow, data)
            if sent is None:
                return
            if sent < len(data):
                flow.buf += data[sent:]
            elif not flow.buf:
                self._over(conn)
                return  # all of it went through: nothing to watch differently
        self._settle(conn, flow)
        self._over(conn)

    def _flush(self, conn: Conn, flow: Flow) -> None:
        sent = self._send(conn, flow, flow.buf)
        if sent is not None:
            del flow.buf[:sent]
            self._settle(conn, flow)
            self._over(conn)

    def _over(self, conn: Conn) -> None:
        """Wake the runner once an exchange it waits for has ended."""
        self._mark(conn)
        if self.awaited and not conn.in_progress():
            self.awaited = False
            poke(self._wake_runner)

    def _send(self, conn: Conn, flow: Flow, data: bytes | bytearray) -> int | None:
        """Bytes sent (0 when ``dst`` is full); None when the connection was dropped."""
        assert flow.dst is not None
        try:
            return flow.dst.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self.drop(conn)
            return None

    def _settle(self, conn: Conn, flow: Flow) -> None:
        """Pass an end of stream on once its bytes are out; drop a connection done both ways."""
        if flow.done and flow.dst is not None:
            try:
                flow.dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the peer is gone already: the other direction finds out
        if conn.up.done and conn.down is not None and conn.down.done:
            self.drop(conn)
        else:
            self.rearm(conn)

    def drop(self, conn: Conn) -> None:
        """Close ``conn``'s sockets: its client sees the connection end."""
        with self.lock:
            if conn not in self.conns:
                return  # dropped already
            del self.conns[conn]
        if self.awaited:
            self.awaited = False
            poke(self._wake_runner)
        self._loop.forget(conn.client)
        if conn.upstream is not None:
            self._loop.forget(conn.upstream)
        self._mark(conn)
        self._counted()

    def _mark(self, conn: Conn) -> None:
        """Keep ``_active`` up to date for ``conn``, and say at once when the relay
        starts or stops being busy (budget waiters ask idle residents first)."""
        was = bool(self._active)
        if conn in self.conns and conn.busy():
            self._active.add(conn)
        else:
            self._active.discard(conn)
        if bool(self._active) != was and self._working is not None:
            try:
                self._working(not was)
            except Exception:
                pass  # advisory only
