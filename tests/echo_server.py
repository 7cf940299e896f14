"""A model's server for the serve tests: it answers what it received.

``python echo_server.py PORT [NAME] [DELAY]``: after DELAY seconds (a model loading), it
listens on 127.0.0.1:PORT and says ``NAME listening`` on stdout; each request is said
on stderr (``NAME got METHOD PATH``) and answered with JSON of its method, path,
headers and body, as {"id": NAME, ...}; a POST whose JSON body has ``"stream": true``
is answered as OpenAI streams: two SSE chunks of content, then ``data: [DONE]``; one
with ``"sleep": SECONDS`` is answered that much later. ``"reply": {...}`` adds its members
to the JSON answer (a stream: one more event, before ``[DONE]``, of just them);
``"status": N`` answers with that status (a stream too). ``"hold": true`` answers nothing more (a
stream: after its first chunk) until the client closes its connection, and then says
``NAME saw its client go`` on stderr: the witness of a request ended from the other side.
GET /health answers 200.
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = sys.argv[2] if len(sys.argv) > 2 else "echo"


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode("utf-8", "replace")
        print(f"{NAME} got {self.command} {self.path}", file=sys.stderr, flush=True)
        try:
            doc = json.loads(body) if body else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            doc = {}
        if isinstance(doc.get("sleep"), int | float):
            time.sleep(doc["sleep"])  # a slow answer: a request long in progress
        reply = doc["reply"] if isinstance(doc.get("reply"), dict) else {}
        if doc.get("stream") is True:
            self.stream(reply, doc.get("hold") is True, doc.get("status"))
            return
        if doc.get("hold") is True:
            self.held()
            return
        got = {"id": NAME, "method": self.command, "path": self.path,
               "headers": dict(self.headers.items()), "body": body, **reply}  # fmt: skip
        data = json.dumps(got).encode()
        status = doc.get("status")
        self.send_response(status if isinstance(status, int) else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def stream(self, reply: dict[str, object], hold: bool, status: object) -> None:
        self.send_response(status if isinstance(status, int) else 200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunks: list[object] = [{"choices": [{"delta": {"content": w}}]} for w in (NAME, " done")]
        if reply:
            chunks.append(reply)
        events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
        for i, event in enumerate(events):
            data = event.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            if hold and i == 0:
                self.held()
                return
        self.wfile.write(b"0\r\n\r\n")

    def held(self) -> None:
        """Nothing more until the client closes its connection, which is said."""
        self.close_connection = True
        self.connection.settimeout(60)
        try:
            while self.connection.recv(1024):
                pass
        except TimeoutError:
            print(f"{NAME} gave up waiting for its client to go", file=sys.stderr, flush=True)
            return
        except OSError:
            pass  # reset: gone too
        print(f"{NAME} saw its client go", file=sys.stderr, flush=True)

    do_GET = do_POST = do_PUT = do_DELETE = answer


def main() -> None:
    if len(sys.argv) > 3:
        time.sleep(float(sys.argv[3]))
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Echo)
    print(f"{NAME} listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
