"""``vramlock run``: the command line's values become ``RunOptions``; the runner does the rest."""

from __future__ import annotations

from typing import Any

from ..errors import NotObtained
from .common import conflict, maybe_duration, maybe_size, parse_duration, timeout, warn


def run(
    command: list[str],
    *,
    nonblock: bool,
    wait: str | None,
    conflict_exit_code: int,
    arena: str | None,
    gpu: str | None,
    min_hold: str,
    yield_within: str | None,
    release_within: str | None,
    idle: str | None,
    ready_within: str | None,
    vram: str | None,
    **rest: Any,
) -> int:
    """Run COMMAND while it holds the GPU; release it whenever someone else waits.

    ``rest`` holds the options passed on unchanged (``name``, ``release``, ``demand``,
    ``listen``, ``upstream``, ``ready_url``, ``on_release``, ...): RunOptions' own names."""
    from ..arena.directory import parse_gpus
    from ..run.options import RunOptions
    from ..run.runner import run as run_command

    opts = RunOptions(
        command=command,
        arena=arena,
        gpus=() if gpu is None else parse_gpus(gpu),
        timeout=timeout(nonblock, wait),
        min_hold=parse_duration(min_hold, "--min-hold"),
        yield_within=maybe_duration(yield_within, "--yield-within"),
        release_within=maybe_duration(release_within, "--release-within"),
        idle=maybe_duration(idle, "--idle"),
        ready_within=maybe_duration(ready_within, "--ready-within"),
        vram=maybe_size(vram, "--vram"),
        warn=warn,
        **rest,
    )
    try:
        return run_command(opts)
    except NotObtained as err:
        conflict(err, conflict_exit_code)
