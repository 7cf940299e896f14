"""llama-swap's requests in progress ("inflight"): each request serve passes to a model,
from the moment it is routed until it is answered, and ``POST /api/inflight/ID/cancel``.

A request costs its entry and nothing more on its way (an object, a dict's slot): its
headers are kept as they came and made into llama-swap's shape only when somebody asks
(``/api/events``), and the updates are told only while somebody follows.

Cancelling a request ends it as llama-swap's cancelled request context does: its
connection to the model's wrapper is closed (the wrapper closes the server's, so the
server sees its client go), and its client gets a 502 while nothing of the answer has
been sent, else the answer's end where it stands (a chunked stream ends with its last
chunk; an answer of announced length is cut, as it cannot be finished).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

# What a request's client is answered once it is cancelled before any of its answer.
CANCELLED = "request cancelled"
# ... and once serve ends before its answer began (after a grace: .router).
ENDING = "serve is ending: the request was not answered"
# The headers llama-swap redacts where it shows them (lower case), and what it says instead.
SENSITIVE = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key"})
REDACTED = "[REDACTED]"
# The model endpoints whose POSTs llama-swap records as activity (JSON and form bodies),
# as a model's server gets them (/v/... and /audioapi/... without their prefix too): a
# POST elsewhere (a probe through /upstream) is forwarded, not recorded.
_JSON = ("/chat/completions", "/responses", "/completions", "/messages",
         "/messages/count_tokens", "/embeddings", "/rerank", "/reranking")  # fmt: skip
RECORDED = frozenset(
    {*_JSON, *(f"/v1{p}" for p in _JSON), "/infill", "/completion", "/v1/audio/speech",
     "/v1/images/generations", "/sdapi/v1/txt2img", "/sdapi/v1/img2img", "/v1/tasks/run",
     "/audioapi/v1/tasks/run", "/v1/audio/transcriptions", "/v1/images/edits"}
)  # fmt: skip
# What llama-swap tells in flight of a request through /upstream/MODEL/PATH: a POST to
# one of its model endpoints, a GET of one routed by ?model= (as the client names PATH).
_TOLD_POST = frozenset(
    {*(f"/v1{p}" for p in _JSON), *(f"/v{p}" for p in _JSON), "/rerank", "/reranking",
     "/infill", "/completion", "/v1/audio/speech", "/v1/audio/voices", "/v1/images/generations",
     "/sdapi/v1/txt2img", "/sdapi/v1/img2img", "/audioapi/v1/tasks/run",
     "/v1/audio/transcriptions", "/v1/images/edits"}
)  # fmt: skip
_TOLD_GET = frozenset({"/v1/audio/voices", "/sdapi/v1/loras", "/props"})


def dispatched(method: str, path: str) -> bool:
    """Is ``method path`` (after /upstream/MODEL) a request llama-swap tells in flight?"""
    bare = path.partition("?")[0]
    return bare in (_TOLD_POST if method == "POST" else _TOLD_GET if method == "GET" else ())


Headers = Iterable[tuple[str, str]]
Peer = Any  # a transport's "peername": (host, port, ...), or None


def uncancel() -> None:
    """The current task goes on after a cancel it took (on Python 3.11 and later, the
    task's count of cancels asked is put back, as ``asyncio.timeout`` expects)."""
    task = asyncio.current_task()
    undo = getattr(task, "uncancel", None)
    if undo is not None:
        undo()


def canonical(name: str) -> str:
    """A header's name as Go writes it (llama-swap's maps): ``Content-Type``."""
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def header_map(headers: Headers | None) -> dict[str, str] | None:
    """Headers as llama-swap shows them: each name's first value, the sensitive ones
    redacted; None for none at all."""
    if headers is None:
        return None
    out: dict[str, str] = {}
    for name, value in headers:
        key = canonical(name)
        if key not in out:
            out[key] = REDACTED if key.lower() in SENSITIVE else value
    return out


def first(headers: Headers | None, name: str) -> str:
    """The first value of header ``name`` (lower case), or ""."""
    for key, value in headers or ():
        if key.lower() == name:
            return value
    return ""


def stamp(wall: float, digits: str = "microseconds") -> str:
    """A time as Go's JSON writes one (RFC 3339, the local offset, ``Z`` for none)."""
    text = datetime.fromtimestamp(wall).astimezone().isoformat(timespec=digits)
    return text[:-6] + "Z" if text.endswith("+00:00") else text


class Flight:
    """One request in progress: what ``/api/events`` lists, and what its answer has been
    so far (kept for ``activity`` once it ends)."""

    __slots__ = (
        "began", "body", "cancelled", "held", "id", "keep", "method", "model", "on_cancel",
        "parts", "path", "peer", "req_headers", "resp_bytes", "resp_headers", "said", "selector",
        "status", "task", "told", "trimmed", "wall", "why",
    )  # fmt: skip

    def __init__(
        self,
        id: str,
        model: str,
        method: str,
        path: str,
        headers: Headers,
        peer: Peer,
        body: bytes | bytearray | None,
        keep: int,
    ) -> None:
        self.id, self.model, self.method, self.path = id, model, method, path
        self.req_headers, self.peer, self.body, self.keep = headers, peer, body, keep
        self.wall = time.time()
        self.began = time.monotonic()
        self.told = True  # in /api/events and the activity (a probe through /upstream: not)
        self.status = 0  # the answer's, once its head is sent
        self.resp_headers: Headers | None = None
        self.resp_bytes = 0
        self.parts: deque[bytes] = deque()  # the answer's body: its last ``keep`` bytes
        self.held = 0
        self.trimmed = False  # parts lost their beginning (the answer is over ``keep``)
        self.said = -1  # resp_bytes when the last update was told
        self.selector: str | None = None  # the selector whose name the request used
        self.task: asyncio.Task[Any] | None = None  # the task that serves it, to cancel
        self.on_cancel: Callable[[], None] | None = None  # where it has no task
        self.cancelled = False
        self.why: str | None = None  # why it was ended, where not by a cancel (ENDING)

    def refusal(self) -> tuple[int, str]:
        """What its client is answered once it was ended before any of its answer."""
        return (502, CANCELLED) if self.why is None else (503, self.why)

    def head(self, status: int, headers: Headers) -> None:
        """The answer's head was sent."""
        self.status, self.resp_headers = status, headers

    def took(self, chunk: bytes) -> None:
        """A piece of the answer's body was sent."""
        self.resp_bytes += len(chunk)
        self.parts.append(chunk)
        self.held += len(chunk)
        if self.held > self.keep:
            self._trim()

    def answered(self, status: int, headers: Headers, body: bytes) -> None:
        """The whole answer was sent at once."""
        self.head(status, headers)
        self.took(body)

    def _trim(self) -> None:
        """Down to the last ``keep`` bytes (the ones that may hold the usage)."""
        parts, held = self.parts, self.held
        while len(parts) > 1 and held - len(parts[0]) >= self.keep:
            held -= len(parts.popleft())
        if held > self.keep:
            parts[0] = parts[0][held - self.keep :]
            held = self.keep
        self.held, self.trimmed = held, True

    def cancel(self) -> None:
        """End it: its task is cancelled (or its ``on_cancel`` called, where it has none)."""
        if self.cancelled:
            return
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()
        elif self.on_cancel is not None:
            self.on_cancel()

    def remote_ip(self) -> str:
        """The client's address as llama-swap says it: X-Forwarded-For's first, else
        X-Real-IP, else the connection's."""
        forwarded = first(self.req_headers, "x-forwarded-for")
        if forwarded:
            return forwarded.split(",", 1)[0].strip()
        real = first(self.req_headers, "x-real-ip")
        if real:
            return real.strip()
        peer = self.peer
        if isinstance(peer, tuple) and peer:
            return str(peer[0])
        return "" if peer is None else str(peer)

    def line(self, shown: str, status: str) -> str:
        """Its line in serve's log once answered (``shown``: its method and path as the
        client asked, ``status``), as llama-swap's request log says it: the client, the
        request, the status, the answer's body size, the User-Agent, the time taken."""
        agent = first(self.req_headers, "user-agent")
        took = time.monotonic() - self.began
        return f'{self.remote_ip()} "{shown}" {status} {self.resp_bytes} "{agent}" {took:.3f} s'

    def entry(self) -> dict[str, Any]:
        """Its entry in llama-swap's shape."""
        self.said = self.resp_bytes
        return {
            "id": self.id, "timestamp": stamp(self.wall), "model": self.model,
            "req_path": self.path, "method": self.method,
            "req_headers": header_map(self.req_headers), "remote_ip": self.remote_ip(),
            "resp_headers": header_map(self.resp_headers) or {},
            "resp_bytes": self.resp_bytes,
            "elapsed_ms": int((time.monotonic() - self.began) * 1000),
        }  # fmt: skip


class Flights:
    """The requests in progress. ``tell``, while set (somebody follows ``/api/events``),
    gets each change in llama-swap's shape: ``{"operation": "upsert", "request": ENTRY}``
    or ``{"operation": "remove", "id": ID}``; ``record`` gets each POST that ended, with its
    status (the activity's record)."""

    def __init__(self, record: Callable[[Flight, int], None], keep: Callable[[], int]) -> None:
        self.now: dict[str, Flight] = {}
        self.record = record
        self.keep = keep  # how much of an answer's body to keep (a capture's most)
        self.tell: Callable[[dict[str, Any]], None] | None = None
        self._last = 0

    def start(
        self,
        model: str,
        method: str,
        path: str,
        headers: Headers,
        peer: Peer,
        body: bytes | bytearray | None,
        told: bool = True,
    ) -> Flight:
        """A request begins; ``told``: shown in /api/events (and its activity recorded),
        as llama-swap shows those to its model endpoints. Every one is here, for serve's
        end (``interrupt``)."""
        self._last += 1
        flight = Flight(str(self._last), model, method, path, headers, peer, body, self.keep())
        flight.told = told
        self.now[flight.id] = flight
        if self.tell is not None and told:
            self.tell({"operation": "upsert", "request": flight.entry()})
        return flight

    def started(self, flight: Flight) -> None:
        """``flight``'s answer began (its head): told at once."""
        if self.tell is not None and flight.told and flight.id in self.now:
            self.tell({"operation": "upsert", "request": flight.entry()})

    def end(self, flight: Flight, status: str) -> None:
        """``flight`` was answered (``status``: the HTTP status, or gone); its activity is
        recorded (a POST's to a model endpoint, as llama-swap records them)."""
        if self.now.pop(flight.id, None) is None or not flight.told:
            return
        if self.tell is not None:
            self.tell({"operation": "remove", "id": flight.id})
        if flight.method == "POST" and flight.path.partition("?")[0] in RECORDED:
            self.record(flight, int(status) if status.isdigit() else 0)

    def cancel(self, id: str) -> bool:
        """Cancel request ``id``; whether it is in progress."""
        flight = self.now.get(id)
        if flight is None or not flight.told:
            return False
        flight.cancel()
        return True

    def interrupt(self) -> None:
        """serve is ending: every request whose answer has not begun ends, its client
        told why (``ENDING``)."""
        for flight in list(self.now.values()):
            if flight.resp_headers is None:
                flight.why = ENDING
                flight.cancel()

    def snapshot(self) -> dict[str, Any]:
        """Every request in progress, oldest first."""
        flights = sorted((f for f in self.now.values() if f.told),
                         key=lambda f: (f.wall, int(f.id)))  # fmt: skip
        return {"operation": "snapshot", "requests": [f.entry() for f in flights]}

    def progress(self) -> None:
        """An update for each request whose answer grew since it was last told (called
        every 0.25 s while somebody follows, as llama-swap paces them)."""
        if self.tell is None:
            return
        for flight in list(self.now.values()):
            if flight.resp_bytes != flight.said and flight.said >= 0:
                self.tell({"operation": "upsert", "request": flight.entry()})
