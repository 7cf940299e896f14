"""Request bodies through ``vramlock serve``: held once, or passed on as they come.

A JSON body is held (to find its model) but only once, whatever its size; a body that
needs no reading (``/upstream``, a multipart form after its ``model`` field) is passed
to the server as it comes, its size limit counted as it passes. Measured by serve's
peak resident memory (``VmHWM``) across three large bodies sent at once.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock
from helpers.net import free_port
from helpers.processes import Spawn

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
SIZE = 48 * MIB  # under the limit (64 MiB): three at once
# A server that reads each body (Content-Length or chunked) and answers how long it was,
# and the first bytes of it.
SINK = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        n, first = 0, b""
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while (size := int(self.rfile.readline().split(b";")[0], 16)):
                left = size
                while left:
                    got = self.rfile.read(min(left, 1 << 20))
                    first, n, left = (first + got[:200])[:200], n + len(got), left - len(got)
                self.rfile.readline()
            self.rfile.readline()
        else:
            left = int(self.headers["Content-Length"])
            while left:
                got = self.rfile.read(min(left, 1 << 20))
                first, n, left = (first + got[:200])[:200], n + len(got), left - len(got)
        body = json.dumps({"received": n, "path": self.path,
                           "first": first.decode("latin-1")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def serve(spawn: Spawn, tmp_path: Path, arena: Path) -> tuple[int, int]:
    """serve with one model, ``sink`` (SINK), started and answering: (port, pid)."""
    script = tmp_path / "sink.py"
    script.write_text(SINK)
    path = tmp_path / "serve.yaml"
    path.write_text(f"startPort: {free_port()}\nmodels:\n  sink:\n"
                    f"    cmd: {sys.executable} {script} ${{PORT}}\n"
                    "    checkEndpoint: none\n    release: restart\n")  # fmt: skip
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving" in proc.stderr.readline()
    status, got = post(port, "/v1/completions", b'{"model": "sink"}')
    assert (status, got["received"]) == (200, 17)
    return port, proc.pid


def post(
    port: int, path: str, body: bytes | Iterator[bytes], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        chunked = not isinstance(body, bytes)
        conn.request("POST", path, body=body, headers=headers or {}, encode_chunked=chunked)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def peak_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def growth(pid: int, send: Callable[[int], tuple[int, Any]]) -> tuple[float, list[Any]]:
    """How much serve's peak memory grew (MiB) while ``send(i)`` ran for i in 0..2 at once;
    the answers."""
    before = peak_mib(pid)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(send, range(3)))
    return peak_mib(pid) - before, answers


def pieces(n: int, first: bytes = b"") -> Iterator[bytes]:
    """``first``, then ``n`` bytes of x, a MiB at a time."""
    yield first
    for _ in range(n // MIB):
        yield b"x" * MIB


def test_a_large_json_body_is_held_once(serve: tuple[int, int]) -> None:
    port, pid = serve
    # the model after the large member: skipped over, never decoded
    body = b'{"prompt": "' + b"x" * SIZE + b'", "model": "sink"}'
    grew, answers = growth(pid, lambda i: post(port, "/v1/completions", body))
    assert answers == [(200, {"received": len(body), "path": "/v1/completions",
                              "first": body[:200].decode()})] * 3  # fmt: skip
    # three bodies of 48 MiB at once: held once each (read whole, the JSON parsed and
    # the body copied: 2-3 times each)
    assert grew < 3 * SIZE / MIB * 1.4, f"serve's peak grew {grew:.0f} MiB"


def test_an_upstream_body_is_passed_on_as_it_comes(serve: tuple[int, int]) -> None:
    port, pid = serve
    grew, answers = growth(pid, lambda i: post(port, "/upstream/sink/upload", pieces(SIZE)))
    assert [(s, a["received"], a["path"]) for s, a in answers] == [(200, SIZE, "/upload")] * 3
    assert grew < 40, f"serve's peak grew {grew:.0f} MiB"


FORM = (
    b"--XyZ\r\n"
    b'Content-Disposition: form-data; name="model"\r\n\r\n'
    b"sink\r\n"
    b"--XyZ\r\n"
    b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
    b"Content-Type: audio/wav\r\n\r\n"
)


def test_a_form_is_routed_by_its_model_field_and_passed_on(serve: tuple[int, int]) -> None:
    port, pid = serve
    end = b"\r\n--XyZ--\r\n"
    length = len(FORM) + SIZE + len(end)
    headers = {"Content-Type": "multipart/form-data; boundary=XyZ", "Content-Length": str(length)}

    def send(i: int) -> tuple[int, Any]:
        def body() -> Iterator[bytes]:
            yield from pieces(SIZE, FORM)
            yield end

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/audio/transcriptions", body=body(), headers=headers)
            reply = conn.getresponse()
            return reply.status, json.loads(reply.read())
        finally:
            conn.close()

    grew, answers = growth(pid, send)
    first = (FORM + b"x" * 200)[:200].decode()
    want = {"received": length, "path": "/v1/audio/transcriptions", "first": first}
    assert answers == [(200, want)] * 3
    assert grew < 40, f"serve's peak grew {grew:.0f} MiB"


@pytest.mark.parametrize(
    ("form", "why"),
    [
        (b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nx\r\n'
         b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nsink\r\n--XyZ--\r\n',
         "file first"),
        (b'--XyZ\r\nContent-Disposition: form-data; name="language"\r\n\r\nen\r\n--XyZ--\r\n',
         "no model"),
    ],
    ids=["file-first", "no-model"],
)  # fmt: skip
def test_a_form_without_a_model_field_first_is_refused_400(
    serve: tuple[int, int], form: bytes, why: str
) -> None:
    port, _ = serve
    status, got = post(port, "/v1/audio/transcriptions", form,
                       {"Content-Type": "multipart/form-data; boundary=XyZ"})  # fmt: skip
    assert (status, got["error"]["message"]) == (
        400, "the form must have a model field, before any file and within its first 1 MiB"
    ), why  # fmt: skip


def test_a_streamed_body_over_the_limit_is_cut_413(serve: tuple[int, int]) -> None:
    from vramlock.serve.reading import MAX_BODY

    port, _ = serve
    message = f"the request body is over {MAX_BODY >> 20} MiB"
    # chunked, so said by no Content-Length: refused once over, as it passes
    status, got = post(port, "/upstream/sink/upload", pieces(MAX_BODY + MIB))
    assert (status, got["error"]["message"]) == (413, message)
    # the limit counts the form's every byte, its model field's too
    headers = {"Content-Type": "multipart/form-data; boundary=XyZ"}
    status, got = post(port, "/v1/audio/transcriptions", pieces(MAX_BODY, FORM), headers)
    assert (status, got["error"]["message"]) == (413, message)
    # and the model's server is still there for the next
    assert post(port, "/upstream/sink/next", b"ok")[1]["received"] == 2


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (b'{"model": "a"}', "a"),
        (b' {\n"messages": [{"content": "say \\"}\\" [", "x": {}}],'
         b' "model" : "b\\u00e9"}', "b\u00e9"),
        (b'{"n": -1.5e3, "ok": true, "none": null, "model": "c", "model2": 1}', "c"),
        (b'{"stream": false}', None),
        (b"{}", None),
        (b'{"model": 7}', 7),
        (b'{"text": "a\\\\", "model": "d"}', "d"),  # a string that ends in a backslash
    ],
)  # fmt: skip
def test_the_json_model_is_found_without_decoding_the_rest(body: bytes, model: object) -> None:
    from vramlock.serve.body import json_model

    assert json_model(body) == model
    assert json_model(bytearray(body)) == model


@pytest.mark.parametrize(
    "body", [b"", b"[]", b'"model"', b'{"a": "b', b'{"a": [1, 2}', b'{"a" "b"}', b'{"a": 1 "b": 2}']
)
def test_what_is_no_json_object_is_malformed(body: bytes) -> None:
    from vramlock.serve.body import Malformed, json_model

    with pytest.raises(Malformed):
        json_model(body)


@pytest.mark.parametrize(
    "field",
    ["X-A: 1\nX-Injected: yes", "X-A: 1\rX-Injected: yes", "X-A: 1\0", "X-A\n: 1"],
    ids=["bare-LF", "bare-CR", "NUL", "LF-in-name"],
)
def test_a_head_with_a_bare_cr_or_lf_is_left_to_aiohttp(field: str) -> None:
    """serve's own parser takes no head that aiohttp would refuse: a bare CR or LF inside
    a field would otherwise reach the model's server as a header of its own."""
    from vramlock.serve.front import parse_head

    def head(extra: str) -> bytes:
        return f"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n{extra}".encode("latin-1")

    assert parse_head(head("X-A: 1"), lambda path: True) is not None
    assert parse_head(head(field), lambda path: True) is None
