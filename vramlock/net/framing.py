"""Where HTTP/1.1 messages begin and end in a byte stream, as the bytes pass.

The proxy follows both directions of each connection: a request that has begun and
whose response has not ended is work in progress (``Content-Length``, chunked
transfer coding, or the end of the connection ends a response; requests may be
pipelined; a ``HEAD`` request's response and 1xx, 204 and 304 responses have no
body). The http strategy reads its answers with one, and keeps their bodies.

Bytes that are not HTTP/1.x, a protocol switch (``101``, ``CONNECT``) or a head too
large make a stream ``opaque``: its boundaries are unknown from then on.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Callable

MAX_HEAD = 64 << 10  # request or status line and headers, or a chunk's trailers
MAX_LINE = 4 << 10  # a chunk-size line

_REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) \S+ HTTP/1\.[0-9]")
_METHOD_START = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_STATUS_LINE = re.compile(rb"HTTP/1\.[0-9] ([0-9]{3})(?: .*)?")


class _State(enum.Enum):
    HEAD = enum.auto()  # before or in a head
    LENGTH = enum.auto()  # a body of known length
    SIZE = enum.auto()  # a chunk-size line
    DATA = enum.auto()  # a chunk's data, and the CRLF after it
    TRAILER = enum.auto()  # after the last chunk, until an empty line
    CLOSE = enum.auto()  # a body that ends with the connection
    OPAQUE = enum.auto()


class Framing:
    """One direction of a connection: requests (``responses`` False) or responses.

    ``methods`` is shared by the two directions of a connection: the request side
    appends each request's method, the response side takes one per final response.
    ``started``: messages begun; ``done``: messages complete (final responses, not 1xx).
    With ``body`` (a bytearray), the bodies' bytes are appended to it.
    """

    __slots__ = (
        "_buf",
        "_left",
        "_state",
        "_tail",
        "body",
        "done",
        "methods",
        "responses",
        "started",
        "status",
    )

    def __init__(
        self, *, responses: bool, methods: deque[bytes], body: bytearray | None = None
    ) -> None:
        self.responses = responses
        self.methods = methods
        self.body = body
        self.started = self.done = 0
        self.status = 0  # the last response's status
        self._state = _State.HEAD
        self._buf = bytearray()  # a head, a chunk-size line or trailers, as they come
        self._left = 0  # bytes left of a body or chunk (and the chunk's CRLF)
        self._tail = 0  # data bytes at the end of _left that are the chunk's CRLF

    @property
    def opaque(self) -> bool:
        return self._state is _State.OPAQUE

    @property
    def in_message(self) -> bool:
        """A message has begun and has not ended."""
        return self.started > self.done

    def give_up(self) -> None:
        """From now on, the boundaries are unknown (the other direction switched protocols)."""
        self._state = _State.OPAQUE

    def end(self) -> None:
        """The stream ended: a body read until the connection closes is complete."""
        if self._state is _State.CLOSE:
            self._complete()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view and self._state is not _State.OPAQUE:
            state = self._state
            if state is _State.HEAD:
                view = self._head(view)
            elif state is _State.LENGTH or state is _State.DATA:
                n = min(self._left, len(view))
                if self.body is not None:
                    keep = max(0, min(n, self._left - self._tail))
                    self.body += view[:keep]
                self._left -= n
                view = view[n:]
                if not self._left:
                    if state is _State.LENGTH:
                        self._complete()
                    else:
                        self._state = _State.SIZE
            elif state is _State.SIZE:
                view = self._size(view)
            elif state is _State.TRAILER:
                view = self._lines(view, self._trailers)
            else:  # CLOSE
                if self.body is not None:
                    self.body += view
                return

    # -- heads ------------------------------------------------------------------------

    def _lines(self, view: memoryview, then: Callable[[bytes], None]) -> memoryview:
        """Collect bytes up to an empty line; call ``then(text)`` with them once there."""
        before = len(self._buf)
        self._buf += view
        end = self._buf.find(b"\r\n\r\n", max(0, before - 3))
        if end < 0:
            if len(self._buf) > MAX_HEAD:
                self._state = _State.OPAQUE
            return view[len(view) :]
        used = end + 4 - before
        text = bytes(self._buf[: end + 4])
        self._buf.clear()
        then(text)
        return view[used:]

    def _head(self, view: memoryview) -> memoryview:
        if not self._buf:
            # Empty lines between messages are allowed; the first other byte begins one.
            i = 0
            while i < len(view) and view[i] in b"\r\n":
                i += 1
            view = view[i:]
            if not view:
                return view
            if not (b"H" if self.responses else _METHOD_START).count(view[0]):
                self._state = _State.OPAQUE  # TLS, HTTP/2, a protocol of its own
                return view
            if not self.responses:
                self.started += 1
        view = self._lines(view, self._parsed)
        if self._buf and self._state is _State.HEAD:
            # Not all there yet: still, something else than HTTP/1.x shows in its
            # first line, not 64 KiB later.
            end = self._buf.find(b"\r\n")
            pattern = _STATUS_LINE if self.responses else _REQUEST_LINE
            if end < 0:
                bad = len(self._buf) > MAX_LINE
            else:
                bad = pattern.fullmatch(self._buf[:end]) is None
            if bad:
                self._state = _State.OPAQUE
        return view

    def _parsed(self, head: bytes) -> None:
        first, *lines = head[:-4].split(b"\r\n")
        fields: dict[bytes, list[bytes]] = {}
        for line in lines:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                self._state = _State.OPAQUE
                return
            fields.setdefault(name.lower(), []).append(value.strip())
        if self.responses:
            self._response(first, fields)
        else:
            self._request(first, fields)

    def _request(self, first: bytes, fields: dict[bytes, list[bytes]]) -> None:
        m = _REQUEST_LINE.fullmatch(first)
        if m is None:
            self._state = _State.OPAQUE
            return
        self.methods.append(m.group(1).upper())
        self._body(fields, close_allowed=False)

    def _response(self, first: bytes, fields: dict[bytes, list[bytes]]) -> None:
        m = _STATUS_LINE.fullmatch(first)
        if m is None or not self.methods:  # not HTTP, or an answer nobody asked for
            self._state = _State.OPAQUE
            return
        self.started = self.done + 1
        status = self.status = int(m.group(1))
        method = self.methods[0]
        if status == 101 or (method == b"CONNECT" and 200 <= status < 300):
            self._state = _State.OPAQUE  # another protocol from here on
        elif 100 <= status < 200:
            self.started = self.done  # interim: the final answer is still to come
        elif method == b"HEAD" or status in (204, 304):
            self._complete()
        else:
            self._body(fields, close_allowed=True)

    def _body(self, fields: dict[bytes, list[bytes]], *, close_allowed: bool) -> None:
        codings = b",".join(fields.get(b"transfer-encoding", []))
        lengths = {v for value in fields.get(b"content-length", []) for v in value.split(b",")}
        if codings:
            last = codings.rsplit(b",", 1)[-1].strip().lower()
            if last == b"chunked":
                self._state = _State.SIZE
            elif close_allowed:
                self._state = _State.CLOSE
            else:
                self._state = _State.OPAQUE  # a request's body of unknown length
        elif lengths:
            length = lengths.pop().strip()
            if lengths or not length.isdigit():
                self._state = _State.OPAQUE
            elif int(length):
                self._state, self._left, self._tail = _State.LENGTH, int(length), 0
            else:
                self._complete()
        elif close_allowed:
            self._state = _State.CLOSE
        else:
            self._complete()  # a request without a body

    # -- chunks -----------------------------------------------------------------------

    def _size(self, view: memoryview) -> memoryview:
        # A size line is a few bytes: look at those first, not at a whole read of small
        # chunks each time.
        end = bytes(view[:32]).find(b"\n")
        if end < 0 and len(view) > 32:
            end = bytes(view[:MAX_LINE]).find(b"\n")
        if end < 0:
            self._buf += view
            if len(self._buf) > MAX_LINE:
                self._state = _State.OPAQUE
            return view[len(view) :]
        line = bytes(self._buf) + bytes(view[:end])
        self._buf.clear()
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            self._state = _State.OPAQUE
            return view[len(view) :]
        if size:
            self._state, self._left, self._tail = _State.DATA, size + 2, 2
        else:
            # The size line's CRLF begins the empty line that ends the trailers.
            self._state = _State.TRAILER
            self._buf += b"\r\n"
        return view[end + 1 :]

    def _trailers(self, text: bytes) -> None:
        self._complete()

    def _complete(self) -> None:
        self.done += 1
        self.started = max(self.started, self.done)
        if self.responses and self.methods:
            self.methods.popleft()
        self._state = _State.HEAD
