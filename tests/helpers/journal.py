"""Journal events made by hand, for the stats and Prometheus tests."""

from __future__ import annotations

import os
import textwrap

from vramlock.arena.journal import Event

T0 = 1_700_000_000.0


def ev(at: float, pid: int, event: str, strategy: str = "swap", name: str = "") -> Event:
    return Event(time=T0 + at, mono=1000.0 + at, pid=pid, start=0, uid=os.geteuid(),
                 name=name or f"m{pid}", event=event, strategy=strategy, state=None,
                 bytes=None, trusted=True)  # fmt: skip


def handoff(at: float, out: int, into: int, release: float, restore: float) -> list[Event]:
    """``out`` releases (taking ``release`` s) and ``into`` restores (``restore`` s)."""
    return [
        ev(at, into, "want"),
        ev(at, out, "release-start"),
        ev(at + release, out, "release-end"),
        ev(at + release, into, "restore-start"),
        ev(at + release + restore, into, "restore-end"),
    ]


# A resident that yields once to a waiter, then comes back and leaves.
YIELD_ONCE = textwrap.dedent(
    """
    import sys, time
    import vramlock
    with vramlock.resident(sys.argv[1], name="first", min_hold=0) as me:
        print("resident", flush=True)
        while not me.wanted():
            time.sleep(0.001)
        me.yield_if_wanted(release=lambda: None, restore=lambda: None)
    """
)
