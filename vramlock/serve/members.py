"""Each model's ``vramlock run`` wrapper: started, watched, asked to release, ended.

A model is a member of its arena exactly as ``vramlock run --demand listen`` makes one:
serve starts ``python -m vramlock run`` for it, and routes the model's requests to that
wrapper's listen address. Its state is read where ``vramlock who`` reads it (the kernel's
lock state and the members' records), by the wrapper's pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

from .. import procfs
from ..arena.asking import asking
from ..arena.budget import read_budget
from ..arena.directory import Arena, parse_gpus
from ..arena.member import TRANSITIONS
from ..arena.records import HOLDING, State
from ..arena.roster import Row, snapshot
from ..arena.units import claimed_units
from ..errors import InvalidTransition
from ..net.address import parse
from . import ending
from .config import Config, Model
from .logs import Logs, drain, read_pipe
from .passing import briefly

_PR_SET_PDEATHSIG = 1
_F_SETPIPE_SZ = 1031
_PIPE_SIZE = 1 << 20  # /proc/sys/fs/pipe-max-size's default
# When a wrapper cut a request, how long it may take to exit (then its status says why),
# and how long its server's checkEndpoint is given to say what it answers.
EXIT_WITHIN = 0.5
HEALTH_ASK_WITHIN = 2.0
# How much longer than unloadTimeout serve waits for a cmdStop's outcome (the wrapper
# runs it under unloadTimeout).
STOP_MARGIN = 2.0
# How often an unload looks whether the model it asked to step aside has.
ASK_POLL = 0.01
# A wrapper's strategy in ``who`` when ``auto`` found no way to release its command,
# or it was told to keep it (``release: none``): such a model is ended to unload it.
_CANNOT_RELEASE = ("auto:none", "none")
# When a wrapper exits unasked, serve says this many of its last lines of output (those
# of its latest start), unless logToStdout shows its output already.
EXIT_TAIL = 5
# What vramlock run's own exit statuses mean.
_EXIT_MEANING = {127: " (command not found)", 126: " (command not executable)"}

_STATES = {s.value: s for s in State}
# This serve, for ever (a pid and its start time): the first part of its models' markers.
_SERVE = f"{os.getpid()}.{procfs.starttime(os.getpid())}"


def follow(old: State, seen: State) -> list[State]:
    """The member's steps from ``old`` to ``seen`` by its transition table, fewest first:
    serve looks now and then, so the states between two looks go unseen.
    InvalidTransition when the table allows no way there."""
    paths: dict[State, list[State]] = {old: []}
    queue = [old]
    for state in queue:  # breadth first: queue grows as it is walked
        if state is seen:
            return paths[state]
        for nxt in sorted(TRANSITIONS[state], key=lambda s: s.value):
            if nxt not in paths:
                paths[nxt] = [*paths[state], nxt]
                queue.append(nxt)
    raise InvalidTransition(old.value, seen.value)


def _die_with_parent(parent: int) -> Callable[[], None]:
    """preexec_fn: SIGTERM when serve dies (even SIGKILLed), so the wrapper ends its
    command as on any ending signal; if serve is already gone, do not start at all."""
    # Looked up before the fork: the child of a threaded process must not dlopen.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _output_pipe() -> tuple[int, int]:
    """A pipe for a wrapper's output, (read end, write end), as large as the kernel lets
    anyone make one: a burst waits there, not in its writer, while serve is busy."""
    r, w = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_SIZE)
    return r, w


def _listener() -> socket.socket:
    """A loopback socket listening on a port of its own, for a wrapper's clients: serve
    keeps it for as long as it runs, so that no other program can take the port while
    the wrapper is not running (between two starts) and get the model's requests."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(socket.SOMAXCONN)
    return sock


@dataclasses.dataclass(frozen=True)
class Unloaded:
    """An unload's outcome: was the model resident and is it no longer; if it could not
    be unloaded, why."""

    released: bool
    failure: str | None = None


