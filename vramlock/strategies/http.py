"""``http``: a server releases and restores its GPU memory through its own HTTP API.

    HttpStrategy      --on-release-url / --on-restore-url: a POST each, 2xx required
    └── Preset        one engine's API, at the address its command line gives
                      (presets.py: llama-server, vllm, sglang, comfyui, ollama)

Every request has a timeout and every failure (refused, no answer, a non-2xx status,
malformed JSON) becomes a one-line StrategyError: the runner keeps the GPU, warns, and
tries again. A failure because the server died is ChildExited instead; a release whose
requests and waits outlive --release-within is refused (NoAnswer), and one that outlives
--yield-within, when sooner, is ReleaseTimeout.

(Not ``http.py``: keeper.py runs as a script from this directory, where a sibling
named ``http`` would shadow the standard library's.)
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..errors import StrategyError
from ..net.address import Address, connect_host, server, split_url
from ..net.framing import Framing
from . import deadline as deadlines
from .base import (
    CLOSE_TO_EXIT,
    ChildExited,
    Context,
    Interrupted,
    ReleaseTimeout,
    Settings,
    Strategy,
)

# How long one request may take: queries answer at once; actions move memory (a vLLM
# sleep copies the weights to host memory, a slot save writes the KV cache to disk).
QUERY_TIMEOUT = 10.0
ACTION_TIMEOUT = 120.0
# How long a probe of a starting server may take (it is asked again).
PROBE_TIMEOUT = 1.0
# A request's waits are cut in slices this long, to see an order to end.
IO_SLICE = 0.1
# How often, and without --yield-within how long, a release polls for its effect.
POLL = 0.02
SETTLE_TIMEOUT = 120.0
# A reply larger than this is not one of the small JSON documents these APIs answer.
MAX_REPLY = 4 << 20


def parse_port(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 65536):
        raise StrategyError(f"{what}: bad port {text!r}")
    return int(text)


# -- the command line of a server ---------------------------------------------------------


def option(argv: list[str], *names: str) -> str | None:
    """The value of the last ``--name VALUE`` or ``--name=VALUE`` among ``argv``'s arguments."""
    found = None
    for i, arg in enumerate(argv[1:], 1):
        name, eq, value = arg.partition("=")
        if name in names:
            if eq:
                found = value
            elif i + 1 < len(argv):
                found = argv[i + 1]
    return found


def flag(argv: list[str], *names: str) -> bool:
    return any(arg.partition("=")[0] in names for arg in argv[1:])


def program(argv: list[str]) -> str:
    return os.path.basename(argv[0]) if argv else ""


def python_module(argv: list[str]) -> str | None:
    """``M`` for ``python [options] -m M ...``, else None."""
    if not re.fullmatch(r"python[0-9.]*", program(argv)):
        return None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None)
        if arg.startswith("-m"):
            return arg[2:]
        if arg in ("-W", "-X"):
            next(args, None)  # the option's value
        elif arg.startswith("-c") or not arg.startswith("-"):
            return None  # code or a script: no module
    return None


# -- the strategies ------------------------------------------------------------------------


def _reason(err: BaseException) -> str:
    """A failed connection in a few words."""
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, ConnectionResetError):  # closed before the answer was complete
        return "the connection was closed without an answer"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return str(err) or type(err).__name__


def _message(raw: bytes) -> str:
    """What a server's error answer says, on one short line."""
    text = raw.decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = str(err)
    text = " ".join(text.split())
    return "".join(c if c.isprintable() else "?" for c in text[:200]) or "(no message)"


