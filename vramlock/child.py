"""For programs run under ``vramlock run``: give the GPU back when asked.

In a training loop::

    from vramlock import child

    ctl = child.connect()            # None when not run by vramlock
    for batch in data:
        step(batch)
        if ctl:
            ctl.yield_if_asked(release=offload, restore=reload)

In a server, answer from a thread and ask for the GPU back when work arrives::

    ctl = child.connect()
    if ctl:
        ctl.serve(release=offload, restore=reload)     # returns at once
    ...
    def handle(request):
        if ctl:
            ctl.ensure_resident()                     # says `want`, waits for restore
        ...

Connecting says ``hello``, which is what makes ``vramlock run --release auto``
pick the cooperative strategy. This module imports nothing heavy.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from .command.control import LineChannel, child_socket


class ControlLost(RuntimeError):
    """vramlock went away while we were released: the GPU cannot be ours again."""


class Control:
    """The child's side of the control channel."""

    def __init__(self, channel: LineChannel) -> None:
        self.channel = channel
        self.released = False
        self._pending: list[str] = []
        self._restored = threading.Event()
        self._restored.set()
        self._asked = False
        self._thread: threading.Thread | None = None
        # serve(): GPU work done while holding this cannot be released under it.
        self.lock = threading.RLock()
        channel.send("hello")

    def _next(self, timeout: float | None) -> str | None:
        if not self._pending:
            self._pending = self.channel.wait_lines(timeout)
        return self._pending.pop(0) if self._pending else None

    def requested(self) -> bool:
        """Has vramlock asked us to release? Never blocks."""
        self._pending += self.channel.read_lines()
        return "release" in self._pending

    def _wait_for(self, word: str) -> None:
        while True:
            line = self._next(None)
            if line == word:
                return
            if line is None and self.channel.closed:
                raise ControlLost("vramlock closed the control channel")

    def yield_if_asked(
        self,
        release: Callable[[], object],
        restore: Callable[[], object],
        *,
        want: bool = True,
    ) -> bool:
        """If asked: ``release()``, answer, wait for our turn, ``restore()``, answer.

        ``want=True`` asks for the GPU back at once (a batch job); with False the
        call still blocks until vramlock restores us for another reason.
        """
        if not self.requested():
            return False
        self._pending.remove("release")
        release()
        self.released = True
        self.channel.send("released")
        if want:
            self.channel.send("want")
        self._wait_for("restore")
        restore()
        self.released = False
        self.channel.send("restored")
        return True

    def serve(self, release: Callable[[], object], restore: Callable[[], object]) -> None:
        """Answer release/restore from a daemon thread (returns at once).

        Hold ``self.lock`` around each piece of GPU work: a release waits for it.
        """

        def loop() -> None:
            while True:
                line = self._next(None)
                if line is None and self.channel.closed:
                    self._restored.set()  # wake ensure_resident(), which then raises
                    return
                with self.lock:
                    if line == "release" and not self.released:
                        release()
                        self.released = True
                        self._asked = False
                        self._restored.clear()
                        self.channel.send("released")
                    elif line == "restore" and self.released:
                        restore()
                        self.released = False
                        self._restored.set()
                        self.channel.send("restored")

        self._thread = threading.Thread(target=loop, name="vramlock-control", daemon=True)
        self._thread.start()

    def ensure_resident(self, timeout: float | None = None) -> bool:
        """While released, say ``want`` and wait until restored; True when resident,
        False when ``timeout`` ran out. Raises ControlLost if vramlock went away."""
        if not self._restored.is_set():
            if not self._asked:  # once per release: `want` is a level, not a count
                self._asked = True
                self.channel.send("want")
            if not self._restored.wait(timeout):
                return False
        if self.released:
            raise ControlLost("vramlock closed the control channel while we were released")
        return True

    def close(self) -> None:
        """Close our end; vramlock then treats the command as one that cannot release."""
        # Shut down first: a serving thread blocked on the socket sees the end and stops,
        # instead of waiting on a descriptor number that may soon name another file.
        try:
            self.channel.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed at the other end
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.channel.close()


def connect() -> Control | None:
    """Join the control channel vramlock gave us, or None when there is none."""
    sock = child_socket()
    return None if sock is None else Control(LineChannel(sock))
