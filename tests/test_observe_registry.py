"""observe's registry: the sources of one exposition, rendered together, each family
under one HELP and TYPE however many sources give samples of it."""

from __future__ import annotations

from vramlock.observe.prometheus import Family
from vramlock.observe.registry import Registry


def test_sources_are_asked_when_rendered_and_families_merged() -> None:
    asked = []

    def arena(name: str) -> list[Family]:
        asked.append(name)
        return [Family("vramlock_members", "gauge", "Members.", [
            ("vramlock_members", [("arena", name)], 1.0)])]  # fmt: skip

    registry = Registry()
    registry.add(lambda: arena("a"))
    registry.add(lambda: arena("b"))
    assert asked == []  # nothing is read until the exposition is asked for
    text = registry.text()
    assert asked == ["a", "b"]
    assert text.count("# TYPE vramlock_members gauge") == 1
    assert 'vramlock_members{arena="a"} 1' in text and 'vramlock_members{arena="b"} 1' in text
