"""serve's ``/metrics``: its arenas as ``vramlock stats --prometheus`` shows them, and
its requests by model and status (``/ui``, .api.page, shows the same).

Neither is activity: they read the arenas (the kernel's lock state, the records, the
journal) and serve's counters, and never reach a model's wrapper. A scrape starts no
model, keeps none resident, and does not count as a request for a ttl.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..arena.directory import parse_gpus
from ..observe.prometheus import Family, arena_families
from ..observe.registry import Registry
from .passing import briefly

if TYPE_CHECKING:
    from .members import Wrapper

# A request's seconds, from a resident model's milliseconds to a long generation that
# waited for a swap first.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0)  # fmt: skip
# The status of a request whose client went away before it was answered.
GONE = "gone"


@dataclass
class _Tally:
    buckets: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    count: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        at = bisect_left(BUCKETS, seconds)
        if at < len(BUCKETS):
            self.buckets[at] += 1
        self.count += 1
        self.seconds += seconds


class Requests:
    """serve's requests per model and status (an HTTP status, or ``GONE``): how many and
    how long, kept as counts (a histogram's buckets), not as a list of every request."""

    def __init__(self) -> None:
        self.tallies: dict[tuple[str, str], _Tally] = {}

    def add(self, model: str, status: str, seconds: float) -> None:
        self.tallies.setdefault((model, status), _Tally()).add(seconds)

    def of(self, model: str) -> dict[str, Any]:
        """One model's requests: by status, their number and their seconds in all."""
        mine = {s: t for (m, s), t in self.tallies.items() if m == model}
        return {
            "requests": sum(t.count for t in mine.values()),
            "seconds": sum(t.seconds for t in mine.values()),
            "by_status": {s: mine[s].count for s in sorted(mine)},
        }

    def families(self) -> list[Family]:
        counts: list[tuple[str, list[tuple[str, str]], float]] = []
        hist: list[tuple[str, list[tuple[str, str]], float]] = []
        for (model, status), t in sorted(self.tallies.items()):
            labels = [("model", model), ("status", status)]
            counts.append(("vramlock_serve_requests_total", labels, t.count))
            below = 0
            for bound, n in zip(BUCKETS, t.buckets, strict=True):
                below += n
                hist.append(("vramlock_serve_request_seconds_bucket",
                             [*labels, ("le", repr(bound))], below))  # fmt: skip
            hist += [
                ("vramlock_serve_request_seconds_bucket", [*labels, ("le", "+Inf")], t.count),
                ("vramlock_serve_request_seconds_sum", labels, t.seconds),
                ("vramlock_serve_request_seconds_count", labels, t.count),
            ]
        return [
            Family("vramlock_serve_requests_total", "counter",
                   "Requests serve passed to a model, by model and status.", counts),
            Family("vramlock_serve_request_seconds", "histogram",
                   "How long serve's requests took, by model and status.", hist),
        ]  # fmt: skip


def places(wrappers: Iterable[Wrapper]) -> dict[tuple[str | None, str | None], Wrapper]:
    """One wrapper per arena (and GPU) that serve's models live in."""
    found: dict[tuple[str | None, str | None], Wrapper] = {}
    for w in wrappers:
        found.setdefault((w.model.arena, w.model.gpu), w)
    return found


def gpu_of(w: Wrapper) -> int | None:
    gpus = parse_gpus(w.model.gpu) if w.model.gpu is not None else ()
    return min(gpus) if gpus else None


def registry(wrappers: dict[str, Wrapper], requests: Requests) -> Registry:
    """serve's exposition: its arenas (each sample labelled with its arena), then its
    requests."""

    def arenas() -> list[Family]:
        found: list[Family] = []
        for w in places(list(wrappers.values())).values():
            with contextlib.closing(w.arena()) as opened:
                found += arena_families(opened, gpu_of(w))
        return found

    out = Registry()
    out.add(arenas)
    out.add(requests.families)
    return out


async def metrics(registry: Registry) -> web.Response:
    body = await briefly(registry.text)
    return web.Response(text=body, content_type="text/plain", charset="utf-8",
                        headers={"Cache-Control": "no-store"})  # fmt: skip
