"""A model ended as llama-swap ends one: SIGTERM to every process of it, SIGKILL after
unloadTimeout (10 s unless the configuration says); ended once every one is gone and,
where NVML answers, none of them holds GPU memory.

A model's processes are its wrapper (``vramlock run``), whatever descends from it (the
wrapper adopts orphans, so a daemon that left its command's process group and session
is still a descendant while the wrapper lives), and every process whose environment
carries the model's marker (serve puts it in the wrapper's, and the command inherits
it): a daemon whose wrapper is gone already is found by it. A setuid program among
them is found (as a descendant) but cannot be signalled: the ending fails and says so.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import procfs

MARKER = "VRAMLOCK_SERVE_MODEL"
# llama-swap's unloadTimeout when its configuration gives none.
DEFAULT_GRACE = 10.0
# How long SIGKILLed processes get to be gone, and their GPU memory to be given back.
KILL_WAIT = 5.0
MEMORY_WAIT = 5.0
POLL = 0.01


@dataclass
class Target:
    """One model to end: its wrapper's pid (None: it has exited), its marker, and how
    long its processes get after SIGTERM."""

    name: str
    wrapper: int | None
    mark: str
    grace: float
    by_wrapper: bool = False  # SIGTERM to its wrapper alone, which ends it (cmdStop)
    seen: dict[int, int] = field(default_factory=dict)  # pid: start time
    refused: set[int] = field(default_factory=set)  # not ours to signal

    def find(self) -> list[int]:
        """Its living processes now, the wrapper first (parents before children)."""
        found: list[int] = []
        if self.wrapper is not None and procfs.living(self.wrapper):
            found = [self.wrapper, *(p for p in procfs.descendants(self.wrapper)
                                     if procfs.living(p))]  # fmt: skip
        found += [p for p in procfs.marked(MARKER, self.mark) if p not in found]
        for pid in found:
            start = procfs.starttime(pid)
            if start is not None:
                self.seen.setdefault(pid, start)
        return found

    def left(self) -> list[int]:
        """Those of the processes seen so far that still live (cheap: no scan)."""
        return [p for p, start in self.seen.items() if not procfs.ended(p, start)]

    def signal(self, pids: Iterable[int], sig: int) -> None:
        for pid in reversed(list(pids)):  # children before parents: the wrapper last
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                self.refused.add(pid)


def _wait(targets: list[Target], until: dict[str, float]) -> None:
    """Until no process seen of each target lives, or its time in ``until`` is up."""
    while True:
        now = time.monotonic()
        if all(not t.left() or now >= until[t.name] for t in targets):
            return
        time.sleep(POLL)


def _why(target: Target, left: list[int]) -> str:
    named = ", ".join(f"{p} ({procfs.text(p, 'comm') or '?'})" for p in left[:5])
    if target.refused & set(left):
        return (f"process {named} of it is not ours to signal (a setuid program?);"
                " it keeps running")  # fmt: skip
    return f"process {named} of it outlived SIGKILL by {KILL_WAIT:g} s"


def _memory(targets: list[Target], why: dict[str, str | None]) -> None:
    """Where NVML answers: wait until the GPU shows none of the ended processes."""
    ended = [t for t in targets if why[t.name] is None]
    if not ended:
        return
    try:
        from ..gpu import nvml

        if not nvml.available():
            return
        for t in ended:
            if not nvml.wait_released(t.seen, None, MEMORY_WAIT):
                why[t.name] = (f"its processes are gone, but the GPU still shows their"
                               f" memory held after {MEMORY_WAIT:g} s")  # fmt: skip
    except Exception:  # NVML unusable here: nothing more to look at
        return


def end(targets: list[Target]) -> dict[str, str | None]:
    """End every target at once (blocking): each name, None once it is gone, else why
    it is not."""
    for t in targets:
        found = t.find()
        alone = t.by_wrapper and t.wrapper in found
        t.signal([t.wrapper] if alone and t.wrapper is not None else found, signal.SIGTERM)
    begun = time.monotonic()
    _wait(targets, {t.name: begun + t.grace for t in targets})
    # Those still there, and any process started meanwhile: SIGKILL.
    for t in targets:
        t.find()  # any process started meanwhile is seen too
        t.signal(t.left(), signal.SIGKILL)
    killed = time.monotonic()
    _wait(targets, {t.name: killed + KILL_WAIT for t in targets})
    why: dict[str, str | None] = {}
    for t in targets:
        left = t.left() or t.find()
        why[t.name] = _why(t, left) if left else None
    _memory(targets, why)
    return why
