"""Where a request body names its model, found without holding the body twice.

A JSON body's ``model`` is the top-level member of that name: the other members are
skipped over (strings by their closing quote, arrays and objects by their brackets),
never decoded, so that a large prompt or image costs the bytes received and nothing more.
A ``multipart/form-data`` body's is its ``model`` field, which must come before the
parts that make the body large (as clients send it: the fields, then the files).
"""

from __future__ import annotations

import json
import re

_WS = re.compile(rb"[ \t\r\n]*")
_BRACKET_OR_QUOTE = re.compile(rb'["\[\]{}]')
_SCALAR = re.compile(rb"[^,}\]\s]*")
_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_FIELD_NAME = re.compile(rb'\bname="?([^";\r\n]*)"?', re.IGNORECASE)


class Malformed(ValueError):
    """Not the JSON object, or the form, that the scan expects."""


def _string_end(data: bytes | bytearray, quote: int) -> int:
    """The index after the string that opens at ``quote``."""
    i = quote + 1
    while True:
        end = data.find(b'"', i)
        if end < 0:
            raise Malformed("an unterminated string")
        backslashes = 0
        while data[end - 1 - backslashes] == 0x5C:
            backslashes += 1
        if backslashes % 2 == 0:
            return end + 1
        i = end + 1


def _value_end(data: bytes | bytearray, start: int) -> int:
    """The index after the JSON value that starts at ``start``."""
    if start >= len(data):
        raise Malformed("a member without a value")
    first = data[start]
    if first == 0x22:  # "
        return _string_end(data, start)
    if first not in (0x5B, 0x7B):  # [ {
        found = _SCALAR.match(data, start)
        assert found is not None  # the pattern matches the empty string
        return found.end()
    depth, i = 0, start
    while True:
        token = _BRACKET_OR_QUOTE.search(data, i)
        if token is None:
            raise Malformed("an unclosed array or object")
        char = data[token.start()]
        if char == 0x22:
            i = _string_end(data, token.start())
            continue
        depth += 1 if char in (0x5B, 0x7B) else -1
        i = token.end()
        if depth == 0:
            return i


def _skip_ws(data: bytes | bytearray, i: int) -> int:
    found = _WS.match(data, i)
    assert found is not None
    return found.end()


def json_model(data: bytes | bytearray) -> object:
    """The value of the top-level ``model`` member of the JSON object ``data`` (None if
    it has none); Malformed when ``data`` is not a JSON object as far as the scan goes."""
    i = _skip_ws(data, 0)
    if data[i : i + 1] != b"{":
        raise Malformed("not a JSON object")
    i = _skip_ws(data, i + 1)
    if data[i : i + 1] == b"}":
        return None
    while True:
        if data[i : i + 1] != b'"':
            raise Malformed("a member without a name")
        key_end = _string_end(data, i)
        key = json.loads(data[i:key_end])
        i = _skip_ws(data, key_end)
        if data[i : i + 1] != b":":
            raise Malformed("a member without a colon")
        start = _skip_ws(data, i + 1)
        end = _value_end(data, start)
        if key == "model":
            return json.loads(data[start:end])
        i = _skip_ws(data, end)
        if data[i : i + 1] == b"}":
            return None
        if data[i : i + 1] != b",":
            raise Malformed("members without a comma")
        i = _skip_ws(data, i + 1)


def boundary(content_type: str) -> bytes | None:
    """A ``multipart/form-data`` Content-Type's boundary; None for any other type."""
    if not content_type.lower().lstrip().startswith("multipart/form-data"):
        return None
    found = _BOUNDARY.search(content_type)
    return found.group(1).encode("latin-1") if found else None


def form_with_model(prefix: bytes | bytearray, mark: bytes, model: str) -> bytes:
    """``prefix`` (a form's first bytes, its ``model`` field whole in them) with that
    field's value ``model``: llama-swap's useModelName for a form."""
    delimiter = b"--" + mark
    parts = bytes(prefix).split(delimiter)
    for i, part in enumerate(parts[1:-1], 1):
        head, sep, _ = part.partition(b"\r\n\r\n")
        disposition = b"".join(
            h for h in head.split(b"\r\n") if h.lower().startswith(b"content-disposition:")
        )
        name = _FIELD_NAME.search(disposition)
        if name is not None and name.group(1) == b"model":
            parts[i] = head + sep + model.encode() + b"\r\n"
            break
    return delimiter.join(parts)


def form_model(prefix: bytes | bytearray, mark: bytes) -> str | None:
    """The ``model`` field of a multipart form whose first bytes are ``prefix`` (its
    boundary ``mark``), once the field is whole in them; None while it is not (more of
    the body may complete it). Malformed when a part other than fields comes first."""
    delimiter = b"--" + mark
    parts = bytes(prefix).split(delimiter)
    for part in parts[1:-1]:  # each followed by a delimiter: whole
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            raise Malformed("a part without a header")
        disposition = next(
            (h for h in head.split(b"\r\n") if h.lower().startswith(b"content-disposition:")),
            b"",
        )
        name = _FIELD_NAME.search(disposition)
        if name is not None and name.group(1) == b"model":
            return value.removesuffix(b"\r\n").decode("utf-8", "replace")
        if b"filename=" in disposition.lower():
            raise Malformed("a file before the model field")
    return None
