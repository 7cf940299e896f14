"""``--demand listen``: a TCP proxy in front of the command's server.

Bytes pass through untouched (HTTP, streamed responses, websockets): this is TCP
splicing. HTTP/1.x framing is followed as the bytes pass (net/framing.py, in
``conn``), only to tell a response in progress from an idle keep-alive connection.
One daemon thread runs a selector (``loop``) over every socket; the runner's loop
talks to it through a few methods of ``Proxy`` and a wake-up pipe.

The gate (``relay``) says what happens to clients:

- ``CLOSED`` (released): new connections are accepted and held, bytes a client sends
  on an open connection wait; either one is demand, and wakes the runner's loop;
- ``OPENING`` (started, or restored): the same, while the upstream is probed
  (``probe``) until it is ready (``ready_within`` at most: then the waiting clients are
  closed): until ``GET ready_url`` answers 2xx, or without one, until it accepts a TCP
  connection;
- ``OPEN``: connections are forwarded.

Nothing here blocks and nothing polls: with no traffic the thread sleeps in the
selector. The per-byte path is one ``recv``, one ``send``, a clock read and the
framing's arithmetic.
"""

from .proxy import Proxy
from .relay import Gate

__all__ = ["Gate", "Proxy"]
