"""Who is in an arena: the kernel's lock state merged with members' records.

/proc/locks says who holds and who waits for the token; records (``records.py``)
say who those processes are. Where the two disagree the kernel is believed: a
record's claim to hold the token is shown only when the kernel agrees, and an
unverified record (written by somebody other than the process's owner) lends a
row its name only. Everything here is for display; nothing decides from it.

Rows hold printable text only: names and command lines come from records and
/proc, which anybody can fill with terminal escapes, newlines or megabytes.

This module must stay cheap to import: ``who`` uses it without the lock layer.
"""

from __future__ import annotations

import importlib.util
import os

from .. import procfs
from .directory import TOKEN, WANT, Arena
from .records import HOLDING, Record, State, read_live

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import Any

    from ..gpu.nvml import Gpu
    from .budget import Budget

NAME_MAX = 64
# A member's own note (a cause in its words: why swap could not reach a process) is longer.
NOTE_MAX = 256
STRATEGY_MAX = 32
COMMAND_MAX = 1024
_ORDER = [s.value for s in State]


def printable(value: str, limit: int) -> str:
    """``value`` safe for a terminal: unprintable characters (controls, escapes, newlines,
    bidi overrides) written as Python escapes (``\\x1b``, ``\\n``, ``\\u202e``), and cut
    to ``limit`` characters with an ellipsis."""
    head = value[: limit + 1]
    if not head.isprintable():
        head = "".join(c if c.isprintable() else repr(c)[1:-1] for c in head)
    return head if len(head) <= limit else head[: limit - 1] + "…"


class Row:
    """One line of ``who``."""

    # In this order in ``who --json``.
    FIELDS = (
        "pid", "state", "name", "command", "strategy", "since", "child_pid", "member", "note",
        "vram", "listen", "connections", "gpus", "footprint", "footprint_from", "units",
        "last_release", "last_restore",
    )  # fmt: skip
    __slots__ = FIELDS

    def __init__(
        self,
        pid: int,
        state: str,
        name: str,
        command: str,
        strategy: str,
        since: float | None,
        child_pid: int | None,
        member: bool,  # False: no verified record (flock(1), a C program, an exited locker)
        *,
        note: str | None = None,  # stopped, an unverified record, the locker is gone
        vram: int | None = None,  # bytes on the GPU (NVML), for the member and its processes
        listen: str | None = None,  # --demand listen: where its clients connect
        connections: int | None = None,  # --demand listen: its clients' open connections
        gpus: list[int] | None = None,  # a member of several GPUs' arenas: all of them
        footprint: int | None = None,  # a budget member: its footprint in bytes
        footprint_from: str | None = None,  # "declared", "measured" or "whole budget"
        units: list[int] | None = None,  # a budget member: the budget units it holds
        last_release: float | None = None,  # seconds its last release took
        last_restore: float | None = None,  # seconds its last restore took
    ) -> None:
        self.pid = pid
        self.state = state
        self.name = name
        self.command = command
        self.strategy = strategy
        self.since = since
        self.child_pid = child_pid
        self.member = member
        self.note = note
        self.vram = vram
        self.listen = listen
        self.connections = connections
        self.gpus = gpus
        self.footprint = footprint
        self.footprint_from = footprint_from
        self.units = units
        self.last_release = last_release
        self.last_restore = last_restore

    def as_json(self, now: float) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.FIELDS}
        data["seconds_in_state"] = None if self.since is None else round(now - self.since, 3)
        return data


def _merged_state(claimed: str, kernel: str | None) -> str:
    """The state to show: the record's, as far as the kernel's lock state bears it out."""
    if kernel == State.RESIDENT.value:
        return claimed if claimed in HOLDING else kernel
    if kernel is not None:
        return kernel
    # No lock: a claim to hold the token is false (or out of date), and unknown words are noise.
    return claimed if claimed in (State.WAITING.value, State.RELEASED.value) else "?"


# Said of a member that locks a token.lock the arena no longer has: it excludes nobody.
STALE_TOKEN = "its token.lock was deleted or replaced: two members may be resident"


def _shown(
    pid: int,
    state: str,
    name: str,
    command: str,
    strategy: str,
    *,
    member: bool,
    since: float | None = None,
    child_pid: int | None = None,
) -> Row:
    """A row whose text is cut and escaped for a terminal."""
    return Row(
        pid=pid,
        state=state,
        name=printable(name, NAME_MAX),
        command=printable(command, COMMAND_MAX),
        strategy=printable(strategy, STRATEGY_MAX),
        since=since,
        child_pid=child_pid,
        member=member,
    )


