"""llama-swap's activity: each POST that serve passed to a model, once it was answered,
with its tokens and speeds (``GET /api/metrics/activity``, ``GET /api/metrics/stats``),
and its request and answer (``GET /api/captures/ID``, where ``captureBuffer`` allows).

Recording a request is cheap and bounded: an entry (the last ``metricsMaxInMemory``
are kept) with the last ``TAIL`` bytes of the answer's body, which are read for the
usage only when somebody asks (each entry once): the ``usage``, ``timings`` and
``metrics`` objects llama-server, vLLM and OpenAI-style servers put at the end of an
answer (the last event of a stream that has them). An answer whose usage lies further
from its end (a JSON answer of more than ``TAIL`` bytes with a long member after it)
is recorded without its tokens. A capture keeps references to the bodies serve held
anyway (a request's, an answer's), within ``captureBuffer`` MB in all, the oldest
dropped first; a capture larger than that is not kept.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from .config import DEFAULT_CAPTURE_MB, DEFAULT_KEEP
from .inflight import Headers, first, header_map, stamp

if TYPE_CHECKING:
    from .inflight import Flight

# How much of an answer's end is kept to find its usage in.
TAIL = 16 * 1024
# What a decompressed capture may grow to (a small gzip can claim gigabytes).
_INFLATED_MAX = 64 << 20
# The longest error message an entry says (longer ones end with "...").
_ERROR_MAX = 500
# What a capture keeps of the paths whose payloads are large and binary (the others'
# whole), as llama-swap's: the request's headers (RH) and body (RB), the answer's (AH, AB).
RH, RB, AH, AB = "req_headers", "req_body", "resp_headers", "resp_body"
_ALL = frozenset({RH, RB, AH, AB})
_CAPTURED = {
    "/v1/audio/speech": frozenset({RH, RB, AH}),
    "/v1/audio/voices": frozenset({RH, AH, AB}),
    "/v1/audio/transcriptions": frozenset({RH, AH, AB}),
    "/v1/images/generations": frozenset({RH, RB, AH}),
    "/v1/images/edits": frozenset({RH, AH}),
    "/sdapi/v1/txt2img": frozenset({RH, RB, AH}),
    "/sdapi/v1/img2img": frozenset({RH, AH}),
}
_USAGE_AT = ("usage", "response.usage", "message.usage")


@dataclass
class Usage:
    """An answer's tokens and speeds, in llama-swap's terms: -1 where a server that
    reports usage does not say (cached, drafted, speeds), 0 throughout where it reports
    none."""

    cached: int = 0
    drafted: int = 0
    accepted: int = 0
    input: int = 0
    output: int = 0
    prompt_speed: float = 0.0
    gen_speed: float = 0.0
    duration_ms: int = 0
    error: str = ""

    def tokens(self) -> dict[str, Any]:
        return {
            "cache_tokens": self.cached, "draft_tokens": self.drafted,
            "draft_acc_tokens": self.accepted, "input_tokens": self.input,
            "output_tokens": self.output, "prompt_per_second": self.prompt_speed,
            "tokens_per_second": self.gen_speed,
        }  # fmt: skip


class Done:
    """One request that was answered, as recorded: its usage is read from ``tail`` the
    first time it is asked for."""

    __slots__ = ("_usage", "headers", "id", "model", "path", "selector", "status", "tail",
                 "trimmed", "wall", "wall_ms")  # fmt: skip

    def __init__(self, id: int, flight: Flight, status: int) -> None:
        self.id, self.status = id, status
        self.wall = time.time()
        self.wall_ms = int((time.monotonic() - flight.began) * 1000)
        self.model, self.path, self.selector = flight.model, flight.path, flight.selector
        self.headers = flight.resp_headers
        parts, held = flight.parts, flight.held
        self.trimmed = flight.trimmed or held > TAIL
        self.tail: Sequence[bytes] | None = _last(parts, TAIL) if held > TAIL else parts
        self._usage: Usage | None = None

    def content_type(self) -> str:
        return first(self.headers, "content-type")

    def usage(self) -> Usage:
        if self._usage is None:
            self._usage = read_usage(self)
            self.tail = None  # read: no longer needed
        return self._usage

    def entry(self, captured: bool, priority: int) -> dict[str, Any]:
        """Its entry in llama-swap's shape (``captured``: its capture is still kept)."""
        usage = self.usage()
        out: dict[str, Any] = {
            "id": self.id, "timestamp": stamp(int(self.wall), "seconds"), "model": self.model,
            "req_path": self.path, "resp_content_type": self.content_type(),
            "resp_status_code": self.status, "tokens": usage.tokens(),
            "duration_ms": usage.duration_ms, "has_capture": captured,
        }  # fmt: skip
        if usage.error:
            out["error_msg"] = usage.error
        metadata = {"fifo_priority": str(priority)}
        if self.selector is not None:
            metadata["selector"] = self.selector
        out["metadata"] = metadata
        return out


