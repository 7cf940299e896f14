"""``--demand listen``: a TCP proxy in front of the command's server.

Bytes pass through untouched (HTTP, streamed responses, websockets): this is TCP
splicing. HTTP/1.x framing is followed as the bytes pass (framing.py), only to tell
a response in progress from an idle keep-alive connection. One daemon thread runs a
selector over every socket; the runner's loop talks to it through a few methods and
a wake-up pipe.

The gate says what happens to clients:

- ``CLOSED`` (released): new connections are accepted and held, bytes a client sends
  on an open connection wait; either one is demand, and wakes the runner's loop;
- ``OPENING`` (started, or restored): the same, while the upstream is probed until it
  is ready (``ready_within`` at most: then the waiting clients are closed): until
  ``GET ready_url`` answers 2xx, or without one, until it accepts a TCP connection;
- ``OPEN``: connections are forwarded.

Nothing here blocks and nothing polls: with no traffic the thread sleeps in the
selector. The per-byte path is one ``recv``, one ``send``, a clock read and the
framing's arithmetic.
"""

from __future__ import annotations

import enum
import errno
import os
import selectors
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from ..arena.hint import drain
from ..errors import AddressError
from ..net.address import Target, resolve, show
from ..net.framing import Framing

# How often the upstream is probed while a restored server is starting, and how long
# one probe may take (a server that accepts and does not answer yet).
PROBE_EVERY = 0.05
PROBE_TIMEOUT = 1.0
# `who` learns the number of open connections at most this often.
REPORT_EVERY = 0.25
# After running out of descriptors (EMFILE), stop accepting for this long.
ACCEPT_PAUSE = 0.1
# How long a release waits for the proxy's thread to cut the exchanges in progress.
CUT_WITHIN = 1.0
_CHUNK = 256 * 1024
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


