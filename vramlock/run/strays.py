"""Released, a command stays off the GPU: a process that slips past its strategy is
stopped until the command's turn.

``swap`` keeps each process off the GPU through the library in it, ``checkpoint``
through the driver, both from the release on. A process that begins to use CUDA after
the release beyond their reach (a program exec'd by the system call itself without
LD_PRELOAD, a static one, a process that was not checkpointed) would run in another
member's turn. So while the member is released a thread looks at the command's
processes: every ``TICK`` at those that could begin (``Strategy.loose``'s suspects),
at the command's whole tree whenever a process or thread was created on the host (the
last pid of /proc/loadavg moved, at most every ``TREE_EVERY``), at any process that
exec'd another program in place (its layout in /proc/PID/stat moved, read at most every
``TREE_EVERY``: a quiet host makes no pid for that), and at every process of the
command (its group and adopted orphans too) every ``ALL_EVERY``. One found loose gets
SIGSTOP, said once, and SIGCONT once the token is the command's again.

This is a watch, not a gate: a program that maps the driver, initialises it and runs a
kernel between two looks (a few tens of milliseconds; a CUDA context takes longer than
that to make) runs that much in another member's turn.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

from .. import procfs
from ..strategies import Strategy
from ..strategies.vkswap import api_of

TICK = 0.01
TREE_EVERY = 0.05
ALL_EVERY = 1.0


def _last_pid() -> str:
    """The pid the kernel gave last, in our pid namespace (threads count too)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return f.read().split()[-1].decode()
    except (OSError, IndexError):
        return ""


def _moved(pid: int, before: tuple[int, ...] | None, size_too: bool) -> bool:
    """Has ``pid`` exec'd a program since its ``procfs.layout`` was ``before`` (or, with
    ``size_too``, mapped or unmapped anything)?"""
    now = procfs.layout(pid)
    if now is None or before is None:
        return now is not None  # gone: nothing to look at
    return now != before if size_too else now[1:] != before[1:]


class Strays:
    """The watch over a released command's processes (one thread, started at the first
    ``watch``), and the processes it stopped."""

    def __init__(
        self,
        strategy: Callable[[], Strategy],
        tree: Callable[[], list[int]],
        everything: Callable[[], list[int]],
        warn: Callable[[str], None],
        note: Callable[[str | None], None],
    ) -> None:
        self._strategy = strategy
        self._tree = tree  # what descends from the run: cheap
        self._everything = everything  # its group and orphans too: every process read
        self._warn = warn
        self._note = note  # the member record's note, for who
        self._watching = threading.Event()
        self._lock = threading.Lock()  # held through each look
        self._thread: threading.Thread | None = None
        self.stopped: dict[int, int] = {}  # pid: start time, stopped until our turn
        self._said: set[tuple[int, int]] = set()  # (pid, start) told of already

    def watch(self, again: Iterable[int] = ()) -> None:
        """Released: watch from now on. ``again``: processes ``resume`` let go for a turn
        that did not come (the restore failed), stopped again before the token goes."""
        with self._lock:
            self._watching.set()
            for pid in again:
                self._stop(pid, again=True)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vramlock-strays", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        """The token is the command's again: stop watching (a look under way ends
        first). What was stopped stays so until ``resume``."""
        with self._lock:
            self._watching.clear()

    def resume(self) -> list[int]:
        """The command is resident again: stop watching, and let the stopped processes
        run; those that were stopped."""
        with self._lock:
            self._watching.clear()
            resumed = []
            for pid, start in self.stopped.items():
                if procfs.alive(pid, start):
                    try:
                        os.kill(pid, signal.SIGCONT)
                        resumed.append(pid)
                    except OSError:
                        pass
            if self.stopped:
                self._note(None)
            self.stopped.clear()
            return resumed

    def _run(self) -> None:
        suspects: list[int] = []
        # Found loose at the last look: stopped if they still are at the next, so that
        # one look that reads a process in the middle of a change stops nothing.
        seen_loose: set[int] = set()
        seen, tree_at, all_at = "", 0.0, 0.0
        # procfs.layout of each process looked at, as before its last look
        layouts: dict[int, tuple[int, ...] | None] = {}
        while True:
            self._watching.wait()
            with self._lock:
                if not self._watching.is_set():
                    seen_loose.clear()
                    continue
                now, last = time.monotonic(), _last_pid()
                whole = True
                if now >= all_at:
                    pids, all_at, tree_at, seen = self._everything(), now + ALL_EVERY, now, last
                elif last != seen and now >= tree_at + TREE_EVERY:
                    pids, tree_at, seen = self._tree(), now, last
                else:
                    # Read again: a suspect whose address space changed (it may have mapped
                    # the driver) and, at most every TREE_EVERY, a process that exec'd
                    # another program in place (no new pid for the host to count). The
                    # others are not (a maps file is long; a stat line is not).
                    whole = False
                    execs = now >= tree_at + TREE_EVERY
                    if execs:
                        tree_at = now
                    suspected = set(suspects)
                    pids = [
                        p
                        for p in (list(layouts) if execs else suspects)
                        if _moved(p, layouts.get(p), size_too=p in suspected)
                    ]
                    pids += [p for p in seen_loose if p not in pids]
                layouts.update((p, procfs.layout(p)) for p in pids)  # before the look
                try:
                    loose, found = self._strategy().loose(pids) if pids else ([], [])
                except Exception as err:  # a look that failed: the next one may not
                    self._say(0, 0, f"a look at the command's processes failed: {err}")
                    loose, found = [], [p for p in pids if p in suspects]
                looked = set(pids)
                suspects = found if whole else [p for p in suspects if p not in looked] + found
                if whole:
                    layouts = {p: layouts.get(p) for p in pids}
                for pid in loose:
                    if pid in seen_loose:
                        self._stop(pid)
                seen_loose = set(loose)
                for pid, start in list(self.stopped.items()):
                    if procfs.alive(pid, start) and procfs.state(pid) not in ("T", "t"):
                        self._stop(pid, again=True)  # continued by somebody else
            time.sleep(TICK)

    def _say(self, pid: int, start: int, message: str) -> None:
        """``message``, once for process ``pid`` started at ``start``."""
        if (pid, start) not in self._said:
            self._said.add((pid, start))
            self._warn(message)

    def _stop(self, pid: int, again: bool = False) -> None:
        start = procfs.starttime(pid)
        if start is None or (pid in self.stopped and not again):
            return
        label, what = self._strategy().label, api_of(pid)
        why = ("exec'd without the swap library, a static program, or not checkpointed"
               if what == "CUDA" else "started without vramlock's layer")  # fmt: skip
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError as err:
            self._say(pid, start,
                      f"process {pid} of the command began to use {what} while it is released,"
                      f" beyond what {label} holds, and cannot be stopped ({err.strerror}):"
                      " it may run on the GPU in another member's turn")  # fmt: skip
            self.stopped[pid] = start
            return
        self._say(pid, start,
                  f"process {pid} of the command began to use {what} while it is released,"
                  f" beyond what {label} holds ({why}):"
                  " stopped until the command's turn")  # fmt: skip
        if pid not in self.stopped:
            self.stopped[pid] = start
            pids = ", ".join(map(str, self.stopped))
            self._note(f"stopped until its turn: {pids} (began to use {what} while released)")
        self.stopped[pid] = start
