"""Helper threads that leave signals to the main thread."""

from __future__ import annotations

import signal
import threading


def start_blocked(thread: threading.Thread) -> None:
    """Start ``thread`` with every signal blocked in it, for good: signals (an ending
    one, a timed wait's alarm) reach the main thread, which Python runs handlers on
    anyway. They are held back in the caller too while the thread starts, so that a
    handler that raises cannot leave it half registered."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