def _connect_to(target: Target) -> tuple[socket.socket, int]:
    """A non-blocking connection started to ``target``, and connect's errno (0: connected)."""
    sock = socket.socket(target[0], socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock, sock.connect_ex(target[1])


_PENDING = (errno.EINPROGRESS, errno.EAGAIN)


class Gate(enum.Enum):
    CLOSED = "closed"
    OPENING = "opening"
    OPEN = "open"


class _Flow:
    """One direction of a connection: bytes read from ``src`` go to ``dst``; what ``dst``
    did not take yet waits in ``buf``, and ``src`` is not read meanwhile."""

    __slots__ = ("buf", "dst", "eof", "src")

    def __init__(self, src: socket.socket, dst: socket.socket | None) -> None:
        self.src, self.dst = src, dst
        self.buf = bytearray()
        self.eof = False  # src sends no more

    @property
    def done(self) -> bool:
        return self.eof and not self.buf


class _Conn:
    """A client and, once forwarded, its connection to the upstream."""

    __slots__ = (
        "client",
        "connecting",
        "down",
        "last_down",
        "last_up",
        "parked",
        "requests",
        "responses",
        "up",
        "upstream",
    )

    def __init__(self, client: socket.socket, now: float) -> None:
        self.client = client
        self.upstream: socket.socket | None = None  # None: held
        self.connecting = False
        self.parked = False  # forwarded, but the client spoke while the gate was not open
        self.up = _Flow(client, None)  # client -> upstream
        self.down: _Flow | None = None  # upstream -> client
        # Accepting counts as traffic (for --idle): a new client is about to speak.
        self.last_up = self.last_down = now
        methods: deque[bytes] = deque()
        self.requests = Framing(responses=False, methods=methods)
        self.responses = Framing(responses=True, methods=methods)

    @property
    def waiting(self) -> bool:
        """Waits for the gate: held, or parked."""
        return self.upstream is None or self.parked

    def in_progress(self) -> bool:
        """Forwarded, and in the middle of an exchange: a request has begun and its
        response has not ended, or bytes wait for either side. Where the traffic is not
        HTTP/1.x, the client spoke last (an answer is awaited)."""
        if self.up.buf or (self.down is not None and self.down.buf):
            return True
        if self.requests.opaque or self.responses.opaque:
            return self.last_up > self.last_down
        return self.requests.started > self.responses.done


class Proxy:
    """Listens on ``listen`` (bound at once) and forwards to ``upstream`` through the gate.

    The gate starts closed; ``ready_url`` is the path that answers 2xx once the upstream
    serves (None: accepting a connection is ready). ``report(n)`` is told the number of
    open client connections when it changes (at most every ``REPORT_EVERY``), and
    ``working(busy)`` at once whenever the proxy starts or stops being busy (a client
    waits for the gate, or an exchange is in progress), both from the proxy's thread;
    ``warn`` gets diagnostics. Raises AddressError when an address cannot be resolved
    or bound.
    """

    def __init__(
        self,
        listen: str,
        upstream: str,
        *,
        idle: float,
        ready_within: float,
        ready_url: str | None = None,
        report: Callable[[int], None],
        warn: Callable[[str], None],
        working: Callable[[bool], None] | None = None,
    ) -> None:
        self.idle = idle
        self.ready_within = ready_within
        self.ready_url = ready_url
        self._report, self._warn, self._working = report, warn, working
        self._upstreams = resolve(upstream, "--upstream", connect=True)
        family, where = resolve(listen, "--listen")[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A restarted wrapper must not wait out the TIME_WAIT of its last clients.
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(where)
            self._listener.listen(socket.SOMAXCONN)
        except OSError as err:
            self._listener.close()
            raise AddressError("--listen", listen, err.strerror or str(err)) from None
        self._listener.setblocking(False)
        self.address = show(self._listener.getsockname())

        self._lock = threading.Lock()  # the gate, the probe's schedule, the connections
        self._gate = Gate.CLOSED
        self._conns: dict[_Conn, None] = {}  # in the order they came: held ones go first
        self._probe_at: float | None = None  # when to probe the upstream next
        self._ready_by = 0.0  # held clients are closed when it does not accept by then
        self._probe: socket.socket | None = None  # a probe's connection in progress
        self._probe_until = 0.0  # when a probe that has no answer yet fails
        self._probe_reply: bytearray | None = None  # None: the probe is connecting
        self._answer = ""  # what the last probe got, for the warning
        self._target = self._upstreams[0]  # the upstream address that accepted last
        self._accept_at: float | None = None  # accepting paused (EMFILE) until then
        self._starved = False  # out of descriptors, and clients not all in since
        self._awaited = False  # the runner waits for the exchanges in progress to end
        self._cutting: threading.Event | None = None  # set once busy connections are cut
        self._reported, self._last_report = 0, 0.0
        self._active: set[_Conn] = set()  # connections in an exchange or at the gate
        self._report_at: float | None = None
        self._handlers: dict[socket.socket, Callable[[int], None]] = {}
        self._masks: dict[socket.socket, int] = {}
        self._sel = selectors.DefaultSelector()
        self.wake_fd, self._wake_runner = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, _READ, None)
        self._watch(self._listener, self._on_listener, _READ)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="vramlock-proxy", daemon=True)
        # A handler that raises (an ending signal) in the middle of start() would leave the
        # thread half registered: hold signals back meanwhile. The thread keeps them
        # blocked; the main thread handles them, as Python does anyway.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            self._thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    # -- the runner's side (its own thread) ----------------------------------------

    def waiting(self) -> bool:
        """Does a client wait for the gate (a held connection, or bytes on a parked one)?"""
        with self._lock:
            return any(c.waiting for c in self._conns)

    def busy_for(self) -> float:
        """Seconds until no connection is busy, if nothing more happens; 0.0: not busy.

        Busy: a client waits for the gate, or an exchange is in progress (see
        ``_Conn.in_progress``), or there was traffic within ``idle``. The runner's
        loop is woken when the exchanges it waits for are over.
        """
        now = time.monotonic()
        with self._lock:
            conns = list(self._conns)
        left = 0.0
        for c in conns:
            if c.waiting or c.connecting or c.in_progress():
                self._awaited = True
                return max(self.idle, PROBE_EVERY)  # no end in sight: ask again then
            left = max(left, max(c.last_up, c.last_down) + self.idle - now)
        return left

    def close_gate(self) -> None:
        """The server is about to be released: hold what comes from now on, and end the
        exchanges still in progress (--yield-within ran out): a server that stays up
        while released must not go on answering them, and one that is ended would
        cut them anyway. Returns once they are cut."""
        with self._lock:
            self._gate = Gate.CLOSED
            self._probe_at = None
            if any(c.upstream is not None and c.in_progress() for c in self._conns):
                self._cutting = cut = threading.Event()
            else:
                return
        self._poke(self._wake_w)
        cut.wait(CUT_WITHIN)

    def open_gate(self) -> None:
        """The server is resident again: forward once it accepts a connection."""
        with self._lock:
            self._gate = Gate.OPENING
            self._probe_at = time.monotonic()
            self._ready_by = self._probe_at + self.ready_within
        self._poke(self._wake_w)

    def close(self) -> None:
        """Stop the thread and close every socket: clients see their connection end."""
        self._stop = True
        self._poke(self._wake_w)
        self._thread.join()
        for c in list(self._conns):
            self._drop(c)
        if self._probe is not None:
            self._probe.close()
        self._sel.close()
        self._listener.close()
        for fd in (self.wake_fd, self._wake_runner, self._wake_r, self._wake_w):
            os.close(fd)

    # -- the proxy's thread ---------------------------------------------------------

    @staticmethod
    def _poke(fd: int) -> None:
        try:
            os.write(fd, b"!")
        except BlockingIOError:
            pass  # full: a wake-up is pending anyway

    def _say(self, message: str) -> None:
        try:
            self._warn(message)
        except Exception:
            pass  # a diagnostic must never stop the proxy

    def _run(self) -> None:
        try:
            while not self._stop:
                for key, events in self._sel.select(self._timeout()):
                    if key.data is None:
                        drain(self._wake_r)
                    else:
                        key.data(events)
                self._timers()
                if self._cutting is not None:
                    self._cut()
        except Exception as err:  # a bug: say so, and leave no client hanging
            self._say(f"the proxy on {self.address} failed: {err!r}; closing its connections")
            for c in list(self._conns):
                self._drop(c)
            self._forget(self._listener)

    def _cut(self) -> None:
        with self._lock:
            done, self._cutting = self._cutting, None
            busy = [c for c in self._conns if c.upstream is not None and c.in_progress()]
        for conn in busy:
            self._drop(conn)
        if done is not None:
            done.set()

    def _watch(self, sock: socket.socket, handler: Callable[[int], None], mask: int = 0) -> None:
        """Call ``handler(events)`` for ``sock``'s events in ``mask`` (see ``_arm``)."""
        self._handlers[sock] = handler
        self._arm(sock, mask)

    def _arm(self, sock: socket.socket, mask: int) -> None:
        """Watch ``sock`` for the events in ``mask`` (0: none)."""
        old = self._masks.get(sock, 0)
        if mask == old:
            return
        if not mask:
            self._sel.unregister(sock)
            del self._masks[sock]
            return
        if old:
            self._sel.modify(sock, mask, self._handlers[sock])
        else:
            self._sel.register(sock, mask, self._handlers[sock])
        self._masks[sock] = mask

    def _forget(self, sock: socket.socket) -> None:
        self._arm(sock, 0)
        self._handlers.pop(sock, None)
        sock.close()

    def _timeout(self) -> float | None:
        due = [t for t in (self._probe_at, self._report_at, self._accept_at) if t is not None]
        if self._probe is not None:
            due += (self._ready_by, self._probe_until)
        return None if not due else max(0.0, min(due) - time.monotonic())

    def _timers(self) -> None:
        if (self._report_at, self._accept_at, self._probe_at, self._probe) == (None,) * 4:
            return  # the usual case: nothing is due, and the data path pays nothing more
        now = time.monotonic()
        if self._report_at is not None and now >= self._report_at:
            self._report_count(now)
        if self._accept_at is not None and now >= self._accept_at:
            self._accept_at = None
            self._arm(self._listener, _READ)
            for conn in self._stuck():
                self._forward(conn)
        with self._lock:
            opening = self._gate is Gate.OPENING
            due = self._probe_at is not None and now >= self._probe_at
        if not opening:
            self._stop_probe()
        elif now >= self._ready_by and (due or self._probe is not None):
            self._not_ready()
        elif self._probe is not None and now >= self._probe_until:
            self._answer = self._answer or "no answer"
            self._probe_failed()
        elif due and self._probe is None:
            self._start_probe()

    def _on_listener(self, events: int) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                if self._starved and not self._stuck():
                    self._starved = False  # every client is in: the shortage is over
                return
            except ConnectionAbortedError:
                continue  # gone before we took it
            except OSError as err:  # EMFILE, ENFILE, ENOBUFS: pause rather than spin
                self._starve(err)
                return
            client.setblocking(False)
            # Small writes go out at once: the client's timing is the server's.
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, time.monotonic())
            self._handlers[client] = partial(self._on_client, conn)
            with self._lock:
                self._conns[conn] = None
                gate = self._gate
                if gate is Gate.OPENING and self._probe_at is None and self._probe is None:
                    # The last wait for the upstream ran out: this client starts another.
                    self._probe_at = time.monotonic()
                    self._ready_by = self._probe_at + self.ready_within
            if gate is Gate.OPEN:
                self._forward(conn)
            else:
                self._hold(conn, gate)
            self._count_changed()

    def _starve(self, err: OSError) -> None:
        """Out of descriptors (or buffers): stop accepting for ``ACCEPT_PAUSE`` rather than
        spin, then accept, and forward the clients held meanwhile. Said once an episode."""
        if not self._starved:
            self._starved = True
            self._say(
                f"cannot accept a connection on {self.address}: {err.strerror}; clients wait"
                " until descriptors are free"
            )
        self._arm(self._listener, 0)
        if self._accept_at is None:
            self._accept_at = time.monotonic() + ACCEPT_PAUSE

    def _stuck(self) -> list[_Conn]:
        """Clients accepted through an open gate, and not forwarded for want of a socket."""
        with self._lock:
            return [c for c in self._conns if c.upstream is None and self._gate is Gate.OPEN]

    def _hold(self, conn: _Conn, gate: Gate) -> None:
        # Watched only to see a client that hangs up while it waits (see _on_client).
        self._arm(conn.client, _READ)
        self._mark(conn)
        if gate is Gate.CLOSED:
            self._poke(self._wake_runner)

    def _forward(self, conn: _Conn, sock: socket.socket | None = None) -> None:
        """Connect ``conn`` to the upstream: through ``sock`` (connected already) or anew."""
        if sock is None:
            try:
                sock, code = _connect_to(self._target)
            except OSError as err:  # no socket to be had (EMFILE): it waits, held
                self._starve(err)
                self._hold(conn, Gate.OPEN)
                return
            if code not in (0, *_PENDING):
                sock.close()
                self._refused(conn)
                return
            conn.connecting = code != 0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.upstream = conn.up.dst = sock
        conn.down = _Flow(sock, conn.client)
        self._handlers[sock] = partial(self._on_upstream, conn)
        self._rearm(conn)

    def _refused(self, conn: _Conn) -> None:
        """The upstream refused: the client's connection ends, unless the gate has closed
        meanwhile (the server is being released): then the client waits again."""
        conn.upstream, conn.up.dst, conn.down, conn.connecting = None, None, None, False
        gate = self._gate
        if gate is Gate.OPEN:
            self._drop(conn)
        else:
            self._hold(conn, gate)

    def _rearm(self, conn: _Conn) -> None:
        """Watch a forwarded connection's sockets for what each direction needs now."""
        up, down, upstream = conn.up, conn.down, conn.upstream
        assert down is not None and upstream is not None
        flowing = not conn.connecting
        reading = flowing and not conn.parked and not up.eof and not up.buf
        self._arm(conn.client, (_READ if reading else 0) | (_WRITE if down.buf else 0))
        writing = conn.connecting or up.buf
        reading = flowing and not down.eof and not down.buf
        self._arm(upstream, (_WRITE if writing else 0) | (_READ if reading else 0))
        self._mark(conn)

    def _on_client(self, conn: _Conn, events: int) -> None:
        if events & _WRITE and conn.down is not None:
            self._flush(conn, conn.down)
        if not events & _READ or conn not in self._conns:
            return
        gate = self._gate
        if conn.upstream is None or gate is not Gate.OPEN:
            # It waits for the gate: look without reading (its bytes stay with the kernel).
            try:
                hung_up = not conn.client.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                hung_up = True
            if hung_up and conn.upstream is None:
                self._drop(conn)
                return
            if not hung_up:
                if conn.upstream is None:
                    self._arm(conn.client, 0)  # it spoke: no more watching for a hang-up
                else:
                    with self._lock:
                        conn.parked = True
                    self._rearm(conn)
                if gate is Gate.CLOSED:
                    self._poke(self._wake_runner)
                return
            # A forwarded client hung up: pass that on, the gate does not hold an end.
        self._pump(conn, conn.up)

    def _on_upstream(self, conn: _Conn, events: int) -> None:
        sock = conn.upstream
        assert sock is not None
        if conn.connecting:
            conn.connecting = False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._forget(sock)
                self._refused(conn)
            else:
                self._rearm(conn)
            return
        if events & _WRITE:
            self._flush(conn, conn.up)
        if events & _READ and conn in self._conns and conn.down is not None:
            self._pump(conn, conn.down)

    def _pump(self, conn: _Conn, flow: _Flow) -> None:
        """Read what ``flow.src`` has and pass it on; what ``dst`` does not take waits."""
        try:
            data = flow.src.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)  # reset: the other side learns it by its connection ending
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

    def _flush(self, conn: _Conn, flow: _Flow) -> None:
        sent = self._send(conn, flow, flow.buf)
        if sent is not None:
            del flow.buf[:sent]
            self._settle(conn, flow)
            self._over(conn)

    def _over(self, conn: _Conn) -> None:
        """Wake the runner once an exchange it waits for has ended."""
        self._mark(conn)
        if self._awaited and not conn.in_progress():
            self._awaited = False
            self._poke(self._wake_runner)

    def _send(self, conn: _Conn, flow: _Flow, data: bytes | bytearray) -> int | None:
        """Bytes sent (0 when ``dst`` is full); None when the connection was dropped."""
        assert flow.dst is not None
        try:
            return flow.dst.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self._drop(conn)
            return None

    def _settle(self, conn: _Conn, flow: _Flow) -> None:
        """Pass an end of stream on once its bytes are out; drop a connection done both ways."""
        if flow.done and flow.dst is not None:
            try:
                flow.dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the peer is gone already: the other direction finds out
        if conn.up.done and conn.down is not None and conn.down.done:
            self._drop(conn)
        else:
            self._rearm(conn)

    def _drop(self, conn: _Conn) -> None:
        with self._lock:
            if conn not in self._conns:
                return  # dropped already
            del self._conns[conn]
        if self._awaited:
            self._awaited = False
            self._poke(self._wake_runner)
        self._forget(conn.client)
        if conn.upstream is not None:
            self._forget(conn.upstream)
        self._mark(conn)
        self._count_changed()

    def _mark(self, conn: _Conn) -> None:
        """Keep ``_active`` up to date for ``conn``, and say at once when the proxy
        starts or stops being busy (budget waiters ask idle residents first)."""
        was = bool(self._active)
        if conn in self._conns and (conn.waiting or conn.connecting or conn.in_progress()):
            self._active.add(conn)
        else:
            self._active.discard(conn)
        if bool(self._active) != was and self._working is not None:
            try:
                self._working(not was)
            except Exception:
                pass  # advisory only

    def _count_changed(self) -> None:
        now = time.monotonic()
        if now >= self._last_report + REPORT_EVERY:
            self._report_count(now)
        elif self._report_at is None:
            self._report_at = self._last_report + REPORT_EVERY

    def _report_count(self, now: float) -> None:
        self._report_at = None
        count = len(self._conns)
        if count != self._reported:
            self._reported, self._last_report = count, now
            try:
                self._report(count)
            except Exception:
                pass  # for display only

    # -- waiting for the upstream after a restore ------------------------------------

    def _start_probe(self) -> None:
        with self._lock:
            self._probe_at = None
        try:
            sock, code = _connect_to(self._target)
        except OSError as err:  # EMFILE: try again once some are free
            self._starve(err)
            self._probe_again()
            return
        if code not in (0, *_PENDING):
            sock.close()
            self._answer = "connection refused"
            self._probe_again()
            return
        self._probe, self._probe_until = sock, time.monotonic() + PROBE_TIMEOUT
        self._probe_reply = None
        self._watch(sock, self._on_probe, _WRITE)

    def _on_probe(self, events: int) -> None:
        sock = self._probe
        assert sock is not None
        if self._probe_reply is None:  # connecting
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._answer = "connection refused"
                self._probe_failed()
            elif self.ready_url is None:
                self._forget_probe()
                self._ready(sock)  # its connection serves the first client
            else:
                self._ask(sock)
            return
        try:
            data = sock.recv(4096)
        except OSError as err:
            data, self._answer = b"", (err.strerror or str(err)).lower()
        if not data:
            self._answer = self._answer or "the connection was closed without an answer"
            self._probe_failed()
            return
        self._probe_reply += data
        line, crlf, _ = bytes(self._probe_reply).partition(b"\r\n")
        if not crlf and len(self._probe_reply) < 4096:
            return  # more to come
        parts = line.split()
        status = parts[1].decode(errors="replace") if len(parts) > 1 else "no status"
        if len(parts) > 1 and parts[0].startswith(b"HTTP/") and status[:1] == "2":
            self._stop_probe()
            self._ready(None)
        else:
            self._answer = f"GET {self.ready_url} answered {status[:20]}"
            self._probe_failed()

    def _ask(self, sock: socket.socket) -> None:
        """Send the readiness request (small: a fresh connection takes it at once)."""
        host = show(self._target[1])
        request = (
            f"GET {self.ready_url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            sent = sock.send(request)
        except OSError as err:
            sent, self._answer = 0, (err.strerror or str(err)).lower()
        if sent != len(request):
            self._probe_failed()
            return
        self._answer = ""
        self._probe_reply = bytearray()
        self._arm(sock, _READ)

    def _probe_failed(self) -> None:
        self._stop_probe()
        self._probe_again()

    def _forget_probe(self) -> None:
        """The probe's socket, no longer watched, and no longer the probe's."""
        assert self._probe is not None
        self._arm(self._probe, 0)
        del self._handlers[self._probe]
        self._probe = None

    def _probe_again(self) -> None:
        """Not ready: the next address the upstream resolves to, a little later."""
        i = self._upstreams.index(self._target)
        self._target = self._upstreams[(i + 1) % len(self._upstreams)]
        with self._lock:
            if self._gate is Gate.OPENING:
                self._probe_at = time.monotonic() + PROBE_EVERY

    def _stop_probe(self) -> None:
        if self._probe is not None:
            self._forget(self._probe)
            self._probe = None

    def _ready(self, sock: socket.socket | None) -> None:
        """The upstream is ready: open the gate; ``sock``, a connection to it, serves the
        first client."""
        with self._lock:
            if self._gate is not Gate.OPENING:
                if sock is not None:
                    sock.close()  # closed again meanwhile: the server is being released
                return
            self._gate = Gate.OPEN
            waiting = [c for c in self._conns if c.waiting]
            for c in waiting:
                c.parked = False
        held = [c for c in waiting if c.upstream is None]
        for conn in waiting:
            if conn.upstream is not None:
                self._rearm(conn)
        if held and sock is not None:
            self._forward(held.pop(0), sock)
        elif sock is not None:
            sock.close()
        for conn in held:
            self._forward(conn)

    def _not_ready(self) -> None:
        self._stop_probe()
        with self._lock:
            self._probe_at = None
            waiting = [c for c in self._conns if c.waiting]
        if not waiting:
            return  # nobody to tell: the next client starts another wait
        if self.ready_url is None:
            ready = "accept a connection"
        else:
            ready = f"answer GET {self.ready_url} with 2xx ({self._answer or 'no answer'})"
        self._say(
            f"the upstream {show(self._target[1])} did not {ready} within"
            f" {self.ready_within:g} s; closing {len(waiting)} waiting connection(s)"
        )
        for conn in waiting:
            self._drop(conn)