# llama-swap's sortable columns (the API's names) and the entry's field each sorts by.
SORTS: dict[str, Callable[[Done], Any]] = {
    "id": lambda d: d.id,
    "time": lambda d: int(d.wall),
    "model": lambda d: d.model,
    "req_path": lambda d: d.path,
    "resp_status_code": lambda d: d.status,
    "resp_content_type": lambda d: d.content_type(),
    "cached": lambda d: d.usage().cached,
    "prompt": lambda d: d.usage().input,
    "generated": lambda d: d.usage().output,
    "drafted": lambda d: d.usage().drafted,
    "prompt_speed": lambda d: d.usage().prompt_speed,
    "gen_speed": lambda d: d.usage().gen_speed,
    "duration": lambda d: d.usage().duration_ms,
}


def _last(parts: Sequence[bytes], size: int) -> list[bytes]:
    """The last ``size`` bytes of ``parts``, copied from the last pieces only."""
    taken, n = [], 0
    for part in reversed(parts):
        taken.append(part)
        n += len(part)
        if n >= size:
            break
    return [b"".join(reversed(taken))[-size:]]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0


def _at(doc: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def _counts(usage: Any) -> tuple[int, int, int] | None:
    """(input, output, cached or -1) from a usage object, in whichever names it uses;
    None if it has none of them."""
    if not isinstance(usage, dict):
        return None
    found = False
    counts = []
    for names in (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens")):
        value = 0
        for name in names:
            if name in usage:
                value, found = int(_number(usage[name])), True
                break
        counts.append(value)
    cached = -1
    for path in ("cache_read_input_tokens", "input_tokens_details.cached_tokens",
                 "prompt_tokens_details.cached_tokens"):  # fmt: skip
        value = _at(usage, path)
        if value is not None:
            cached, found = int(_number(value)), True
            break
    return (counts[0], counts[1], cached) if found else None


def _build(wall_ms: int, input: int, output: int, cached: int, timings: Any, metrics: Any) -> Usage:
    """The usage llama-swap derives from token counts and the server's timings (which
    take precedence) or vLLM's metrics."""
    u = Usage(cached=cached, drafted=-1, accepted=-1, input=input, output=output,
              prompt_speed=-1.0, gen_speed=-1.0, duration_ms=wall_ms)  # fmt: skip
    if isinstance(timings, dict):
        u.input = int(_number(timings.get("prompt_n")))
        u.output = int(_number(timings.get("predicted_n")))
        u.prompt_speed = _number(timings.get("prompt_per_second"))
        u.gen_speed = _number(timings.get("predicted_per_second"))
        took = int(_number(timings.get("prompt_ms")) + _number(timings.get("predicted_ms")))
        u.duration_ms = max(u.duration_ms, took)
        if "cache_n" in timings:
            u.cached = int(_number(timings["cache_n"]))
        if "draft_n" in timings and "draft_n_accepted" in timings:
            u.drafted = int(_number(timings["draft_n"]))
            u.accepted = int(_number(timings["draft_n_accepted"]))
    if isinstance(metrics, dict):
        spec = metrics.get("speculative_decoding")
        if isinstance(spec, dict) and {"num_draft_tokens", "num_accepted_draft_tokens"} <= set(
            spec
        ):
            u.drafted = int(_number(spec["num_draft_tokens"]))
            u.accepted = int(_number(spec["num_accepted_draft_tokens"]))
        first_token = _number(metrics.get("time_to_first_token_ms"))
        if first_token > 0:
            u.prompt_speed = (u.input - max(u.cached, 0)) / (first_token / 1000)
        itl = _number(metrics.get("mean_itl_ms"))
        if itl > 0:
            u.gen_speed = 1000 / itl
    return u


def _objects(text: str, name: str) -> Iterator[Any]:
    """The JSON values of member ``name`` in ``text`` (a piece of JSON), last first."""
    decoder = json.JSONDecoder()
    mark = f'"{name}"'
    at = len(text)
    while (at := text.rfind(mark, 0, at)) >= 0:
        rest = text[at + len(mark) :].lstrip()
        if rest.startswith(":"):
            try:
                yield decoder.raw_decode(rest[1:].lstrip())[0]
            except ValueError:
                pass


def _stream(text: str, wall_ms: int) -> Usage | None:
    """The usage in an event stream's ``data:`` lines (what each last says)."""
    input = output = 0
    cached = -1
    timings = metrics = None
    seen = False
    for line in text.split("\n"):
        line = line.strip()
        if not line.startswith("data:"):
            continue
        try:
            doc = json.loads(line[5:])
        except (ValueError, RecursionError):
            continue  # [DONE], or the first line of a tail, cut
        for path in _USAGE_AT:
            counts = _counts(_at(doc, path))
            if counts is None:
                continue
            seen = True
            input = counts[0] if counts[0] > 0 else input
            output = counts[1] if counts[1] > 0 else output
            cached = counts[2] if counts[2] >= 0 else cached
        if isinstance(doc, dict):
            if "timings" in doc:
                timings, seen = doc["timings"], True
            if "metrics" in doc:
                metrics, seen = doc["metrics"], True
    return _build(wall_ms, input, output, cached, timings, metrics) if seen else None


def _json(text: str, whole: bool, path: str, wall_ms: int) -> Usage | None:
    """The usage of a JSON answer: parsed whole, or found in its tail."""
    if whole:
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            return None
        usage, timings, metrics = _at(doc, "usage"), _at(doc, "timings"), _at(doc, "metrics")
        if path.startswith("/infill") and isinstance(doc, list) and doc:
            timings = _at(doc[-1], "timings")  # infill answers a list: the last has them
    else:
        usage = next(_objects(text, "usage"), None)
        timings = next(_objects(text, "timings"), None)
        metrics = next(_objects(text, "metrics"), None)
    if usage is None and timings is None and metrics is None:
        return None
    input, output, cached = _counts(usage) or (0, 0, -1)
    return _build(wall_ms, input, output, cached, timings, metrics)


def _error(status: int, text: str | None) -> str:
    """What a failed answer says (its error's message), else its status's words."""
    if text is not None:
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None
        for path in ("error.message", "error", "message", "detail"):
            said = _at(doc, path)
            if isinstance(said, str) and said.strip():
                said = said.strip()
                return said[:_ERROR_MAX] + "..." if len(said) > _ERROR_MAX else said
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def _inflate(body: bytes, encoding: str) -> bytes | None:
    """``body`` decoded from gzip or deflate (None if it is not that); others as they are."""
    kind = encoding.strip().lower()
    if kind not in ("gzip", "deflate"):
        return body
    try:
        d = zlib.decompressobj(wbits=31 if kind == "gzip" else 15)
        out = d.decompress(body, _INFLATED_MAX)
        return out if d.eof else None
    except zlib.error:
        return None


def read_usage(done: Done) -> Usage:
    """The usage of an answer, from the end of its body that was kept."""
    body = b"".join(done.tail or ())
    wall = Usage(duration_ms=done.wall_ms)
    encoding = first(done.headers, "content-encoding")
    if encoding:
        inflated = None if done.trimmed else _inflate(body, encoding)
        if inflated is None:
            return wall  # a compressed piece cannot be read
        body = inflated
    text = body.decode("utf-8", "replace") if body else None
    if done.status == 0:
        return wall  # not answered: the client went away
    if done.status != 200:
        wall.error = _error(done.status, None if done.trimmed else text)
        return wall
    if not text:
        return wall
    if "text/event-stream" in done.content_type():
        found = _stream(text, done.wall_ms)
    else:
        found = _json(text, not done.trimmed, done.path, done.wall_ms)
    return found or wall


@dataclass
class Capture:
    """One request and its answer as a capture keeps them (None: left out)."""

    id: int
    path: str
    req_headers: Headers | None
    req_body: bytes | bytearray | None
    resp_headers: Headers | None
    resp_body: Sequence[bytes] | None
    size: int

    def doc(self) -> dict[str, Any]:
        """In llama-swap's shape: bodies in base64, the answer's decompressed (and then
        without its Content-Encoding)."""
        answer = header_map(self.resp_headers)
        body = None if self.resp_body is None else b"".join(self.resp_body)
        encoding = first(self.resp_headers, "content-encoding")
        if encoding and body is not None:
            inflated = _inflate(body, encoding)
            if inflated is not None:
                body = inflated
                if answer is not None:
                    answer.pop("Content-Encoding", None)
        elif answer is not None:
            answer.pop("Content-Encoding", None)

        def b64(data: bytes | bytearray | None) -> str | None:
            return None if data is None else base64.b64encode(bytes(data)).decode()

        return {
            "id": self.id, "req_path": self.path, "req_headers": header_map(self.req_headers),
            "req_body": b64(self.req_body), "resp_headers": answer, "resp_body": b64(body),
        }  # fmt: skip


class Activity:
    """The recorded requests (``keep`` at most) and their captures (``capture_bytes`` in
    all; 0: none). ``tell``, while set, gets each new entry's id."""

    def __init__(
        self,
        keep: int = DEFAULT_KEEP,
        capture_bytes: int = DEFAULT_CAPTURE_MB << 20,
        priority: Callable[[str], int] = lambda model: 0,
    ) -> None:
        self.done: deque[Done] = deque(maxlen=keep)
        self.capture_bytes = capture_bytes
        self.captures: OrderedDict[int, Capture] = OrderedDict()
        self.captured = 0  # bytes the captures hold
        self.priority = priority
        self.tell: Callable[[int], None] | None = None
        self._last = 0

    def resize(self, keep: int, capture_bytes: int) -> None:
        """New limits (a configuration read again): the oldest go first."""
        if keep != self.done.maxlen:
            self.done = deque(self.done, maxlen=keep)
        self.capture_bytes = capture_bytes
        self._fit(0)

    def keep_bytes(self) -> int:
        """How much of an answer's body a request in progress keeps."""
        return max(TAIL, self.capture_bytes)

    def record(self, flight: Flight, status: int) -> None:
        self._last += 1
        done = Done(self._last, flight, status)
        if self.capture_bytes:
            self._capture(done, flight)
        self.done.append(done)
        if self.tell is not None:
            self.tell(done.id)

    def _capture(self, done: Done, flight: Flight) -> None:
        parts = _CAPTURED.get(flight.path.partition("?")[0], _ALL)
        if done.status != 200:
            parts -= {AB}  # a failure's message is its entry's error_msg, as llama-swap's
        if AB in parts and flight.trimmed:
            return  # larger than the whole buffer: not kept, as llama-swap's
        req_body = flight.body if RB in parts else None
        resp_body = flight.parts if AB in parts else None
        size = 0 if req_body is None else len(req_body)
        size += 0 if resp_body is None else flight.held
        if size > self.capture_bytes:
            return
        self._fit(size)
        self.captures[done.id] = Capture(
            done.id, flight.path, flight.req_headers if RH in parts else None, req_body,
            flight.resp_headers if AH in parts else None, resp_body, size,
        )  # fmt: skip
        self.captured += size

    def _fit(self, size: int) -> None:
        """Drop the oldest captures until ``size`` more bytes fit."""
        while self.captures and self.captured + size > self.capture_bytes:
            _, dropped = self.captures.popitem(last=False)
            self.captured -= dropped.size

    def capture(self, id: int) -> dict[str, Any] | None:
        found = self.captures.get(id)
        return None if found is None else found.doc()

    def page(self, query: Query) -> dict[str, Any]:
        """``GET /api/metrics/activity``'s page for ``query``."""
        found = [d for d in self.done if query.matches(d)]
        found.sort(key=lambda d: d.id, reverse=query.order == "desc")
        if query.sort != "id":
            found.sort(key=SORTS[query.sort], reverse=query.order == "desc")
        total = len(found)
        start = (query.page - 1) * query.limit
        shown = found[start : start + query.limit]
        return {
            "data": [d.entry(d.id in self.captures, self.priority(d.model)) for d in shown],
            "page": query.page, "limit": query.limit, "total": total,
            "total_pages": -(-total // query.limit) if total else 0,
        }  # fmt: skip

    def stats(self, model: str = "") -> dict[str, Any]:
        """``GET /api/metrics/stats``: totals, and the speeds' histograms."""
        found = [d.usage() for d in self.done if not model or d.model == model]
        return {
            "total_requests": len(found),
            "total_input_tokens": sum(u.input for u in found),
            "total_output_tokens": sum(u.output for u in found),
            "total_cache_tokens": sum(u.cached for u in found if u.cached > 0),
            "prompt_histogram": histogram([u.prompt_speed for u in found if u.prompt_speed > 0]),
            "gen_histogram": histogram([u.gen_speed for u in found if u.gen_speed > 0]),
        }


def _percentile(values: list[float], p: float) -> float:
    """Of sorted ``values``, interpolated between the two nearest ranks."""
    rank = p / 100 * (len(values) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return values[low] + (rank - low) * (values[high] - values[low])


def histogram(values: list[float]) -> dict[str, Any] | None:
    """llama-swap's histogram of speeds: Sturges' number of bins (5 to 20), the range,
    and the 50th, 95th and 99th percentiles; None without values."""
    if not values:
        return None
    values = sorted(values)
    low, high = values[0], values[-1]
    marks = {"p50": _percentile(values, 50), "p95": _percentile(values, 95),
             "p99": _percentile(values, 99)}  # fmt: skip
    if low == high:
        return {"bins": [len(values)], "min": low, "max": high, "binSize": 0, **marks}
    count = min(20, max(5, math.ceil(math.log2(len(values))) + 1))
    size = (high - low) / count
    bins = [0] * count
    for value in values:
        bins[min(int((value - low) // size), count - 1)] += 1
    return {"bins": bins, "min": low, "max": high, "binSize": size, **marks}


_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})"
)  # fmt: skip


def rfc3339(text: str) -> float | None:
    """Seconds since the epoch of an RFC 3339 time (as Go's time.RFC3339 parses one);
    None if it is not one."""
    m = _RFC3339.fullmatch(text.strip())
    if not m:
        return None
    offset = "+00:00" if m.group(2) in ("Z", "z") else m.group(2)
    micro = ((m.group(1) or ".")[1:] + "000000")[:6]  # Python 3.10 takes 6 digits, or 3
    try:
        at = datetime.fromisoformat(f"{m.group(0)[:10]}T{m.group(0)[11:19]}.{micro}{offset}")
    except ValueError:
        return None
    return at.timestamp()


class Query:
    """``GET /api/metrics/activity``'s parameters, checked as llama-swap checks them."""

    def __init__(self, params: Any) -> None:
        """``params``: the request's query (a multidict); ValueError says what is wrong."""
        self.models = [m.strip() for m in params.getall("model", []) if m.strip()]
        self.start = self._time(params, "start")
        self.end = self._time(params, "end")
        if self.start is not None and self.end is not None and self.start > self.end:
            raise ValueError("start must be before end")
        self.min_id = self._id(params, "min_id")
        self.max_id = self._id(params, "max_id")
        if self.min_id and self.max_id and self.min_id > self.max_id:
            raise ValueError("min_id must be <= max_id")
        self.limit, self.page = 25, 1
        raw = params.get("limit", "").strip()
        if raw:
            try:
                self.limit = int(raw)
            except ValueError:
                raise ValueError("invalid limit") from None
            if not 0 < self.limit < 1000:
                raise ValueError("limit must be between 1 and 999")
        raw = params.get("page", "").strip()
        if raw:
            try:
                self.page = int(raw)
            except ValueError:
                self.page = 0
            if self.page < 1:
                raise ValueError("page must be >= 1")
        self.sort = params.get("sort", "").strip() or "id"
        if self.sort not in SORTS:
            raise ValueError("invalid sort column")
        self.order = params.get("order", "").strip().lower() or "desc"
        if self.order not in ("asc", "desc"):
            raise ValueError("order must be asc or desc")

    @staticmethod
    def _time(params: Any, name: str) -> int | None:
        raw = params.get(name, "").strip()
        if not raw:
            return None
        at = rfc3339(raw)
        if at is None:
            raise ValueError(f"invalid '{name}' timestamp, use RFC3339 format")
        return int(at)  # entries are kept to the second, as llama-swap's

    @staticmethod
    def _id(params: Any, name: str) -> int:
        raw = params.get(name, "").strip()
        if not raw:
            return 0
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{name} must be >= 1")
        return value

    def matches(self, d: Done) -> bool:
        second = int(d.wall)
        return (
            (not self.models or d.model in self.models)
            and (self.start is None or second >= self.start)
            and (self.end is None or second <= self.end)
            and (not self.min_id or d.id >= self.min_id)
            and (not self.max_id or d.id <= self.max_id)
        )