def _budget_member(row: Row, rec: Record, kernel: str | None, notes: list[str]) -> None:
    """A budget member's footprint and units, into ``row`` and its notes."""
    if rec.vram is None:
        return  # not in a budget arena
    row.footprint, row.units = rec.vram, rec.units
    row.footprint_from = None if rec.vram_from is None else printable(rec.vram_from, NAME_MAX)
    notes.append(f"footprint {_footprint(rec.vram, row.footprint_from)}, {len(rec.units)} unit(s)")
    if not rec.units and kernel == State.RESIDENT.value:
        # The head budget waiter holds the token shared while it gathers units.
        row.state = State.WAITING.value
        notes.append("gathering units")


def _member_row(
    pid: int, kernel: str | None, rec: Record, token_ino: int | None, notes: list[str]
) -> Row:
    """A member with a verified record: its state as far as the kernel bears it out."""
    state = _merged_state(rec.state, kernel)
    if rec.gpus and rec.state == State.WAITING.value:
        # Holds this GPU's token, and waits for another's: not resident anywhere yet.
        state = rec.state
        notes.append("taking its GPUs' tokens")
    if rec.token_ino is not None and rec.token_ino != token_ino:
        notes.append(STALE_TOKEN)
    left = [p for p in rec.leftovers if procfs.living(p)]
    if left:
        notes.append(f"command exited; ending {', '.join(map(str, left))}")
    row = _shown(pid, state, rec.name, " ".join(rec.command), rec.strategy, member=True,
                 since=rec.since, child_pid=rec.child_pid)  # fmt: skip
    row.last_release, row.last_restore = rec.released_in, rec.restored_in
    if rec.listen is not None:
        row.listen, row.connections = printable(rec.listen, NAME_MAX), rec.connections
        notes.append(f"listen {row.listen}, {row.connections or 0} connection(s)")
    if rec.gpus:
        row.gpus = rec.gpus
        notes.append(f"GPUs {','.join(map(str, rec.gpus))} together")
    if rec.note:
        notes.append(printable(rec.note, NOTE_MAX))
    _budget_member(row, rec, kernel, notes)
    return row


def _unverified_row(
    pid: int, kernel: str | None, found: tuple[Record, bool] | None, notes: list[str]
) -> Row:
    """No record we can believe: the kernel's state and /proc's facts only."""
    command = procfs.text(pid, "cmdline")
    if found is None:
        name = procfs.text(pid, "comm") or "(exited)"
    else:
        name = found[0].name
        notes.append("unverified record")
    return _shown(pid, kernel or "?", name, command, "-", member=False)


def _row(
    pid: int,
    kernel: str | None,
    found: tuple[Record, bool] | None,
    note: str | None,
    token_ino: int | None = None,
) -> Row:
    notes = [note] if note else []
    if found is not None and found[1]:
        row = _member_row(pid, kernel, found[0], token_ino, notes)
    else:
        row = _unverified_row(pid, kernel, found, notes)
    if procfs.state(pid) in ("T", "t"):
        notes.append("stopped")
    if row.child_pid is not None and procfs.state(row.child_pid) in ("T", "t"):
        notes.append("child stopped")
    row.note = "; ".join(notes) or None
    return row


def _resident_pids(locker: int, dev: int, ino: int) -> list[tuple[int, str | None]]:
    """Who is resident for a token lock that /proc/locks says ``locker`` took.

    When the locker is gone (a SIGKILLed ``vramlock run``), the lock lives on in the
    processes that inherited its open file description: name the topmost of them.
    """
    if procfs.living(locker):
        return [(locker, None)]
    holders = procfs.lock_holders(dev, ino)
    top = [pid for pid in holders if procfs.ppid(pid) not in holders]
    return [(pid, f"locker {locker} gone") for pid in top] or [(locker, None)]


class GpuView:
    """What NVML says about the arena's GPU(s): ``gpus`` and pid -> bytes."""

    __slots__ = ("gpus", "used")

    def __init__(self, gpus: list[Gpu] | None = None, used: dict[int, int] | None = None) -> None:
        self.gpus = [] if gpus is None else gpus
        self.used = {} if used is None else used


def gpu_view(index: int | None) -> GpuView | None:
    """NVML's view of GPU ``index`` (None: every GPU), or None without NVML.

    pynvml is imported only where the ``nvml`` extra is installed: without it, ``who``
    pays one module lookup.
    """
    if importlib.util.find_spec("pynvml") is None:
        return None
    from ..gpu import nvml

    try:
        if not nvml.available():
            return None
        gpus = nvml.gpus() if index is None else [nvml.gpu(index)]
        return GpuView(gpus=gpus, used=nvml.processes(index))
    except nvml.NvmlError:
        return None