class HttpStrategy(Strategy):
    """POST ``--on-release-url`` to release (2xx: the memory is free) and
    ``--on-restore-url`` to restore.

    The base of the presets too: ``free`` releases and ``take_back`` restores,
    through ``call``, ``get``, ``post`` and ``until``.
    """

    name = "http"

    def __init__(self, ctx: Context, settings: Settings) -> None:
        super().__init__(ctx, settings)
        self.headers: dict[str, str] = {}
        self._endings = ctx.endings
        self._within = deadlines.RELEASE_WITHIN
        self._within_end: float | None = None  # releasing: when --release-within runs out

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        for option_name, url in (
            ("--on-release-url", settings.on_release_url),
            ("--on-restore-url", settings.on_restore_url),
        ):
            if url is not None:
                split_url(url, option_name)

    def release(self, deadline: float | None) -> None:
        self._endings = self.ctx.endings  # an ending signal from now on interrupts the waits
        # Every request and wait of the release ends by --release-within (then NoAnswer:
        # refused), or --yield-within when sooner (ReleaseTimeout: the command ended).
        self._within = self.settings.release_within or deadlines.RELEASE_WITHIN
        self._within_end = time.monotonic() + self._within
        try:
            self.free(deadline)
        finally:
            self._within_end = None

    def _late(self) -> deadlines.NoAnswer:
        return deadlines.late(self.where, self.where, self._within)

    def _restore(self) -> None:
        self._endings = self.ctx.endings
        self.take_back()

    def free(self, deadline: float | None) -> None:
        """Release the memory; return once it is free."""
        assert self.settings.on_release_url is not None  # strategies.check made sure
        self._post_url(self.settings.on_release_url, deadline)

    def take_back(self) -> None:
        if self.settings.on_restore_url is not None:
            self._post_url(self.settings.on_restore_url, None)

    def _post_url(self, url: str, deadline: float | None) -> None:
        address, path = split_url(url, "URL")
        self.call("POST", path, deadline=deadline, limit=ACTION_TIMEOUT, at=address)

    # -- requests ---------------------------------------------------------------------------

    @property
    def where(self) -> str:
        """How error messages name the server."""
        return self.name

    def _exchange(
        self, method: str, path: str, body: object, end: float, at: Address
    ) -> tuple[int, bytes]:
        """One request on a fresh connection, answered by ``end`` (a monotonic time) or
        TimeoutError: every step gets only what is left, so a server that trickles its
        answer cannot stretch it. Interrupted when the wrapper is told to end; OSError
        for a failed connection or an answer that is not HTTP."""
        data = b"" if body is None else json.dumps(body).encode()
        headers = {"Host": str(Address(at.host, at.port)), "Connection": "close", **self.headers}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if body is not None or method == "POST":
            headers["Content-Length"] = str(len(data))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = f"{method} {at.prefix}{path} HTTP/1.1\r\n{head}\r\n".encode() + data
        reply = Framing(responses=True, methods=deque([method.encode()]), body=bytearray())
        with socket.create_connection((at.host, at.port), timeout=self._left(end)) as sock:
            sock.settimeout(self._left(end))
            sock.sendall(request)
            while not reply.done and len(reply.body or b"") <= MAX_REPLY:
                chunk = self._recv(sock, end)
                if not chunk:
                    reply.end()
                    break
                reply.feed(chunk)
                if reply.opaque:
                    raise OSError(0, "Not an HTTP answer")
        if not reply.done and len(reply.body or b"") <= MAX_REPLY:
            raise ConnectionResetError  # closed before the answer was complete
        return reply.status, bytes(reply.body or b"")[:MAX_REPLY]

    def _left(self, end: float) -> float:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def _recv(self, sock: socket.socket, end: float) -> bytes:
        """What ``sock`` has, waiting in slices to see an order to end."""
        while True:
            if self.ctx.endings != self._endings:
                raise Interrupted
            sock.settimeout(min(self._left(end), IO_SLICE))
            try:
                return sock.recv(1 << 16)
            except TimeoutError:
                continue

    def call(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        deadline: float | None,
        limit: float = QUERY_TIMEOUT,
        at: Address,
        accept: Callable[[int], bool] = lambda status: 200 <= status < 300,
    ) -> tuple[int, bytes]:
        """One request; (status, body) when ``accept(status)``, else StrategyError.

        The whole request takes ``limit`` seconds at most, and ends at ``deadline``
        (--yield-within), which is ReleaseTimeout. A failed connection to a command that
        has exited is ChildExited; an order to end, Interrupted.
        """
        now = time.monotonic()
        end = now + limit if self._within_end is None else self._within_end
        if deadline is not None:
            if deadline <= now:
                raise ReleaseTimeout
            end = min(end, deadline)
        what = f"{self.where}: {method} {at.prefix}{path}"
        try:
            status, raw = self._exchange(method, path, body, end, at)
        except TimeoutError:
            if deadline is not None and end == deadline:
                raise ReleaseTimeout from None
            if end == self._within_end:
                raise self._late() from None
            raise StrategyError(f"{what}: no complete answer within {limit:g} s") from None
        except OSError as err:
            # A server that dies under a request closes the connection just before it
            # can be reaped: give it a moment to be seen exiting.
            if self.ctx.child.wait(CLOSE_TO_EXIT) is not None:
                raise ChildExited from None
            raise StrategyError(f"{what}: {_reason(err)} (at {at})") from None
        if not accept(status):
            raise StrategyError(f"{what} answered {status}: {_message(raw)}")
        return status, raw

    def probe(self, path: str, at: Address) -> int | None:
        """GET ``path``'s status, or None while nothing answers (a server starting)."""
        try:
            return self._exchange("GET", path, None, time.monotonic() + PROBE_TIMEOUT, at)[0]
        except OSError:  # TimeoutError too
            return None

    def decode(self, raw: bytes, what: str) -> Any:
        try:
            return json.loads(raw)
        except ValueError:
            raise StrategyError(f"{self.where}: {what} answered with malformed JSON") from None

    def until(
        self, what: str, done: Callable[[], bool], deadline: float | None, limit: float
    ) -> None:
        """Poll ``done()`` until it is true. At ``deadline``, ReleaseTimeout; after
        ``limit`` seconds without a deadline, StrategyError saying ``what`` did not
        happen; Interrupted when the wrapper is told to end; ChildExited."""
        bound = time.monotonic() + limit if self._within_end is None else self._within_end
        end = bound if deadline is None else min(bound, deadline)
        while not done():
            if self.ctx.endings != self._endings:
                raise Interrupted
            if not self.ctx.child.alive:
                raise ChildExited
            left = end - time.monotonic()
            if left <= 0:
                if deadline is not None and end == deadline:
                    raise ReleaseTimeout
                if end == self._within_end:
                    raise self._late()
                raise StrategyError(f"{self.where}: {what} after {limit:g} s")
            time.sleep(min(POLL, left))


