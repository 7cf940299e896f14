"""The proxy: its listener, its thread, and what the runner asks of it."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

from ...errors import AddressError
from ...net.address import inherited, resolve, show
from ...threads import start_blocked
from .conn import Conn
from .loop import READ, Loop
from .owner import Guard
from .probe import PROBE_EVERY, Probe
from .relay import Gate, Relay

# `who` learns the number of open connections at most this often.
REPORT_EVERY = 0.25
# After running out of descriptors (EMFILE), stop accepting for this long.
ACCEPT_PAUSE = 0.1
# How long a release waits for the proxy's thread to cut the exchanges in progress.
CUT_WITHIN = 1.0


def _listen(listen: str) -> socket.socket:
    """A non-blocking socket listening on ``listen``, or the listening socket ``fd:N``
    handed down (``vramlock serve`` keeps its models' ports that way, so that nobody
    else takes one between two runs); AddressError if it cannot be."""
    fd = inherited(listen)
    if fd is not None:
        return _inherited(listen, fd)
    family, where = resolve(listen, "--listen")[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A restarted wrapper must not wait out the TIME_WAIT of its last clients.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise AddressError("--listen", listen, err.strerror or str(err)) from None
    sock.setblocking(False)
    return sock


def _inherited(listen: str, fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as err:
        raise AddressError("--listen", listen, err.strerror or str(err)) from None
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_ACCEPTCONN
    ):
        sock.detach()  # not ours to close
        raise AddressError("--listen", listen, "not a listening TCP socket")
    sock.set_inheritable(False)  # the command does not get it
    sock.setblocking(False)
    return sock


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
        note: Callable[[str | None], None] | None = None,
    ) -> None:
        self.idle = idle
        self._note = note  # told why clients are refused (None: no longer)
        self.guard: Guard | None = None  # whose the upstream's port is (set once it runs)
        self._refusal: str | None = None  # why clients are refused now
        self.ready_within = ready_within
        self._report, self._warn = report, warn
        upstreams = resolve(upstream, "--upstream", connect=True)
        self._listener = _listen(listen)
        self.address = show(self._listener.getsockname())
        self._loop = Loop()
        self.wake_fd, self._wake_runner = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._probe = Probe(self._loop, upstreams, ready_url, ready=self._ready,
                            retry=self._retry, starve=self._starve,
                            vet=lambda: self._stranger() is None)  # fmt: skip
        self._relay = Relay(self._loop, self._wake_runner, target=lambda: self._probe.target,
                            starve=self._starve, counted=self._count_changed,
                            working=working)  # fmt: skip
        self._probe_at: float | None = None  # when to probe the upstream next (under lock)
        self._ready_by = 0.0  # held clients are closed when it does not accept by then
        self._accept_at: float | None = None  # accepting paused (EMFILE) until then
        self._starved = False  # out of descriptors, and clients not all in since
        self._cutting: threading.Event | None = None  # set once busy connections are cut
        self._reported, self._last_report = 0, 0.0
        self._report_at: float | None = None
        self._loop.watch(self._listener, self._on_listener, READ)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="vramlock-proxy", daemon=True)
        start_blocked(self._thread)

    @property
    def upstream_port(self) -> int:
        """The port the upstream listens on."""
        return int(self._probe.target[1][1])

    @property
    def ready_url(self) -> str | None:
        """The path that answers 2xx once the upstream serves (None: accepting is ready)."""
        return self._probe.ready_url

    # -- the runner's side (its own thread) ----------------------------------------

    def waiting(self) -> bool:
        """Does a client wait for the gate (a held connection, or bytes on a parked one)?"""
        return bool(self._relay.waiting())

    def busy_for(self) -> float:
        """Seconds until no connection is busy, if nothing more happens; 0.0: not busy.

        Busy: a client waits for the gate, or an exchange is in progress (see
        ``Conn.in_progress``), or there was traffic within ``idle``. The runner's
        loop is woken when the exchanges it waits for are over.
        """
        now = time.monotonic()
        with self._relay.lock:
            conns = list(self._relay.conns)
        left = 0.0
        for c in conns:
            if c.busy():
                self._relay.awaited = True
                return max(self.idle, PROBE_EVERY)  # no end in sight: ask again then
            left = max(left, max(c.last_up, c.last_down) + self.idle - now)
        return left

    def close_gate(self) -> None:
        """The server is about to be released: hold what comes from now on, and end the
        exchanges still in progress (--yield-within ran out): a server that stays up
        while released must not go on answering them, and one that is ended would
        cut them anyway. Returns once they are cut."""
        with self._relay.lock:
            self._relay.gate = Gate.CLOSED
            self._probe_at = None
            if any(c.upstream is not None and c.in_progress() for c in self._relay.conns):
                self._cutting = cut = threading.Event()
            else:
                return
        self._loop.wake()
        cut.wait(CUT_WITHIN)

    def open_gate(self) -> None:
        """The server is resident again: forward once it accepts a connection."""
        with self._relay.lock:
            self._relay.gate = Gate.OPENING
            self._probe_at = time.monotonic()
            self._ready_by = self._probe_at + self.ready_within
        self._loop.wake()

    def close(self) -> None:
        """Stop the thread and close every socket: clients see their connection end."""
        self._stop = True
        self._loop.wake()
        self._thread.join()
        for c in list(self._relay.conns):
            self._relay.drop(c)
        self._probe.stop()
        self._loop.close()
        self._listener.close()
        for fd in (self.wake_fd, self._wake_runner):
            os.close(fd)

    # -- the proxy's thread ---------------------------------------------------------

    def _say(self, message: str) -> None:
        try:
            self._warn(message)
        except Exception:
            pass  # a diagnostic must never stop the proxy

    def _run(self) -> None:
        try:
            while not self._stop:
                self._loop.turn(self._timeout())
                self._timers()
                if self._cutting is not None:
                    self._cut()
        except Exception as err:  # a bug: say so, and leave no client hanging
            self._say(f"the proxy on {self.address} failed: {err!r}; closing its connections")
            for c in list(self._relay.conns):
                self._relay.drop(c)
            self._loop.forget(self._listener)

    def _cut(self) -> None:
        with self._relay.lock:
            done, self._cutting = self._cutting, None
        for conn in self._relay.busy():
            self._relay.drop(conn)
        if done is not None:
            done.set()

    def _timeout(self) -> float | None:
        due = [t for t in (self._probe_at, self._report_at, self._accept_at) if t is not None]
        if self._probe.active:
            due += (self._ready_by, self._probe.until)
        return None if not due else max(0.0, min(due) - time.monotonic())

    def _timers(self) -> None:
        if (self._report_at, self._accept_at, self._probe_at) == (None,) * 3 and (
            not self._probe.active
        ):
            return  # the usual case: nothing is due, and the data path pays nothing more
        now = time.monotonic()
        if self._report_at is not None and now >= self._report_at:
            self._report_count(now)
        if self._accept_at is not None and now >= self._accept_at:
            self._accept_at = None
            self._loop.arm(self._listener, READ)
            for conn in self._stuck():
                self._relay.forward(conn)
        self._probe_timers(now)

    def _probe_timers(self, now: float) -> None:
        with self._relay.lock:
            opening = self._relay.gate is Gate.OPENING
            due = self._probe_at is not None and now >= self._probe_at
        probing = self._probe.active
        if not opening:
            self._probe.stop()
        elif now >= self._ready_by and (due or probing):
            self._not_ready()
        elif probing and now >= self._probe.until:
            self._probe.timed_out()
        elif due and not probing:
            with self._relay.lock:
                self._probe_at = None
            if self._stranger() is None:  # no connection to a stranger, not even a probe
                self._probe.start()

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
            self._accepted(client)

    def _accepted(self, client: socket.socket) -> None:
        client.setblocking(False)
        # Small writes go out at once: the client's timing is the server's.
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = self._relay.admit(client)
        with self._relay.lock:
            gate = self._relay.gate
            if gate is Gate.OPENING and self._probe_at is None and not self._probe.active:
                # The last wait for the upstream ran out: this client starts another.
                self._probe_at = time.monotonic()
                self._ready_by = self._probe_at + self.ready_within
        if gate is Gate.OPEN:
            self._relay.forward(conn)
        else:
            self._relay.hold(conn, gate)
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
        self._loop.arm(self._listener, 0)
        if self._accept_at is None:
            self._accept_at = time.monotonic() + ACCEPT_PAUSE

    def _stuck(self) -> list[Conn]:
        """Clients accepted through an open gate, and not forwarded for want of a socket."""
        with self._relay.lock:
            if self._relay.gate is not Gate.OPEN:
                return []
            return [c for c in self._relay.conns if c.upstream is None]

    def _count_changed(self) -> None:
        now = time.monotonic()
        if now >= self._last_report + REPORT_EVERY:
            self._report_count(now)
        elif self._report_at is None:
            self._report_at = self._last_report + REPORT_EVERY

    def _report_count(self, now: float) -> None:
        self._report_at = None
        count = len(self._relay.conns)
        if count != self._reported:
            self._reported, self._last_report = count, now
            try:
                self._report(count)
            except Exception:
                pass  # for display only

    # -- waiting for the upstream after a restore ------------------------------------

    def _retry(self) -> None:
        if self.guard is not None:
            self.guard.forget()  # a connection failed: whose the port is, looked at anew
        with self._relay.lock:
            if self._relay.gate is Gate.OPENING:
                self._probe_at = time.monotonic() + PROBE_EVERY

    def _ready(self, sock: socket.socket | None) -> None:
        """The upstream is ready: open the gate; ``sock``, a connection to it, serves the
        first client."""
        if self._stranger() is not None:
            if sock is not None:
                sock.close()
            return
        with self._relay.lock:
            if self._relay.gate is not Gate.OPENING:
                if sock is not None:
                    sock.close()  # closed again meanwhile: the server is being released
                return
            self._relay.gate = Gate.OPEN
            waiting = [c for c in self._relay.conns if c.waiting]
            for c in waiting:
                c.parked = False
        held = [c for c in waiting if c.upstream is None]
        # A held client whose connection was reset meanwhile (serve cancelled its
        # request) could take no answer: its request is not passed on.
        for conn in [c for c in held if _reset(c.client)]:
            held.remove(conn)
            self._relay.drop(conn)
        for conn in waiting:
            if conn.upstream is not None:
                self._relay.rearm(conn)
        if held and sock is not None:
            self._relay.forward(held.pop(0), sock)
        elif sock is not None:
            sock.close()
        for conn in held:
            self._relay.forward(conn)

    def _stranger(self) -> str | None:
        """Why the upstream's port is not the command's (``Guard``), else None. Refused,
        the waiting clients are closed and the port looked at again later; each new
        reason said once, and noted for ``who``."""
        why = None if self.guard is None else self.guard.check()
        if why != self._refusal:
            self._refusal = why
            if why is not None:
                self._say(why)
            if self._note is not None:
                try:
                    self._note(why)
                except Exception:
                    pass  # for display only
        if why is not None:
            for conn in self._relay.waiting():
                self._relay.drop(conn)
            self._retry()
        return why

    def _not_ready(self) -> None:
        self._probe.stop()
        with self._relay.lock:
            self._probe_at = None
        waiting = self._relay.waiting()
        if not waiting:
            return  # nobody to tell: the next client starts another wait
        if self.ready_url is None:
            ready = "accept a connection"
        else:
            ready = f"answer GET {self.ready_url} with 2xx ({self._probe.answer or 'no answer'})"
        self._say(
            f"the upstream {show(self._probe.target[1])} did not {ready} within"
            f" {self.ready_within:g} s; closing {len(waiting)} waiting connection(s)"
        )
        for conn in waiting:
            self._relay.drop(conn)


def _reset(client: socket.socket) -> bool:
    """Was ``client``'s connection reset (its pending error, which this takes)?"""
    try:
        return client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
    except OSError:
        return True
