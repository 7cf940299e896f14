"""The command line. The only package that imports typer or rich.

Errors become one line on stderr and an exit status here, in ``main``, and nowhere
else. ``who`` and ``run`` in their common forms are parsed by ``fast`` without typer;
everything else goes to the typer app (``app``). Heavy modules are imported inside the
commands that need them, so the short commands stay fast.
"""

from __future__ import annotations

import os
import sys

from ..errors import VramlockError
from .common import ReaderGone, parse_duration, stdout_reader_may_go, warn

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import NoReturn, TextIO

__all__ = ["main", "parse_duration"]


def _reopen_closed_stdio() -> None:
    # A closed 0, 1 or 2 is the number the next open() returns: token.lock would get it,
    # and a command writing to its stdout would write into the lock file.
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            os.set_inheritable(null, True)  # a command we start gets it too
            if getattr(sys, name) is None:  # Python found it closed at start-up
                setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (open for good)


def _discard(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null: what is still buffered, and the
    interpreter's flush at exit, then go nowhere instead of failing again."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    except (OSError, ValueError):
        pass  # not a descriptor of ours (an in-process caller's replacement stream)
    finally:
        os.close(null)


def _run(argv: list[str]) -> int:
    from .fast import parse

    try:
        call = parse(argv, os.environ)
        if call is not None:
            return call()
        from .app import run_app

        return run_app(argv)
    except VramlockError as err:
        warn(str(err))
        return err.exit_status
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point: run the CLI, map every error to one stderr line and an exit status."""
    _reopen_closed_stdio()
    try:
        with stdout_reader_may_go():
            code = _run(sys.argv[1:] if argv is None else argv)
            sys.stdout.flush()
    except ReaderGone:
        _discard(sys.stdout)  # what is still buffered goes nowhere, also at exit
        code = 0
    except OSError as err:  # stdout on a full disk (ENOSPC), an I/O error: no traceback
        _discard(sys.stdout)
        warn(f"cannot write the output: {err.strerror or err}")
        code = 125
    try:
        sys.stderr.flush()
    except OSError:
        _discard(sys.stderr)  # broken: the exit status still tells
    sys.exit(code)
