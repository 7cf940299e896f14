"""llama-swap's ``profiles`` and ``selectors``: the name a request asks for, resolved.

First the active profile's pins (none is active at start; ``PUT /api/profiles/active``
switches, ``GET /api/profiles`` lists them): a pinned name becomes its target, or is
refused (404) while its pin is empty. Then a selector's strategy picks one target:

- ``pin``: always the first;
- ``warm``: the first resident target, else the first one starting (waiting or
  restoring), else the first (brought in);
- ``spillover``: the least busy active target (resident, starting, or with requests of
  the selector in progress) while every active one has fewer than ``spillover`` of
  them, else the first cold target, else the least busy active one.

Then a request is served by the chosen name as by any other (aliases, filters, peers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import Config, Selector

# What a local model's state is to a selector: its member state, None if no wrapper runs.
StateOf = Callable[[str], str | None]
_STARTING = ("waiting", "restoring")


class Refused(Exception):
    """The name cannot be served now: (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Resolver:
    """The active profile, and the spillover selectors' requests in progress."""

    def __init__(self, config: Config, state: StateOf) -> None:
        self.config = config
        self.state = state
        self.active: str | None = None
        self._busy: dict[tuple[str, str], int] = {}  # (selector, target) -> requests

    def set_active(self, name: str | None) -> None:
        """KeyError if there is no profile ``name``."""
        if name is not None and name not in self.config.profiles:
            raise KeyError(name)
        self.active = name

    def resolve(self, name: str) -> tuple[str, Callable[[], None]]:
        """The name to serve ``name`` by, and what to call once its request is done.
        Refused when the active profile disables ``name``."""
        profile = self.config.profiles.get(self.active or "")
        if profile is not None and name in profile.pins:
            target = profile.pins[name]
            if target is None:
                raise Refused(404, f"model {name!r} is disabled by profile {profile.name!r}")
            name = target
        selector = self.config.selectors.get(name)
        if selector is None:
            return name, _nothing
        if selector.strategy == "pin":
            return selector.targets[0], _nothing
        if selector.strategy == "warm":
            return self._warm(selector), _nothing
        return self._spillover(selector)

    def selector_of(self, name: str) -> str | None:
        """The selector a request for ``name`` reaches (itself, or through the active
        profile's pin), for its activity's ``selector``."""
        profile = self.config.profiles.get(self.active or "")
        if profile is not None and profile.pins.get(name):
            name = profile.pins[name] or name
        return name if name in self.config.selectors else None

    def pinned(self, path: str) -> tuple[str, str] | None:
        """``path`` (after /upstream/) with the longest of the active profile's pins it
        begins with replaced by that pin's model, as (model, the rest of the path).
        Refused when that pin disables its name."""
        profile = self.config.profiles.get(self.active or "")
        pins = [p for p in profile.pins if path.startswith(f"{p}/")] if profile else []
        if profile is None or not pins:
            return None
        pin = max(pins, key=len)
        target = profile.pins[pin]
        if target is None:
            raise Refused(404, f"model {pin!r} is disabled by profile {profile.name!r}")
        return target, path[len(pin) + 1 :]

    def _local(self, target: str) -> str | None:
        model = self.config.find(target)
        return None if model is None else self.state(model.name)

    def _warm(self, selector: Selector) -> str:
        states = [self._local(t) for t in selector.targets]
        for want in (("resident",), _STARTING):
            found = next(
                (t for t, s in zip(selector.targets, states, strict=True) if s in want), None
            )
            if found is not None:
                return found
        return selector.targets[0]

    def _spillover(self, selector: Selector) -> tuple[str, Callable[[], None]]:
        active, cold = [], []
        for target in selector.targets:
            busy = self._busy.get((selector.name, target), 0)
            local = self.config.find(target) is not None
            state = self._local(target) if local else None
            if state == "releasing" and not busy:
                continue
            if busy or state == "resident" or state in _STARTING:
                active.append(target)
            else:
                cold.append(target)
        if not active and not cold:
            raise Refused(503, f"selector {selector.name!r} has no available spillover targets")
        least = min((self._busy.get((selector.name, t), 0) for t in active), default=0)
        if cold and (not active or least >= selector.spillover):
            chosen = cold[0]
        else:
            chosen = next(t for t in active if self._busy.get((selector.name, t), 0) == least)
        key = (selector.name, chosen)
        self._busy[key] = self._busy.get(key, 0) + 1

        def done() -> None:
            self._busy[key] -= 1

        return chosen, done

    def profiles(self) -> dict[str, Any]:
        """GET /api/profiles's answer."""
        listed = [
            {"id": p.name, "description": p.description,
             "pins": {k: v or "" for k, v in p.pins.items()}}
            for p in sorted(self.config.profiles.values(), key=lambda p: p.name)
        ]  # fmt: skip
        return {"active": self.active, "profiles": listed}

    def entries(self, listed: set[str]) -> list[dict[str, Any]]:
        """The selectors' /v1/models entries, as llama-swap lists them, and the active
        profile's pins that no name in ``listed`` (or selector) already has."""
        out = []
        profile = self.config.profiles.get(self.active or "")
        for pin, target in profile.pins.items() if profile else ():
            if target and pin not in listed and pin not in self.config.selectors:
                meta = {"llamaswap": {"type": "profile"}}
                out.append({"id": pin, "object": "model", "owned_by": "vramlock", "meta": meta})
        for s in self.config.selectors.values():
            if s.unlisted:
                continue
            entry: dict[str, Any] = {"id": s.name, "object": "model", "owned_by": "vramlock"}
            if s.title is not None:
                entry["name"] = s.title
            if s.description is not None:
                entry["description"] = s.description
            kind: dict[str, Any] = {"type": "selector", "strategy": s.strategy,
                                    "targets": list(s.targets)}  # fmt: skip
            if s.strategy == "spillover":
                kind["spillover"] = s.spillover
            entry["meta"] = {"llamaswap": {**s.metadata, **kind}}
            out.append(entry)
        return out


def _nothing() -> None:
    pass