class Preset(HttpStrategy):
    """An engine's own API, at the address its command line (or ``--upstream``) gives."""

    engine: ClassVar[str]  # the --preset name
    default_port: ClassVar[int]
    # What answers 2xx once the server serves (--demand listen forwards from then on).
    ready_path: ClassVar[str] = "/health"
    # The options that run the engine over several GPU processes (``spreads``).
    parallel: ClassVar[tuple[str, ...]] = ()
    keeps_state = True

    def __init__(self, ctx: Context, settings: Settings) -> None:
        super().__init__(ctx, settings)
        argv, env = ctx.child.argv, ctx.child.env
        self.address = self.locate(argv, env, settings)
        key = self.api_key(argv, env)
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    @property
    def where(self) -> str:
        return self.engine

    @classmethod
    def identifies(cls, command: list[str]) -> bool:
        """Is ``command`` this engine's server, without doubt? (For ``auto``.)"""
        return False

    @classmethod
    def refusal(cls, command: list[str]) -> str | None:
        """Why the preset cannot work with the options on ``command``, or None."""
        return None

    @classmethod
    def finds_work(cls, ctx: Context) -> bool:
        return cls.recognises(ctx.child.argv)

    @classmethod
    def spreads(cls, command: list[str]) -> bool:
        """Does ``command`` run this engine over several GPU processes? Those share GPU
        memory through the legacy CUDA IPC API (NCCL, custom all-reduce), which memory
        the swap library makes cannot serve: ``auto`` keeps the library out. A
        configuration file may set the sizes: with one, assume it does."""
        if not cls.parallel or not cls.identifies(command):
            return False
        if option(command, "--config") is not None:
            return True
        sizes = (option(command, name) for name in cls.parallel)
        return any(size is not None and size.strip() != "1" for size in sizes)

    @classmethod
    def recognises(cls, command: list[str]) -> bool:
        return cls.identifies(command) and cls.refusal(command) is None

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        why = cls.refusal(command)
        if why is not None:
            raise StrategyError(f"--preset {cls.engine}: {why}")
        cls.locate(command, env, settings)

    @classmethod
    def locate(cls, argv: list[str], env: Mapping[str, str], settings: Settings) -> Address:
        """The server's address: ``--upstream`` if given, else from its command line."""
        if settings.upstream is not None:
            up = server(settings.upstream, "--upstream")
            return Address(up.host, up.port, cls.prefix(argv, env))
        return cls.listens(argv, env)

    @classmethod
    def prefix(cls, argv: list[str], env: Mapping[str, str]) -> str:
        """The path the server's API is under ("": the root)."""
        return ""

    @classmethod
    def listens(cls, argv: list[str], env: Mapping[str, str]) -> Address:
        """Where the server listens, by its ``--host`` and ``--port`` and their defaults."""
        port = option(argv, "--port")
        host = connect_host(option(argv, "--host") or "127.0.0.1")
        return Address(host, cls.port(port))

    @classmethod
    def port(cls, text: str | None) -> int:
        """The server's port from its option's value (None: the engine's default)."""
        return cls.default_port if text is None else parse_port(text, f"{cls.engine} --port")

    @classmethod
    def api_key(cls, argv: list[str], env: Mapping[str, str]) -> str | None:
        """The key the server wants as ``Authorization: Bearer``, if any."""
        key = option(argv, "--api-key")
        return key.split(",")[0].strip() if key else None

    def get(self, path: str, deadline: float | None) -> Any:
        """GET ``path``: its JSON."""
        _, raw = self.call("GET", path, deadline=deadline, at=self.address)
        return self.decode(raw, f"GET {path}")

    def post(
        self, path: str, body: object, deadline: float | None, limit: float = ACTION_TIMEOUT
    ) -> bytes:
        _, raw = self.call("POST", path, body, deadline=deadline, limit=limit, at=self.address)
        return raw