class Wrapper:
    """One model's ``vramlock run``: its listen port, its process, its requests."""

    def __init__(
        self,
        model: Model,
        config: Config,
        warn: Callable[[str], None],
        logs: Logs | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.warn = warn
        self.logs = logs  # None: the wrapper's output is serve's own (inherited)
        self.pipes: dict[int, bool] = {}  # its output's open read ends: on stderr?
        self.listener = _listener()
        self.port: int = self.listener.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None
        # Its requests and its ttl: changed through the methods below alone.
        self._in_flight = 0  # requests in its turn
        self._admitted = 0  # requests taken for it, waiting for its turn or in it
        self._ttl_timer: asyncio.TimerHandle | None = None
        self._unloading: asyncio.Task[Unloaded] | None = None
        self.exited: asyncio.Future[None] | None = None  # done once the wrapper exits
        self.shown = State.RELEASED  # the member's state as last seen
        self.ending = False  # serve ended the wrapper (its exit is no news)
        self.starts = 0  # how many times it was started: its marker's last part
        self.since = 0  # where its latest start's output begins in the model's log

    # -- its requests and its ttl ----------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests in its turn."""
        return self._in_flight

    @property
    def admitted(self) -> int:
        """Requests taken for it, waiting for its turn or in it."""
        return self._admitted

    def admit(self) -> None:
        """A request is taken for it (it waits for the model's turn)."""
        self._admitted += 1

    def unadmit(self) -> None:
        """A request taken for it gave up before its turn."""
        self._admitted -= 1

    def enter(self) -> None:
        """An admitted request is in the model's turn: no ttl runs meanwhile."""
        self._in_flight += 1
        self.disarm_ttl()

    def leave(self) -> None:
        """A request that entered has ended."""
        self._in_flight -= 1
        self._admitted -= 1

    def arm_ttl(self, expired: Callable[[Wrapper], object]) -> None:
        """Idle: ``expired(self)`` once its ttl passes with no request in its turn."""
        if self.model.ttl > 0 and self._in_flight == 0:
            self.disarm_ttl()
            loop = asyncio.get_running_loop()
            self._ttl_timer = loop.call_later(self.model.ttl, self._ttl_passed, expired)

    def _ttl_passed(self, expired: Callable[[Wrapper], object]) -> None:
        self._ttl_timer = None
        if self._in_flight == 0:
            expired(self)

    def disarm_ttl(self) -> None:
        if self._ttl_timer is not None:
            self._ttl_timer.cancel()
            self._ttl_timer = None

    def unload_soon(self) -> asyncio.Task[Unloaded]:
        """``unload_bounded``, as a task: the one under way if there is one."""
        if self._unloading is None or self._unloading.done():
            self._unloading = asyncio.get_running_loop().create_task(self.unload_bounded())
        return self._unloading

    @property
    def unloading(self) -> bool:
        """Is an unload of it under way?"""
        return self._unloading is not None and not self._unloading.done()

    async def unloaded(self) -> None:
        """Once the unload under way, if any, is over (a request that comes meanwhile
        goes to the model started afresh, not to what is being ended)."""
        if self._unloading is not None and not self._unloading.done():
            await asyncio.shield(self._unloading)

    def renew(self, config: Config, model: Model) -> None:
        """Its entry as a reloaded configuration gives it (its process unchanged)."""
        self.config, self.model = config, model

    @property
    def where(self) -> list[str]:
        """The arena options, as ``run`` and ``wait`` take them."""
        if self.model.arena is not None:
            return ["--arena", self.model.arena]
        return ["--gpu", self.model.gpu] if self.model.gpu is not None else []

    @property
    def ready_url(self) -> str | None:
        """checkEndpoint under the proxy URL's path; None ("none"): what ``run`` checks
        by itself (the engine's path where it knows the engine, else that it accepts)."""
        m = self.model
        return None if m.check_endpoint is None else m.prefix + m.check_endpoint

    def argv(self) -> list[str]:
        m = self.model
        args = [sys.executable, "-m", "vramlock", "run", "--name", m.name,
                "--demand", "listen", "--listen", f"fd:{self.listener.fileno()}",
                "--upstream", m.upstream,
                "--ready-within", f"{self.config.health_timeout:.3f}"]  # fmt: skip
        if self.ready_url is not None:
            args += ["--ready-url", self.ready_url]
        if m.stop_command is not None:
            # Stopping it is its release, within unloadTimeout (else run's 10 s).
            args += ["--on-release", m.stop_command]
            bound = self.unload_within
            if bound is not None and "--yield-within" not in m.run_options:
                args += ["--yield-within", f"{bound:.3f}"]
        return [*args, *m.run_options, *self.where, "--", *m.command]

    @property
    def unload_within(self) -> float | None:
        """unloadTimeout: the model's, else the top level's; None: none given."""
        return self.model.unload_timeout or self.config.unload_timeout

    @property
    def mark(self) -> str:
        """The marker in the environment of every process of the model's latest start:
        serve's pid and start time, the model, the start."""
        return f"{_SERVE}/{self.model.name}/{self.starts}"

    @property
    def end_within(self) -> float:
        """How long the model's processes get after SIGTERM: unloadTimeout, else 10 s."""
        bound = self.unload_within
        return ending.DEFAULT_GRACE if bound is None else bound

    def target(self, grace: float | None = None) -> ending.Target:
        """What ``ending.end`` ends of the model: its wrapper while it lives, and every
        process with its marker; SIGKILL after ``grace`` (None: ``end_within``)."""
        pid = self.proc.pid if self.proc is not None and self.alive() else None
        grace = self.end_within if grace is None else grace
        if self.model.stop_command is None:
            return ending.Target(self.model.name, pid, self.mark, grace)
        # Its wrapper ends it by cmdStop, within unloadTimeout: that is waited for.
        return ending.Target(self.model.name, pid, self.mark, grace + STOP_MARGIN, True)

    async def end(self, grace: float | None = None) -> str | None:
        """End the model as llama-swap does (SIGTERM, SIGKILL after ``grace``, None:
        ``end_within``): None once every process of it is gone, else why not (said)."""
        self.ending = True  # its exit is no news
        target = self.target(grace)
        why = (await briefly(lambda: ending.end([target])))[self.model.name]
        if why is not None:
            self.warn(f"model {self.model.name}: not ended: {why}")
            return why
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None  # ended on purpose: nothing to say when it starts again
        return None

    def info(self, message: str) -> None:
        """Say ``message`` about the model, at logLevel info (or debug)."""
        if self.config.log_level in ("debug", "info"):
            self.warn(f"model {self.model.name}: {message}")

    def start(self) -> None:
        """Start the wrapper (from serve's event loop), on serve's listening socket."""
        self.info("starting its wrapper")
        self.ending = False
        since = 0 if self.logs is None else self.logs.model(self.model.name).written
        self.since = since
        env = dict(os.environ)
        env.update(self.model.env)
        self.starts += 1
        env[ending.MARKER] = self.mark  # every process of this start carries it
        # Output pipes (stdout's, stderr's), read by serve; their read ends are held by
        # the drainer too (``drain``), which reads them once serve is gone.
        pipes = [_output_pipe(), _output_pipe()] if self.logs is not None else []
        out, err = (pipes[0][1], pipes[1][1]) if pipes else (None, None)
        # Its own session: Ctrl-C in serve's terminal reaches serve, which ends the
        # wrappers in order, not every wrapper at once.
        try:
            self.proc = subprocess.Popen(
                self.argv(),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=(self.listener.fileno(),),
                preexec_fn=_die_with_parent(os.getpid()),
            )
        except BaseException:
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            for _, w in pipes:
                os.close(w)
        if self.logs is not None:
            self.logs.hold([r for r, _ in pipes])
        for (r, _), is_err in zip(pipes, (False, True), strict=False):
            self._read_output(r, is_err)
        self.exited = _exit_of(self.proc)
        if self.exited is not None:
            proc = self.proc
            self.exited.add_done_callback(lambda _: _exited(self, proc, since))

    def _read_output(self, fd: int, is_err: bool) -> None:
        """The wrapper's output into serve's logs, read by the event loop as it comes."""
        logs = self.logs
        assert logs is not None
        self.pipes[fd] = is_err

        def got(data: bytes) -> None:
            logs.output(self.model.name, data, is_err)

        def ended() -> None:
            self.pipes.pop(fd, None)

        read_pipe(fd, got, ended)

    def drain_output(self) -> None:
        """Serve is ending: what the wrapper's pipes still hold, into the logs."""
        loop = asyncio.get_running_loop()
        for fd, is_err in list(self.pipes.items()):
            loop.remove_reader(fd)
            if self.logs is not None:
                drain(fd, functools.partial(self.logs.output, self.model.name, stderr=is_err))
            os.close(fd)
        self.pipes.clear()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> None:
        """Start the wrapper again if it ended (its server died, say): on demand, as
        llama-swap starts a model on a request. Clients may connect at once: the
        listening socket is serve's, they wait in its backlog."""
        if self.proc is not None and self.proc.poll() is not None:
            self.warn(f"model {self.model.name}: wrapper exited with status"
                      f" {self.proc.returncode}; starting it again")  # fmt: skip
        if not self.alive():
            self.start()

    async def cause(self, err: OSError) -> str:
        """Why the wrapper gave no answer, in words: its exit status (what 126 and 127
        mean), else what its server's checkEndpoint answers now, else ``err`` (these two
        said on serve's output too)."""
        proc = self.proc
        if proc is None:
            return (err.strerror or str(err)).lower()
        with contextlib.suppress(subprocess.TimeoutExpired):
            # A wrapper that cut the connection may be ending: its status says why.
            await briefly(lambda: proc.wait(EXIT_WITHIN))
        if not self.alive():
            # Said already, with its last output, as it exited (``_exited``); the client
            # gets that output too.
            code = proc.returncode
            said = f"its wrapper exited with status {code}{_EXIT_MEANING.get(code, '')}"
            tail = _last_lines(self, self.since)
            return f"{said}; its last output: {' | '.join(tail)}" if tail else said
        if self.ready_url is not None:
            found = await _health(self, self.ready_url, err)
        else:
            found = (err.strerror or str(err)).lower()
        # The wrapper says why on its own output, which logToStdout may keep from serve's.
        self.warn(f"model {self.model.name}: its server did not answer: {found}")
        return found

    def arena(self) -> Arena:
        gpus = parse_gpus(self.model.gpu) if self.model.gpu is not None else ()
        return Arena.open(self.model.arena, min(gpus) if gpus else None)

    def _row(self) -> Row | None:
        """The wrapper's row in ``vramlock who``; None before it joined."""
        assert self.proc is not None
        with contextlib.closing(self.arena()) as opened:
            return next((r for r in snapshot(opened) if r.pid == self.proc.pid), None)

    def member_state(self) -> str | None:
        """The wrapper's state as ``vramlock who`` shows it; None before it joined."""
        row = self._row()
        return None if row is None else row.state

    def holds_for_good(self) -> bool:
        """The wrapper holds the token alone and cannot release it: ``auto`` found no way
        (the arena has no budget, under which others could be resident beside it)."""
        if not self.alive():
            return False
        row = self._row()
        if row is None or row.state not in HOLDING or row.strategy not in _CANNOT_RELEASE:
            return False
        with contextlib.closing(self.arena()) as opened:
            return read_budget(opened) is None

    async def restart(self) -> None:
        """End the wrapper and its command, as llama-swap ends a model for another: it
        starts again on its next request."""
        await self.end()

    def state(self, rows: list[Row] | None = None) -> State:
        """The model's member state: its wrapper's, WAITING before the wrapper joined
        (it is about to queue for the token), RELEASED when no wrapper runs. Each change
        goes the member's way (``follow``). ``rows``: its arena's snapshot, taken
        already (``states``)."""
        if not self.alive():
            seen = State.RELEASED
        else:
            if rows is None:
                found = self.member_state()
            else:
                assert self.proc is not None
                found = next((r.state for r in rows if r.pid == self.proc.pid), None)
            seen = State.WAITING if found is None else _STATES.get(found, self.shown)
        follow(self.shown, seen)
        self.shown = seen
        return seen

    async def unload_bounded(self) -> Unloaded:
        """Release the model now, if it is resident, within its unloadTimeout, then stop
        it hard (end its command and wrapper: it starts again on its next request);
        without one, within healthCheckTimeout. A model that cannot release is ended at
        once, as llama-swap ends one: SIGTERM, SIGKILL after unloadTimeout (10 s)."""
        if not self.alive():
            return Unloaded(False)
        row = self._row()
        if row is None or row.state not in HOLDING:
            return Unloaded(False)
        if row.strategy in _CANNOT_RELEASE and self.model.stop_command is None:
            self.info(f"ending it (it cannot release; SIGKILL after {self.end_within:g} s)")
            return Unloaded(True, await self.end())
        bound = self.unload_within
        if bound is None:
            return Unloaded(await self.unload(self.config.health_timeout))
        # cmdStop runs in the wrapper under the same bound: its outcome is waited for.
        margin = STOP_MARGIN if self.model.stop_command is not None else 0.0
        if await self.unload(bound + margin) or not self.resident():
            return Unloaded(True)
        if self.model.stop_command is not None:
            # Its GPU process is no child of ours: killing the wrapper and cmd would give
            # the token up while it may still run. It keeps the token; run says why.
            why = f"cmdStop did not stop it within unloadTimeout, {bound:g} s; it keeps the GPU"
            self.warn(f"model {self.model.name}: {why}")
            return Unloaded(False, why)
        self.warn(f"model {self.model.name}: not released within unloadTimeout, {bound:g} s;"
                  " stopping it")  # fmt: skip
        return Unloaded(True, await self.end(0.0))

    def resident(self) -> bool:
        """Does the wrapper hold the token (or its units)?"""
        return self.alive() and self.member_state() in HOLDING

    async def unload(self, timeout: float) -> bool:
        """Release the model now, if it is resident; it stays released until a request
        comes. True if it held the token and gave it up within ``timeout``. In a budget
        arena the model alone is asked to step aside (the others stay resident); in
        any other, serve takes the token once as a waiter (``vramlock wait``)."""
        if not self.alive():
            return False
        row = self._row()
        if row is None or row.state not in HOLDING:
            return False
        if row.footprint is not None:  # a budget member: resident beside others
            with contextlib.closing(self.arena()) as opened:
                budget = read_budget(opened) is not None
            if budget:
                return await _ask_aside(self, timeout)
        waiter = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "vramlock", "wait", *self.where, "-w", f"{timeout:.3f}",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        code = await waiter.wait()
        if code != 0:
            self.warn(f"model {self.model.name}: unload: vramlock wait exited with status {code}")
        return code == 0

    def close(self) -> None:
        """Close serve's listening socket for the model (its wrapper ended first)."""
        self.listener.close()

    def stopping(self) -> None:
        """serve ends it: its exit is no news."""
        self.ending = True


def _exited(w: Wrapper, proc: subprocess.Popen[bytes], since: int) -> None:
    """The wrapper ``proc`` exited: unless serve ended it, say so with its status
    and, where serve's output does not show the model's, its last lines of output
    (``since``: where its latest start's output began in the model's log)."""
    if proc is not w.proc or w.ending:
        return
    meaning = _EXIT_MEANING.get(proc.returncode, "")
    said = f"model {w.model.name}: its wrapper exited with status {proc.returncode}{meaning}"
    tail = _last_lines(w, since)
    if tail is None:
        w.warn(said)
        return
    if not tail:
        w.warn(f"{said}; it wrote nothing")
        return
    w.warn(f"{said}; the end of its output (all of it: /logs/stream/{w.model.name}):")
    for line in tail:
        w.warn(f"model {w.model.name}: | {line}")


def _last_lines(w: Wrapper, since: int) -> list[str] | None:
    """The last ``EXIT_TAIL`` lines of output of the start whose output began at
    ``since`` in the model's log (what its pipes hold too); None where serve does not
    keep them (its output is serve's, or logToStdout shows it already)."""
    logs = w.logs
    if logs is None or logs.shows_output:
        return None
    for fd, is_err in list(w.pipes.items()):  # what the pipes hold already
        with contextlib.suppress(OSError):
            while data := os.read(fd, 1 << 16):
                logs.output(w.model.name, data, is_err)
    return logs.model(w.model.name).lines(EXIT_TAIL, since)


async def _health(w: Wrapper, path: str, err: OSError) -> str:
    """What ``GET path`` on the model's server answers now."""
    what = f"GET {path} on {w.model.upstream}"
    # The wrapper is alive, so it cut the request: its check had no 2xx in time.
    within = f"(no 2xx within healthCheckTimeout, {w.config.health_timeout:g} s)"
    try:
        line = await asyncio.wait_for(_ask(w, path), HEALTH_ASK_WITHIN)
    except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
        return f"{what} had no answer within {HEALTH_ASK_WITHIN:g} s {within}"
    except OSError as failed:
        # asyncio's "Connect call failed (...)" says less than the errno's words.
        reason = os.strerror(failed.errno) if failed.errno else str(failed)
        return f"{what}: {reason.lower()} {within}"
    parts = line.decode("latin-1").split()
    status = parts[1][:20] if len(parts) > 1 else "no status"
    if status.startswith("2"):
        return f"{what} answers {status} now; the request was cut: {err}"
    return f"{what} answered {status} {within}"


async def _ask(w: Wrapper, path: str) -> bytes:
    host, port = parse(w.model.upstream, "proxy")
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {w.model.upstream}\r\n"
                     "Connection: close\r\n\r\n".encode())  # fmt: skip
        return await reader.readline()
    finally:
        writer.close()


