"""The models, as llama-swap lists them: ``GET /v1/models`` (and ``/models``),
``GET /v1/models/ID`` and ``GET /running``.

A listed entry has llama-swap's fields: ``created`` (here when serve started, so that
an entry reads the same each time), ``name`` and ``description``,
the fields its ``capabilities`` render to (``architecture``'s modalities,
``capabilities``' flags, ``supported_parameters``, ``context_length``), ``meta.llamaswap``
(the model's metadata, its type and aliases) and ``status.value``: ``loaded`` while the
model holds the GPU (what ``/running`` lists), else ``unloaded``. vramlock adds
``state``, the model's member state, and ``aliases``. Entries are sorted by id.
"""

from __future__ import annotations

import shlex
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ...arena.records import HOLDING
from .. import doors
from ..errors import error_response
from ..events import LLAMA_STATES, capabilities
from ..peers import entries
from . import Serving, get

if TYPE_CHECKING:
    from ..members import Wrapper

# Fields that a model's capabilities render; its metadata's keys of these names are
# dropped (llama-swap's rule).
_RENDERED = frozenset({"architecture", "capabilities", "supported_parameters", "context_length"})


def rendered(caps: dict[str, Any]) -> dict[str, Any]:
    """The /v1/models fields that ``caps`` (a model's ``capabilities``) render, as
    llama-swap renders them."""
    out: dict[str, Any] = {}
    ins, outs = (
        [m for m in caps.get(k) or () if isinstance(m, str)] for k in ("in", "out")
    )  # fmt: skip
    arch: dict[str, Any] = {}
    if ins:
        arch["input_modalities"] = ins
    if outs:
        arch["output_modalities"] = outs
    if ins and outs:
        arch["modality"] = "+".join(ins) + "->" + "+".join(outs)
    if arch:
        out["architecture"] = arch
    flags, context = capabilities(caps)
    if flags:
        out["capabilities"] = flags
    if caps.get("tools") is True:
        out["supported_parameters"] = ["tools", "tool_choice"]
    if context:
        out["context_length"] = context
    return out


class Models:
    """The handlers, reading ``s`` when asked."""

    def __init__(self, s: Serving) -> None:
        self.s = s
        self.created = int(time.time())  # every entry's: when serve started

    def loaded(self, name: str) -> bool:
        w = self.s.wrappers.get(name)
        return w is not None and w.state().value in HOLDING

    def entry(self, w: Wrapper, alias: str | None, created: int) -> dict[str, Any]:
        """A model's /v1/models entry (or its alias's, for includeAliasesInList)."""
        m = w.model
        entry: dict[str, Any] = {"id": alias or m.name, "object": "model", "created": created,
                                 "owned_by": "vramlock"}  # fmt: skip
        title = m.alias_names.get(alias, m.title) if alias else m.title
        if title and title.strip():
            entry["name"] = title.strip()
        if m.description and m.description.strip():
            entry["description"] = m.description.strip()
        shown = rendered(m.capabilities)
        entry.update(shown)
        meta = {k: v for k, v in m.metadata.items() if not (shown and k in _RENDERED)}
        aliases = m.listed_aliases()
        kind: dict[str, Any] = {"type": "alias", "modelID": m.name} if alias else {"type": "model"}
        if aliases and not alias:
            kind["aliases"] = aliases
        entry["meta"] = {"llamaswap": {**meta, **kind}}
        if "context_length" in shown:
            entry["meta"]["n_ctx"] = shown["context_length"]
        entry["aliases"] = aliases
        entry["state"] = w.state().value
        entry["status"] = {"value": "loaded" if w.state().value in HOLDING else "unloaded"}
        return entry

    def listed(self) -> list[dict[str, Any]]:
        """/v1/models's entries: models (and aliases), peers' models, selectors, the
        active profile's pins; sorted by id."""
        s, created = self.s, self.created
        data = []
        for w in s.wrappers.values():
            if not w.model.unlisted:
                data.append(self.entry(w, None, created))
                if s.config.aliases_listed:
                    data += [self.entry(w, a, created) for a in w.model.listed_aliases()]
        others = entries(s.config)
        others += s.resolver.entries({*s.config.known(), *(d["id"] for d in data)})
        for other in others:
            other["created"] = created
            other["status"] = {"value": self._status(other)}
        return sorted(data + others, key=lambda e: str(e["id"]))

    def _status(self, entry: dict[str, Any]) -> str:
        """A peer's model, a selector or a pin: a selector is loaded when a target it
        would take is (a pin's first, else any before the first loaded one)."""
        shown = entry.get("meta", {}).get("llamaswap", {})
        if shown.get("type") != "selector":
            return "unloaded"
        for target in shown.get("targets", ()):
            model = self.s.config.find(target)
            if model is not None and self.loaded(model.name):
                return "loaded"
            if shown.get("strategy") == "pin":
                break
        return "unloaded"

    async def list_models(self, request: web.Request) -> web.Response:
        out = web.json_response({"object": "list", "data": self.listed()})
        doors.allow_origin(request, out)
        return out

    async def one_model(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/models/ID: the entry /v1/models lists as ID (a peer's model
        and a selector too); else an unlisted model's or alias's."""
        name = request.match_info["model"]
        listed = next((e for e in self.listed() if e["id"] == name), None)
        if listed is not None:
            return web.json_response(listed)
        model = self.s.config.find(name)
        if model is None:
            return error_response(404, f"model {name!r} not found", models=self.s.config.known())
        w = self.s.wrappers[model.name]
        alias = None if name == model.name else name
        return web.json_response(self.entry(w, alias, self.created))

    async def running(self, request: web.Request) -> web.Response:
        """llama-swap's GET /running: the models that hold the GPU, in its states, with
        their command, proxy, ttl (seconds), name and description; sorted."""
        running = []
        for name in sorted(self.s.wrappers):
            w = self.s.wrappers[name]
            state = w.state()
            if state.value not in HOLDING:
                continue
            m = w.model
            running.append({
                "model": name, "state": LLAMA_STATES[state], "cmd": shlex.join(m.command),
                "proxy": f"http://{m.upstream}", "ttl": int(m.ttl), "name": m.title or "",
                "description": m.description or "",
            })  # fmt: skip
        return web.json_response({"running": running})


def register(app: web.Application, s: Serving) -> None:
    models = Models(s)
    get(app, "/v1/models", models.list_models)
    get(app, "/models", models.list_models)
    get(app, "/v1/models/{model:.+}", models.one_model)
    get(app, "/running", models.running)
