"""One registry of what a process exposes in Prometheus' text format: each source adds
a callable that gives its metric families when asked (the arenas', a server's requests),
and the registry renders them together, each family once (``prometheus.text``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .prometheus import Family, text

Source = Callable[[], Iterable[Family]]


class Registry:
    """The sources of one exposition, in the order they were added."""

    def __init__(self) -> None:
        self._sources: list[Source] = []

    def add(self, source: Source) -> None:
        self._sources.append(source)

    def collect(self) -> list[Family]:
        return [family for source in self._sources for family in source()]

    def text(self) -> str:
        """The exposition now. Blocking where a source is (an arena's reads): run it in
        a worker thread from an event loop."""
        return text(self.collect())
