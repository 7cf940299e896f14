"""``vramlock wait``: queue as a waiter until the token is ours, for shell scripts."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack

from ..errors import NotObtained, UsageError
from ..threads import start_blocked
from .directory import Arena
from .member import Member, harmless_signals, join
from .records import read_live
from .roster import printable

# How often a waiter reads the members' records for a resident's refused release.
LOOK_EVERY = 0.5
# How a ``vramlock run``'s note says that a release was refused (--release-within).
REFUSED = "release refused: "


def refusal(note: str | None) -> str | None:
    """The reason a record's note gives for a refused release, or None."""
    if not note or REFUSED not in note:
        return None
    return note.split(REFUSED, 1)[1].split("; ", 1)[0] or None


class Told:
    """While a member waits for the token: each resident whose release was refused (its
    record's note) said once on stderr. Only said: the kernel's locks decide; a record
    not trusted (records.read_live) is not read. A daemon thread with every signal
    blocked, so that signals (a timed wait's alarm) reach the waiting thread."""

    def __init__(self, arenas: list[Arena], every: float = LOOK_EVERY) -> None:
        self.arenas = arenas
        self.every = every
        self.said: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vramlock-told", daemon=True)
        start_blocked(self._thread)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for arena in self.arenas:
                with contextlib.suppress(OSError):
                    self.look(arena)

    def look(self, arena: Arena) -> None:
        """Say each refusal not said yet of a resident of ``arena``."""
        dirfd = arena.members_dir(create=False)
        if dirfd is None:
            return
        try:
            records = read_live(dirfd)
        finally:
            os.close(dirfd)
        for rec, trusted in records:
            why = refusal(rec.note) if trusted and rec.pid != os.getpid() else None
            if why is None or rec.pid in self.said or rec.state not in ("resident", "releasing"):
                continue
            self.said.add(rec.pid)
            sys.stderr.write(
                f"vramlock: the resident {printable(rec.name, 64)} (pid {rec.pid}) could"
                f" not release: {printable(why, 200)}; still waiting\n"
            )
            sys.stderr.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def told(member: Member) -> Iterator[Told]:
    """``Told`` for ``member``'s arenas while the block runs."""
    watch = Told(member.arenas)
    try:
        yield watch
    finally:
        watch.close()


def wait(
    arena: str | None = None,
    gpu: int | Sequence[int] | None = None,
    *,
    timeout: float | None = None,
    passive: bool = False,
    fd: int | None = None,
) -> None:
    """Queue as a waiter (residents step aside) until the token is ours.

    Without ``fd`` the token is dropped again when this returns. With ``fd`` the
    lock is taken on that descriptor's open file description (the calling
    shell's), so it stays held after we exit. Several GPUs: every token, taken in
    ascending order of GPU number, then dropped. Raises NotObtained.
    """
    gpus = () if gpu is None else (gpu,) if isinstance(gpu, int) else tuple(gpu)
    if len(gpus) > 1 and fd is not None:
        raise UsageError("--fd locks one descriptor of one arena's token: give one GPU")
    with harmless_signals(), ExitStack() as stack:
        member = join(
            stack,
            arena,
            gpus,
            name="vramlock wait",
            command=sys.argv,
            strategy="wait --free" if passive else "wait",
            token_fd=fd,
        )
        try:
            with told(member):
                got = member.acquire(timeout, wanting=not passive)
            if not got:
                raise NotObtained(timeout or 0.0)
        finally:
            if fd is not None:
                # The lock is the caller's: closing our copy keeps it, LOCK_UN would not.
                member.residency.drop(unlock=False)