async def _ask_aside(w: Wrapper, timeout: float) -> bool:
    """Ask for the model's budget units until it has given them up (its minimum
    hold and yield_within honoured, as for any budget waiter); the units asked for
    follow its record (none while it gathers them, more once it grows), each probed:
    only a unit its wrapper holds the claim byte of is asked for, so that a record
    that lies never makes another resident step aside."""
    end = time.monotonic() + timeout
    asked: list[int] = []
    with contextlib.closing(w.arena()) as opened, contextlib.ExitStack() as asks:
        while (row := w._row() if w.alive() else None) and row.state in HOLDING:
            units = claimed_units(opened, row.pid, row.units or [])
            if units != asked:
                asks.close()
                asks.enter_context(asking(opened, units))
                asked = units
            if time.monotonic() >= end:
                w.warn(f"model {w.model.name}: unload: still resident after"
                          f" {timeout:g} s")  # fmt: skip
                return False
            await asyncio.sleep(ASK_POLL)
    return True


def _exit_of(proc: subprocess.Popen[bytes]) -> asyncio.Future[None] | None:
    """A future done once ``proc`` exits, from a pidfd watched by the event loop; None
    without pidfds (Linux before 5.3)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:
        return None

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        # Reaped at once (its pid then names nothing): a pidfd is readable once every
        # thread of the process has ended, when waitpid takes it, not before.
        proc.poll()
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, exited)
    return done


def states(wrappers: Iterable[Wrapper]) -> dict[str, State]:
    """Each model's ``Wrapper.state``, its arena read once for all of its models."""
    rows: dict[tuple[str | None, str | None], list[Row]] = {}
    found = {}
    for w in wrappers:
        where = (w.model.arena, w.model.gpu)
        if where not in rows and w.alive():
            with contextlib.closing(w.arena()) as opened:
                rows[where] = snapshot(opened)
        found[w.model.name] = w.state(rows.get(where))
    return found


def stop_all(wrappers: list[Wrapper]) -> None:
    """End every wrapper's model at once, as llama-swap ends one (SIGTERM to every
    process of it, SIGKILL after its unloadTimeout), and reap the wrappers."""
    for w in wrappers:
        w.stopping()
    targets = [w.target() for w in wrappers if w.proc is not None]
    for name, why in ending.end(targets).items():
        if why is not None:
            wrappers[0].warn(f"model {name}: not ended: {why}")
    for w in wrappers:
        if w.proc is not None and w.proc.poll() is None:
            w.proc.kill()  # its command is gone, or out of reach (said above)
            w.proc.wait()
