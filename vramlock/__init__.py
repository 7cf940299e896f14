"""vramlock: time-share one GPU between always-loaded programs with kernel file locks.

The public API is loaded lazily so that ``vramlock who`` and ``vramlock.child``
stay cheap to import.
"""

from __future__ import annotations

__version__ = "0.1.0"

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import Any

    from .arena.directory import Arena
    from .arena.member import Member, resident
    from .arena.records import State
    from .errors import ArenaError, NotObtained, VramlockError

__all__ = ["Arena", "ArenaError", "Member", "NotObtained", "State", "VramlockError", "resident"]

_WHERE = {
    "Arena": "arena.directory",
    "ArenaError": "errors",
    "NotObtained": "errors",
    "VramlockError": "errors",
    "Member": "arena.member",
    "State": "arena.records",
    "resident": "arena.member",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
