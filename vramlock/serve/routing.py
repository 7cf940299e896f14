"""llama-swap's routing: which models may be resident together, and whom serve releases
before a request's model is let in (``routing.router``, or the older top-level
``groups:`` and ``matrix:``), and the order queued requests are let in
(``routing.scheduler``).

- groups (``use: group``): a model is in one group at most; those in none make up a
  group of their own that swaps and is exclusive. Starting a model of a group that
  swaps releases the group's other models; one of an exclusive group releases the
  models of every other group, but those of persistent groups.
- matrix (``use: matrix``): named sets of models that may be resident together, each an
  expression of model names (or ``vars``) joined by ``&`` (together) and ``|`` (either),
  with ``()`` and ``+SET`` (another set's expression). Starting a model picks, among the
  sets' combinations that contain it, the one whose release costs least
  (``evict_costs``, 1 by default, summed over the resident models outside it; ties: the
  first defined), and releases the resident models outside it. A model in no set is
  resident alone.

Nothing is released for a request whose model is resident already.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_GROUP = "(default)"  # llama-swap's name for the models in no group


@dataclass(frozen=True)
class Group:
    name: str
    members: tuple[str, ...]
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False


@dataclass(frozen=True)
class Routing:
    """What the configuration says about routing; ``engine`` None: no rules (the
    arenas alone decide who is resident)."""

    engine: str | None = None
    groups: tuple[Group, ...] = ()
    sets: tuple[tuple[str, tuple[frozenset[str], ...]], ...] = ()  # matrix: by name, in order
    costs: dict[str, int] = field(default_factory=dict)  # matrix: evict_costs, by model
    priority: dict[str, int] = field(default_factory=dict)  # fifo: model -> priority
    line: int = 0  # where the rules are

    def evict(self, target: str, running: Iterable[str]) -> list[str]:
        """The resident models (``running``) to release before ``target`` starts:
        none when it is resident already."""
        resident = list(running)
        if self.engine is None or target in resident:
            return []
        return self._evict(target, resident)

    def _evict(self, target: str, resident: list[str]) -> list[str]:
        if self.engine == "group":
            return self._by_groups(target, resident)
        return self._by_matrix(target, resident)

    def _group(self, model: str) -> Group:
        found = next((g for g in self.groups if model in g.members), None)
        return found or Group(DEFAULT_GROUP, (model,))

    def _by_groups(self, target: str, resident: list[str]) -> list[str]:
        tg = self._group(target)
        out = []
        for m in resident:
            og = self._group(m)
            same = og.name == tg.name
            if (same and tg.swap) or (not same and tg.exclusive and not og.persistent):
                out.append(m)
        return out

    def _by_matrix(self, target: str, resident: list[str]) -> list[str]:
        best: frozenset[str] | None = None
        best_cost = 0
        for _, combos in self.sets:
            for combo in combos:
                if target not in combo:
                    continue
                cost = sum(self.costs.get(m, 1) for m in resident if m not in combo)
                if best is None or cost < best_cost:
                    best, best_cost = combo, cost
        return [m for m in resident if best is None or m not in best]

    def lane(self, model: str) -> str | None:
        """The group whose models take turns apart from the rest of their arena: a
        non-exclusive group's (llama-swap runs the models of two such groups side by
        side), else None (the arena's one turn). Only ``use: group`` has them."""
        if self.engine != "group":
            return None
        group = self._group(model)
        return None if group.exclusive else group.name

    def together(self, a: str, b: str) -> bool:
        """May ``a`` and ``b`` be resident together by the rules?"""
        if self.engine is None:
            return True
        return a not in self._evict(b, [a]) or b not in self._evict(a, [b])
