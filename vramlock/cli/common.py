"""What the commands share and that needs neither typer nor rich: durations, sizes,
warnings, conflict exit codes, stdout's reader going away, the arenas an option names."""

from __future__ import annotations

import re
import select
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# Imported here, not in warn: a warning about running out of descriptors must not need
# one to import its formatting.
from ..arena.roster import printable
from ..errors import NotObtained, UsageError

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import NoReturn

    from ..arena.directory import Arena


class ReaderGone(Exception):
    """Standard output's reader has gone (``vramlock who | head -1``): not a failure."""


@contextmanager
def stdout_reader_may_go() -> Iterator[None]:
    """Turn EPIPE into ReaderGone when it is stdout's reader that has gone (another pipe's
    EPIPE, a child's control channel say, stays an error)."""
    try:
        yield
    except BrokenPipeError as err:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            raise
        raise ReaderGone from err


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}


def parse_duration(text: str, option: str) -> float:
    """Seconds from ``2``, ``0.5``, ``250ms``, ``1.5s``, ``2m``, ``1h``; at most ``MAX_TIMEOUT``."""
    from ..arena.lockfd import MAX_TIMEOUT

    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|)\s*", text)
    if not m:
        raise UsageError(
            f"{option}: bad duration {text!r} (seconds, or a number followed by ms, s, m or h)"
        )
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not seconds <= MAX_TIMEOUT:  # also inf, from a few hundred digits
        raise UsageError(f"{option}: {text!r} is too long (at most {MAX_TIMEOUT} s, 68 years)")
    return seconds


def maybe_size(text: str | None, option: str) -> int | None:
    """``parse_size`` of an option that may be absent."""
    from ..arena.budget import parse_size

    return None if text is None else parse_size(text, option)


def maybe_duration(text: str | None, option: str) -> float | None:
    """``parse_duration`` of an option that may be absent."""
    return None if text is None else parse_duration(text, option)


def timeout(nonblock: bool, wait: str | None) -> float | None:
    """How long to wait for the token: ``-n`` is no time, ``-w`` its duration, else forever."""
    if nonblock:
        return 0.0
    return maybe_duration(wait, "--timeout")


def conflict(err: NotObtained, code: int) -> NoReturn:
    """``-E CODE``: the exit status when the token was not obtained."""
    err.exit_status = code
    raise err


# A message names paths, commands and values as the user gave them: room for a long path.
_MESSAGE_MAX = 8192


def warn(message: str) -> None:
    """A diagnostic or an error: one line on stderr, if stderr still takes it. What the
    user typed (a path, a command) may hold escapes or newlines: they are written escaped."""
    try:
        print(f"vramlock: {printable(message, _MESSAGE_MAX)}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr closed or broken: the wrapper goes on without it


def arenas(
    arena: str | None, gpu: str | None, adopt: bool = False
) -> list[tuple[Arena, int | None]]:
    """The arenas ``--arena``/``--gpu`` name (several GPUs: each one's, ascending), each with
    the GPU whose memory to show: the arena's where that is known, else None (every GPU).
    ``adopt``: a directory that holds other files may become an arena (Arena.open)."""
    from ..arena.directory import Arena, default_gpu, locate, one_arena_or_gpus, parse_gpus

    gpus: list[int | None] = [*sorted(parse_gpus(gpu))] if gpu is not None else []
    one_arena_or_gpus(arena, gpus)
    opened: list[tuple[Arena, int | None]] = []
    try:
        for g in gpus or [None]:
            index = g if g is not None else (default_gpu() if locate(arena)[1] else None)
            opened.append((Arena.open(arena, g, adopt), index))
    except BaseException:
        close_all(opened)
        raise
    return opened


def one_arena(arena: str | None, gpu: str | None, several: str) -> tuple[Arena, int | None]:
    """The one arena ``--arena``/``--gpu`` name, with its GPU as ``arenas`` gives it, for a
    command that reads one; ``several``: the usage error when --gpu names more GPUs."""
    from ..arena.directory import parse_gpus

    if gpu is not None and len(parse_gpus(gpu)) > 1:
        raise UsageError(f"--gpu: {several}")
    (one,) = arenas(arena, gpu)
    return one


def close_all(opened: list[tuple[Arena, int | None]]) -> None:
    """Close what ``arenas`` opened."""
    for a, _ in opened:
        a.close()
