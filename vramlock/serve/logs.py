"""What ``vramlock serve`` and its models say: kept in memory, streamed, re-emitted.

As llama-swap keeps them: serve's own lines (``proxy``), every model's server output
(``upstream``, and one history per model), and the combined log (what ``logToStdout``
lets through to serve's output), each a bounded history of its last ``HISTORY`` bytes
(the oldest dropped) with live subscribers (``/logs/stream...``). A subscriber that
cannot keep up loses lines, told as ``— N bytes dropped —``; nobody waits for it.

The wrappers' output comes through pipes read by serve's event loop; what goes on to
serve's own standard output and error is written from the loop as far as they take it,
the rest kept in a bounded buffer (``Out``): a terminal or pipe that does not read
cannot block serve or a model's server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp.web_urldispatcher import UrlDispatcher

# llama-swap's monitors keep 100 KiB each.
HISTORY = 100 * 1024
# A subscriber gets this many writes behind, then loses the next ones.
BEHIND = 1024
# What serve's own output may have waiting to be written, then the oldest is dropped.
OUT_PENDING = 1 << 20
_READ = 64 * 1024
_PIPE_BUF = 4096

TO_STDOUT = ("proxy", "upstream", "both", "none")
# A wrapper's own lines on its standard error, and the longest kept while incomplete.
WRAPPER_PREFIX = b"vramlock: "
WRAPPER_LINE = 4096

# logTimeFormat: Go's time layouts by llama-swap's names, as strftime formats; %f is
# microseconds (Go's "nano" layouts: shown to the microsecond, what Python's clock has).
TIME_FORMATS = {
    "ansic": "%a %b %e %H:%M:%S %Y",
    "unixdate": "%a %b %e %H:%M:%S %Z %Y",
    "rubydate": "%a %b %d %H:%M:%S %z %Y",
    "rfc822": "%d %b %y %H:%M %Z",
    "rfc822z": "%d %b %y %H:%M %z",
    "rfc850": "%A, %d-%b-%y %H:%M:%S %Z",
    "rfc1123": "%a, %d %b %Y %H:%M:%S %Z",
    "rfc1123z": "%a, %d %b %Y %H:%M:%S %z",
    "rfc3339": "%Y-%m-%dT%H:%M:%S%:z",
    "rfc3339nano": "%Y-%m-%dT%H:%M:%S.%f%:z",
    "kitchen": "%-I:%M%p",
    "stamp": "%b %e %H:%M:%S",
    "stampmilli": "%b %e %H:%M:%S.%3",
    "stampmicro": "%b %e %H:%M:%S.%f",
    "stampnano": "%b %e %H:%M:%S.%f",
}


def stamp(fmt: str, now: float | None = None) -> str:
    """The local time ``now`` in ``fmt`` (one of TIME_FORMATS' values)."""
    t = datetime.fromtimestamp(time.time() if now is None else now).astimezone()
    offset = t.strftime("%z")
    colon = "Z" if offset == "+0000" else f"{offset[:3]}:{offset[3:]}"
    fmt = fmt.replace("%:z", colon).replace("%3", f"{t.microsecond // 1000:03d}")
    return t.strftime(fmt)


class Ring:
    """One log: its last ``limit`` bytes and the queues of those who follow it."""

    def __init__(self, limit: int = HISTORY) -> None:
        self.limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self.written = 0  # bytes ever written, for ``since``
        self._followers: dict[asyncio.Queue[bytes | None], list[int]] = {}

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.written += len(data)
        if len(data) >= self.limit:
            self._chunks.clear()
            self._size = 0
            data = data[-self.limit :]
        self._chunks.append(data)
        self._size += len(data)
        while self._size > self.limit:
            self._size -= len(self._chunks.popleft())
        for queue, dropped in self._followers.items():
            if dropped[0] and queue.qsize() < BEHIND - 1:
                queue.put_nowait(f"\n— {dropped[0]} bytes dropped —\n".encode())
                dropped[0] = 0
            if queue.full():
                dropped[0] += len(data)
            else:
                queue.put_nowait(data)

    def history(self) -> bytes:
        return b"".join(self._chunks)

    def lines(self, n: int, since: int = 0) -> list[str]:
        """The last ``n`` lines, as text, of what was written once ``written`` was
        ``since`` (as much of it as the history still holds)."""
        history = self.history()
        history = history[len(history) - min(len(history), self.written - since) :]
        text = history.decode(errors="replace")
        return text.splitlines()[-n:] if n > 0 else []

    def follow(self) -> asyncio.Queue[bytes | None]:
        """A queue of what is written from now on; None once the log is closed."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(BEHIND)
        self._followers[queue] = [0]
        return queue

    def unfollow(self, queue: asyncio.Queue[bytes | None]) -> None:
        self._followers.pop(queue, None)

    def close(self) -> None:
        """Tell every follower that the log ends (serve is ending)."""
        for queue in self._followers:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
            if queue.full():  # the end must get through: the oldest waiting write goes
                queue.get_nowait()
                queue.put_nowait(None)
        self._followers.clear()


class Out:
    """Serve's standard output or error, written from the event loop, never blocking it:
    only while the file takes more (``poll``), ``PIPE_BUF`` bytes at a time (a pipe that
    polls writable takes that much whole), the rest kept in a bounded buffer (the oldest
    dropped past ``OUT_PENDING``) and tried again every ``RETRY`` seconds. No thread: a
    thread of serve's would make the kernel send the wrappers their parent-death
    signal once more as it ends (PR_SET_PDEATHSIG follows threads), in the middle of
    their cleanup."""

    RETRY = 0.01

    def __init__(self, fd: int, limit: int = OUT_PENDING) -> None:
        self.fd, self.limit = fd, limit
        self._pending: deque[bytes] = deque()
        self._size = 0
        self._later: asyncio.TimerHandle | None = None
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)

    def write(self, data: bytes) -> None:
        self._pending.append(data)
        self._size += len(data)
        while self._size > self.limit and len(self._pending) > 1:
            self._size -= len(self._pending.popleft())
        if self._later is None:
            self.flush()

    def flush(self, wait_ms: int = 0) -> bool:
        """Write what the file takes now (waiting up to ``wait_ms`` for it each time);
        True once nothing is left."""
        self._later = None
        while self._pending:
            if not any(ev & select.POLLOUT for _, ev in self._poll.poll(wait_ms)):
                break
            data = self._pending.popleft()
            self._size -= len(data)
            try:
                done = os.write(self.fd, data[:_PIPE_BUF])
            except OSError:
                self._pending.clear()  # closed or broken: what was to go there is lost
                self._size = 0
                break
            if done < len(data):
                self._pending.appendleft(data[done:])
                self._size += len(data) - done
        if self._pending:
            with contextlib.suppress(RuntimeError):  # no loop (serve is ending)
                self._later = asyncio.get_running_loop().call_later(self.RETRY, self.flush)
        return not self._pending

    def close(self, within: float = 2.0) -> None:
        """Write what is pending, for up to ``within`` seconds."""
        if self._later is not None:
            self._later.cancel()
        end = time.monotonic() + within
        while not self.flush(50) and time.monotonic() < end:
            pass


class Logs:
    """serve's logs: ``proxy`` (its own lines), ``upstream`` (every model's output), one
    per model, and ``mux`` (what ``to_stdout`` sends to serve's output)."""

    def __init__(
        self,
        to_stdout: str,
        time_format: str | None,
        say: Callable[[str], None],
        out: Out | None = None,
        err: Out | None = None,
        hold: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.to_stdout = to_stdout
        self.time_format = time_format
        self._say = say  # serve's own lines on its output (stderr, vramlock's way)
        self.proxy, self.upstream, self.mux = Ring(), Ring(), Ring()
        self._partial: dict[str, bytes] = {}  # a model's stderr line not yet ended
        self.models: dict[str, Ring] = {}
        self._out, self._err = out, err
        self._hold = hold

    def hold(self, fds: list[int]) -> None:
        """Read ends of a wrapper's output pipes, for the drainer to hold (``drain``)."""
        if self._hold is not None:
            self._hold(fds)

    def configure(self, to_stdout: str, time_format: str | None) -> None:
        self.to_stdout, self.time_format = to_stdout, time_format

    def say(self, message: str) -> None:
        """One line of serve's own: in ``proxy``; on serve's output (and in ``mux``)
        unless ``logToStdout`` leaves the proxy's lines out."""
        when = f"{stamp(self.time_format)} " if self.time_format else ""
        line = f"{when}[INFO] {message}\n".encode(errors="replace")
        self.proxy.write(line)
        if self.to_stdout in ("proxy", "both"):
            self.mux.write(line)
            self._say(f"{when}{message}")

    def model(self, name: str) -> Ring:
        return self.models.setdefault(name, Ring())

    @property
    def shows_output(self) -> bool:
        """Do the models' outputs reach serve's own (``logToStdout``)?"""
        return self.to_stdout in ("upstream", "both")

    def output(self, name: str, data: bytes, stderr: bool) -> None:
        """What model ``name``'s wrapper wrote (``stderr``: on its standard error)."""
        self.model(name).write(data)
        self.upstream.write(data)
        if self.shows_output:
            self.mux.write(data)
            out = self._err if stderr else self._out
            if out is not None:
                out.write(data)
        elif stderr:
            self._wrapper_lines(name, data)

    def _wrapper_lines(self, name: str, data: bytes) -> None:
        """The wrapper's own lines (``vramlock: ...``: why a release failed, why it holds
        the GPU) are vramlock's, not the server's: among serve's lines, whatever
        ``logToStdout`` keeps of the models' output."""
        pending = self._partial.get(name, b"") + data
        *lines, rest = pending.split(b"\n")
        self._partial[name] = rest[-WRAPPER_LINE:]
        for line in lines:
            if line.startswith(WRAPPER_PREFIX):
                text = line[len(WRAPPER_PREFIX) :].decode(errors="replace")
                self.say(f"model {name}: {text}")

    def end_streams(self) -> None:
        """Serve is ending: every /logs/stream ends."""
        for ring in (self.proxy, self.upstream, self.mux, *self.models.values()):
            ring.close()

    def close(self) -> None:
        """Write what is pending to serve's output."""
        for out in (self._out, self._err):
            if out is not None:
                out.close()


def read_pipe(fd: int, got: Callable[[bytes], None], ended: Callable[[], None]) -> None:
    """Read the pipe ``fd`` from the running event loop, each chunk to ``got``, until
    its end; then stop watching it, close it and call ``ended``."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            got(data)
            return
        loop.remove_reader(fd)
        os.close(fd)
        ended()

    loop.add_reader(fd, readable)


def drain(fd: int, got: Callable[[bytes], None]) -> None:
    """What the pipe ``fd`` holds now, to ``got`` (serve is ending: no loop reads it)."""
    with contextlib.suppress(OSError):
        while data := os.read(fd, _READ):
            got(data)


def add_routes(router: UrlDispatcher, logs: Logs, find: Callable[[str], str | None]) -> None:
    """llama-swap's GET /logs (the combined history, text) and GET /logs/stream[/ID]
    (ID: proxy, upstream or a model's name or alias; none: the combined log): the
    history (unless ``?no-history``), then each line as it comes, until serve ends.
    ``find`` gives the model's name for a name or alias (None: no such model)."""
    from aiohttp import web

    from .errors import error_response

    async def history(request: web.Request) -> web.Response:
        if "text/html" in request.headers.get("Accept", ""):
            raise web.HTTPFound("/ui/")  # a browser: the page, which shows the log too
        return web.Response(body=logs.mux.history(), content_type="text/plain")

    def ring(which: str) -> Ring | None:
        if which in ("", "proxy", "upstream"):
            return {"": logs.mux, "proxy": logs.proxy, "upstream": logs.upstream}[which]
        name = find(which)
        return None if name is None else logs.model(name)

    async def stream(request: web.Request) -> web.StreamResponse:
        which = request.match_info.get("which", "")
        found = ring(which)
        if found is None:
            return error_response(400, "invalid logger. Use 'proxy', 'upstream' or a model's ID")
        out = web.StreamResponse(headers={"X-Content-Type-Options": "nosniff",
                                          "X-Accel-Buffering": "no"})  # fmt: skip
        out.content_type = "text/plain"
        out.enable_chunked_encoding()
        queue = found.follow()  # before the history is sent: nothing falls between
        try:
            await out.prepare(request)
            past = found.history()
            if "no-history" not in request.query and past:
                await out.write(past)
            while (data := await queue.get()) is not None:
                await out.write(data)
            await out.write_eof()
        except OSError:
            pass  # the client went away
        finally:
            found.unfollow(queue)
        return out

    router.add_get("/logs", history)
    router.add_get("/logs/stream", stream)
    router.add_get("/logs/stream/{which:.+}", stream)
