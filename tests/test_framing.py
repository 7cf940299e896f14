"""HTTP/1.1 message boundaries, fed whole and a byte at a time."""

from __future__ import annotations

from collections import deque

import pytest

from vramlock.net.framing import Framing

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nT: 1\r\n\r\n"
)


def pair() -> tuple[Framing, Framing]:
    methods: deque[bytes] = deque()
    return Framing(responses=False, methods=methods), Framing(
        responses=True, methods=methods, body=bytearray()
    )


def feed(framing: Framing, data: bytes, bytewise: bool) -> None:
    if bytewise:
        for i in range(len(data)):
            framing.feed(data[i : i + 1])
    else:
        framing.feed(data)


@pytest.mark.parametrize("bytewise", [False, True])
def test_pipelined_requests_and_their_responses(bytewise: bool) -> None:
    requests, responses = pair()
    feed(requests, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n\r\nHEAD /b HTTP/1.1\r\n\r\n", bytewise)
    feed(requests, b"POST /c HTTP/1.1\r\nContent-Length: 3\r\n\r\nab", bytewise)
    assert (requests.started, requests.done) == (3, 2)  # the POST's body is not all there
    feed(requests, b"c", bytewise)
    assert (requests.started, requests.done) == (3, 3)
    feed(responses, b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED, bytewise)
    assert responses.done == 1 and bytes(responses.body or b"") == b"hello"
    # HEAD: a length, and no body.
    feed(responses, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", bytewise)
    assert responses.done == 2
    feed(responses, b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", bytewise)
    assert (responses.done, responses.status, responses.opaque) == (3, 201, False)
    assert not requests.methods


@pytest.mark.parametrize(
    ("status", "body_follows"), [(b"204 No Content", False), (b"304 Not Modified", False),
                                 (b"200 OK", True)]
)  # fmt: skip
def test_a_response_without_length_ends_with_the_connection(
    status: bytes, body_follows: bool
) -> None:
    requests, responses = pair()
    requests.feed(b"GET / HTTP/1.1\r\n\r\n")
    responses.feed(b"HTTP/1.1 " + status + b"\r\n\r\n")
    assert responses.done == (0 if body_follows else 1)
    responses.feed(b"until the end" if body_follows else b"")
    responses.end()
    assert responses.done == 1


@pytest.mark.parametrize(
    ("request_bytes", "response_bytes"),
    [
        (b"\x16\x03\x01\x02\x00", b""),  # TLS
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b""),  # HTTP/2
        (b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n", b"HTTP/1.1 101 Switching\r\n\r\n"),
        (b"CONNECT h:443 HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n"),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", b""),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 20000, b""),  # a head too large
    ],
)
def test_what_is_not_plain_http_is_opaque(request_bytes: bytes, response_bytes: bytes) -> None:
    requests, responses = pair()
    requests.feed(request_bytes)
    responses.feed(response_bytes)
    assert requests.opaque or responses.opaque
