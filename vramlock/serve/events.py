"""llama-swap's ``GET /api/events``: what its web page follows, as Server-Sent Events.

Every event is ``event:message`` with one ``data:`` line, a JSON envelope
``{"type": TYPE, "data": JSON}`` whose ``data`` is itself JSON, as a string:

- ``modelStatus``: every model (sorted by name) with its state in llama-swap's words
  (``LLAMA_STATES``), then each peer's models; at connect, then whenever it changes;
- ``logData``: ``{"source": "proxy"|"upstream", "data": TEXT}``, serve's own log and
  the models' output: their histories at connect, then each chunk as it comes;
- ``uiConfig``: the page's settings (the config's ``ui``: the request headers whose
  value names a session in the activity view), at connect;
- ``profileChanged``: ``{"active": NAME or null}``, at connect and when it changes;
- ``inflight``: the requests in progress (``inflight``): a snapshot at connect
  (``{"operation": "snapshot", "requests": [ENTRY...]}``), then each change
  (``{"operation": "upsert", "request": ENTRY}`` when one starts, when its answer begins
  and every ``POLL`` seconds while its answer grows; ``{"operation": "remove", "id": ID}``
  when it ends); a follower that falls ``BEHIND`` changes behind gets a snapshot instead;
- ``activity``: ``{"id": ID}``, each request recorded (``activity``) as it ends.

The models' states are the wrappers' members' (kept in the arenas, changed by the
wrappers, not by serve): they are looked at every ``POLL`` seconds while a client
follows, once for all clients, and at once when serve changes the active profile.
Looking is no activity: no model starts, none stays resident for it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..arena.records import State

if TYPE_CHECKING:
    from .activity import Activity
    from .config import Config
    from .inflight import Flights
    from .logs import Logs, Ring

POLL = 0.25
# A follower with more changes than this still to be sent gets a snapshot instead.
BEHIND = 1000

# llama-swap's process states (stopped, starting, ready, stopping; shutdown is never
# shown) for the members' states, by what a request finds: ``ready`` is served at once;
# ``starting`` waits for the token or a restore; ``stopping`` is giving the GPU up; and
# ``stopped`` holds none of it and is brought in by its next request. A released model
# is ``stopped`` even while its wrapper (and, by its strategy, its server) still runs:
# what it costs a request is a load, as a stopped llama-swap model's does, and a
# script that unloads a model and waits for ``stopped`` sees it.
LLAMA_STATES = {
    State.RELEASED: "stopped",
    State.WAITING: "starting",
    State.RESTORING: "starting",
    State.RESIDENT: "ready",
    State.RELEASING: "stopping",
}


def _json(value: object) -> str:
    """Compact JSON, as llama-swap writes it."""
    return json.dumps(value, separators=(",", ":"))


def capabilities(shown: dict[str, Any]) -> tuple[dict[str, bool], int]:
    """A model's ``capabilities`` (``in``, ``out``, ``tools``, ``reranker``,
    ``context``) as llama-swap renders them: the flags its page shows, and the
    context length (0: not given)."""

    def modalities(key: str) -> list[str]:
        value = shown.get(key)
        return [m for m in value if isinstance(m, str)] if isinstance(value, list) else []

    ins, outs = modalities("in"), modalities("out")
    flags = {
        "vision": "image" in ins,
        "audio_transcriptions": "audio" in ins and "text" in outs,
        "audio_speech": "text" in ins and "audio" in outs,
        "image_generation": "text" in ins and "image" in outs,
        "image_to_image": "image" in ins and "image" in outs,
        "function_calling": shown.get("tools") is True,
        "reranker": shown.get("reranker") is True,
    }
    context = shown.get("context")
    length = context if isinstance(context, int) and not isinstance(context, bool) else 0
    return {k: True for k, v in flags.items() if v}, max(length, 0)


def model_status(config: Config, states: dict[str, State]) -> list[dict[str, Any]]:
    """modelStatus's list: each model (sorted by name) in its state (``states``, by
    name), then each peer's models (``PEER/MODEL``, the other fields empty)."""
    models = []
    for name in sorted(config.models):
        m = config.models[name]
        entry: dict[str, Any] = {
            "id": name, "name": m.title or "", "description": m.description or "",
            "state": LLAMA_STATES[states.get(name, State.RELEASED)],
            "unlisted": m.unlisted, "peerID": "",
        }  # fmt: skip
        aliases = m.listed_aliases()
        if aliases:
            entry["aliases"] = aliases
        flags, context = capabilities(m.capabilities)
        if flags:
            entry["capabilities"] = flags
        if context:
            entry["context_length"] = context
        models.append(entry)
    for peer in sorted(config.peers.values(), key=lambda p: p.name):
        models += [{"id": f"{peer.name}/{model}", "name": "", "description": "", "state": "",
                    "unlisted": False, "peerID": peer.name} for model in peer.models]  # fmt: skip
    return models


class _Client:
    """One follower's events still to be sent: the latest of each state's type (a
    follower that falls behind gets the current state, not every step of it), and the
    changes (inflight, activity) in order."""

    def __init__(self) -> None:
        self.pending: dict[str, str] = {}
        self.changes: list[tuple[str, str]] = []
        self.woken = asyncio.Event()
        self.ended = False

    def put(self, kind: str, data: str) -> None:
        self.pending[kind] = data
        self.woken.set()

    def change(self, kind: str, data: str) -> None:
        self.changes.append((kind, data))
        self.woken.set()

    def end(self) -> None:
        self.ended = True
        self.woken.set()


