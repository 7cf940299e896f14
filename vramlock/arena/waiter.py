"""``vramlock wait``: queue as a waiter until the token is ours, for shell scripts."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import ExitStack

from ..errors import NotObtained, UsageError
from .member import harmless_signals, join


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
            if not member.acquire(timeout, wanting=not passive):
                raise NotObtained(timeout or 0.0)
        finally:
            if fd is not None:
                # The lock is the caller's: closing our copy keeps it, LOCK_UN would not.
                member.residency.drop(unlock=False)