def with_vram(rows: list[Row], view: GpuView) -> list[Row]:
    """Each member's VRAM (its own process and every descendant: the command, its
    workers), and a ``foreign`` row for each GPU process that belongs to no member."""
    accounted: set[int] = set()
    for row in rows:
        pids = {row.pid, *procfs.descendants(row.pid)}
        accounted |= pids
        row.vram = sum(view.used.get(pid, 0) for pid in pids)
    for pid, used in sorted(view.used.items()):
        if pid in accounted:
            continue
        # NVML's pids are the driver's: in a container they may name nobody here.
        visible = procfs.living(pid)
        name = procfs.text(pid, "comm") if visible else "?"
        command = procfs.text(pid, "cmdline") if visible else ""
        row = _shown(pid, "foreign", name, command, "-", member=False)
        row.note, row.vram = ("not a member" if visible else "pid not visible here"), used
        rows.append(row)
    return rows


def _size(size: int) -> str:
    from .budget import show_size

    return show_size(size)


def _footprint(size: int, source: str | None) -> str:
    """``6G`` (declared), ``5.3G measured``, ``40G whole budget`` (nothing measured yet)."""
    from .footprint import DECLARED

    if source in (None, DECLARED):
        return _size(size)
    return f"{_size(size)} {source}"


class BudgetView:
    """An arena's budget, and how many of its units are taken (by /proc/locks)."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: Budget, held: int) -> None:
        self.budget = budget
        self.held = held

    def line(self) -> str:
        return f"budget {self.budget}: {self.held} held, {self.budget.units - self.held} free"


def budget_view(arena: Arena) -> BudgetView | None:
    """The arena's budget, or None when it has none (an unusable budget file: ArenaError)."""
    from .budget import CAPACITY, read_budget

    budget = read_budget(arena)
    if budget is None:
        return None
    try:
        st = os.stat(CAPACITY, dir_fd=arena.dirfd, follow_symlinks=False)
    except OSError:
        return BudgetView(budget=budget, held=0)
    held = procfs.byte_locks_held(procfs.read_proc_locks(), st.st_dev, st.st_ino, budget.units)
    return BudgetView(budget=budget, held=min(held, budget.units))


def _ancestors(pids: list[int]) -> set[int]:
    """The parents, grandparents, ... of ``pids`` (up to, not including, init)."""
    out: set[int] = set()
    for pid in pids:
        parent = procfs.ppid(pid)
        while parent is not None and parent > 1 and parent not in out:
            out.add(parent)
            parent = procfs.ppid(parent)
    return out


def snapshot(arena: Arena) -> list[Row]:
    """Residents first, then waiters in queue order, then the rest."""
    listing = procfs.read_proc_locks()

    def key(name: str) -> tuple[int, int] | None:
        try:
            st = os.stat(name, dir_fd=arena.dirfd, follow_symlinks=False)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    token_key, want_key = key(TOKEN), key(WANT)
    token_ino = None if token_key is None else token_key[1]
    token = [] if token_key is None else procfs.parse_proc_locks(listing, *token_key)
    want = [] if want_key is None else procfs.parse_proc_locks(listing, *want_key)

    kernel: list[tuple[int, str, str | None]] = []
    for e in token:
        if not e.blocked and token_key is not None:
            kernel += [(p, "resident", note) for p, note in _resident_pids(e.pid, *token_key)]
    kernel += [(e.pid, "waiting", None) for e in token if e.blocked]
    # A want.lock holder above a token locker is that locker's shell recipe (``flock -s
    # want.lock flock -x token.lock CMD``): one waiter, shown by the token's state alone.
    recipes = _ancestors([e.pid for e in token])
    kernel += [(e.pid, "waiting", None) for e in want if not e.write and e.pid not in recipes]

    records: dict[int, tuple[Record, bool]] = {}
    dirfd = arena.members_dir(create=False)
    if dirfd is not None:
        try:
            records = {found[0].pid: found for found in read_live(dirfd)}
        finally:
            os.close(dirfd)

    rows: list[Row] = []
    seen: set[int] = set()
    for pid, state, note in kernel:
        if pid not in seen:
            seen.add(pid)
            rows.append(_row(pid, state, records.pop(pid, None), note, token_ino))
    rest = [_row(pid, None, found, None, token_ino) for pid, found in records.items()]
    rest.sort(key=lambda r: _ORDER.index(r.state) if r.state in _ORDER else len(_ORDER))
    return rows + rest