class Events:
    """``GET /api/events``: ``models()`` (modelStatus's list) and ``active()`` (the
    active profile) looked at while anybody follows; ``logs``' proxy and upstream
    logs passed on; ``flights``' and ``activity``'s changes told while anybody follows."""

    def __init__(
        self,
        models: Callable[[], list[dict[str, Any]]],
        active: Callable[[], str | None],
        logs: Logs | None,
        flights: Flights,
        activity: Activity,
        ui: Callable[[], dict[str, Any]],
    ) -> None:
        self.models, self.active, self.logs, self.ui = models, active, logs, ui
        self.flights, self.activity = flights, activity
        self._clients: set[_Client] = set()
        self._last: dict[str, str] = {}
        self._poller: asyncio.Task[None] | None = None
        self._ended = False

    def check(self) -> None:
        """Look now: what changed goes to every follower."""
        found = {"profileChanged": _json({"active": self.active()})}
        with contextlib.suppress(OSError):  # an arena that cannot be read: next time
            found["modelStatus"] = _json(self.models())
        for kind, now in found.items():
            if self._last.get(kind) != now:
                self._last[kind] = now
                for client in self._clients:
                    client.put(kind, now)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL)
            self.check()
            self.flights.progress()

    def _change(self, kind: str, data: dict[str, Any]) -> None:
        """A change (``kind``: inflight or activity) to every follower."""
        said = _json(data)
        for client in self._clients:
            if len(client.changes) < BEHIND:
                client.change(kind, said)
            elif kind == "inflight":  # too far behind: where things stand instead
                client.changes = [c for c in client.changes if c[0] != "inflight"]
                client.change(kind, _json(self.flights.snapshot()))

    def _inflight(self, data: dict[str, Any]) -> None:
        self._change("inflight", data)

    def _activity(self, id: int) -> None:
        self._change("activity", {"id": id})

    def _follow(self) -> _Client:
        self.check()  # the others get what changed before; the newcomer starts from it
        client = _Client()
        if self._ended:
            client.end()
            return client
        self._clients.add(client)
        self.flights.tell, self.activity.tell = self._inflight, self._activity
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        return client

    def _unfollow(self, client: _Client) -> None:
        self._clients.discard(client)
        if not self._clients:
            self.flights.tell = self.activity.tell = None  # nobody to tell: no cost
            if self._poller is not None:
                self._poller.cancel()
                self._poller = None

    def end(self) -> None:
        """Serve is ending: every stream ends (and none starts)."""
        self._ended = True
        for client in list(self._clients):
            client.end()
            self._unfollow(client)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """The route: the current state, then what changes, until either side ends."""
        out = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff", "X-Accel-Buffering": "no"})  # fmt: skip
        if request.method == "HEAD":
            await out.prepare(request)
            return out
        # Followed before their histories are read: nothing falls between.
        rings: dict[str, Ring] = {}
        if self.logs is not None:
            rings = {"proxy": self.logs.proxy, "upstream": self.logs.upstream}
        one = _Stream(out, rings, self._follow())
        try:
            await out.prepare(request)
            await self._begin(one)
            await one.follow()
            await out.write_eof()
        except OSError:
            pass  # the client went away
        finally:
            one.close()
            self._unfollow(one.client)
        return out

    async def _begin(self, one: _Stream) -> None:
        """What a follower is told first, in llama-swap's order: the logs' histories,
        the models, the page's settings, the active profile, the requests in progress."""
        for source, ring in one.rings.items():
            said = one.text[source].decode(ring.history())
            await one.send("logData", _json({"source": source, "data": said}))
        if "modelStatus" in self._last:
            await one.send("modelStatus", self._last["modelStatus"])
        await one.send("uiConfig", _json(self.ui()))
        if "profileChanged" in self._last:
            await one.send("profileChanged", self._last["profileChanged"])
        # Where things stand now; the changes told before it are in it.
        snapshot = _json(self.flights.snapshot())
        one.client.changes = [c for c in one.client.changes if c[0] != "inflight"]
        await one.send("inflight", snapshot)


class _Stream:
    """One follower's stream: its response, the logs it follows and what it waits on."""

    def __init__(self, out: web.StreamResponse, rings: dict[str, Ring], client: _Client) -> None:
        self.out, self.rings, self.client = out, rings, client
        self.queues = {source: ring.follow() for source, ring in rings.items()}
        self.text = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in rings}
        self.waits: dict[asyncio.Future[Any], str | None] = {}

    async def send(self, kind: str, data: str) -> None:
        envelope = _json({"type": kind, "data": data})
        await self.out.write(f"event:message\ndata:{envelope}\n\n".encode())

    async def follow(self) -> None:
        """What changes, as it comes, until the client or serve ends."""
        client, waits = self.client, self.waits
        waits.update({asyncio.ensure_future(q.get()): s for s, q in self.queues.items()})
        waits[asyncio.ensure_future(client.woken.wait())] = None
        while not client.ended:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                following = waits.pop(task)
                if following is None:  # a model's state, the profile, or the end
                    client.woken.clear()
                    pending, client.pending = client.pending, {}
                    changes, client.changes = client.changes, []
                    for kind, data in [*pending.items(), *changes]:
                        await self.send(kind, data)
                    waits[asyncio.ensure_future(client.woken.wait())] = None
                    continue
                chunk = task.result()
                if chunk is None:  # the log ended: serve is ending
                    client.end()
                    break
                said = self.text[following].decode(chunk)
                if said:
                    await self.send("logData", _json({"source": following, "data": said}))
                waits[asyncio.ensure_future(self.queues[following].get())] = following

    def close(self) -> None:
        for task in self.waits:
            task.cancel()
        for source, q in self.queues.items():
            self.rings[source].unfollow(q)
