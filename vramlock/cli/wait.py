"""``vramlock wait``: queue for the token from a shell script."""

from __future__ import annotations

from ..errors import NotObtained
from .common import conflict, timeout


def wait(
    nonblock: bool,
    wait_for: str | None,
    conflict_exit_code: int,
    arena: str | None,
    gpu: str | None,
    free: bool,
    fd: int | None,
) -> None:
    """Queue for the GPU (residents step aside) and return once the token is obtained."""
    from ..arena.directory import parse_gpus
    from ..arena.waiter import wait as wait_for_token

    gpus = None if gpu is None else parse_gpus(gpu)
    try:
        wait_for_token(arena, gpus, timeout=timeout(nonblock, wait_for), passive=free, fd=fd)
    except NotObtained as err:
        conflict(err, conflict_exit_code)
