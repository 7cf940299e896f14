"""``vramlock serve``'s llama-swap activity: /api/metrics/activity, /api/metrics/stats and
/api/captures/ID, in llama-swap's shapes.

The models are tests/echo_server.py, which puts a request's ``reply`` members in its
answer (the usage, llama-server's timings...): what a server reports, recorded as
llama-swap records it. The usage reading itself is tested on its own at the end.
"""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import Spawn
from helpers.serve import call, call_json, echo_model, start, write_config

pytest.importorskip("aiohttp")

from multidict import MultiDict

from vramlock.serve.activity import TAIL, Activity, Query, histogram, rfc3339
from vramlock.serve.inflight import Flights

pytestmark = pytest.mark.timeout(90)

# What llama-server says of a chat: OpenAI's usage, and its own timings.
LLAMA = {
    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    "timings": {"prompt_n": 12, "predicted_n": 8, "cache_n": 4, "prompt_ms": 30.0,
                "predicted_ms": 4000.0, "prompt_per_second": 400.0,
                "predicted_per_second": 2.0},
}  # fmt: skip
TOKENS = ("cache_tokens", "draft_tokens", "draft_acc_tokens", "input_tokens", "output_tokens",
          "prompt_per_second", "tokens_per_second")  # fmt: skip


def serve(spawn: Spawn, tmp_path: Path, arena: Path, top: str = "") -> int:
    text = top + "models:\n" + echo_model("m", "release: restart") + echo_model("b")
    return start(spawn, write_config(tmp_path, text), arena)[1]


def tokens(entry: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(entry["tokens"][k] for k in TOKENS)


def test_each_answered_post_is_recorded_with_its_usage(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = serve(spawn, tmp_path, arena)
    assert call_json(port, "GET", "/api/metrics/activity") == {
        "data": [], "page": 1, "limit": 25, "total": 0, "total_pages": 0}  # fmt: skip
    call_json(port, "POST", "/v1/chat/completions", {"model": "m", "reply": LLAMA})
    openai = {"usage": {"prompt_tokens": 5, "completion_tokens": 2,
                        "prompt_tokens_details": {"cached_tokens": 3}}}  # fmt: skip
    status, _, _ = call(port, "POST", "/v1/chat/completions",
                        {"model": "m", "stream": True, "reply": openai})  # fmt: skip
    assert status == 200
    failed = {"error": {"message": "the prompt is too long"}}
    assert call(port, "POST", "/v1/completions", {"model": "m", "status": 400,
                                                  "reply": failed})[0] == 400  # fmt: skip
    call_json(port, "POST", "/upstream/b/v1/embeddings", {"input": "x"})  # recorded too
    call_json(port, "GET", "/upstream/b/slots")  # not a POST: not recorded, as llama-swap's
    assert call(port, "POST", "/v1/completions", {"model": "nobody"})[0] == 404  # not routed
    page = call_json(port, "GET", "/api/metrics/activity")
    assert (page["total"], page["total_pages"]) == (4, 1)
    embed, fail, stream, chat = page["data"]
    assert set(chat) == {"id", "timestamp", "model", "req_path", "resp_content_type",
                         "resp_status_code", "tokens", "duration_ms", "has_capture",
                         "metadata"}  # fmt: skip
    assert [e["id"] for e in page["data"]] == [4, 3, 2, 1]
    assert (chat["model"], chat["req_path"], chat["resp_status_code"]) == (
        "m", "/v1/chat/completions", 200)  # fmt: skip
    assert chat["resp_content_type"] == "application/json"
    assert chat["timestamp"][:2] == "20" and chat["timestamp"][19] in "Z+-"  # to the second
    # llama-server's timings win over the usage, and its time is the request's at least
    assert tokens(chat) == (4, -1, -1, 12, 8, 400.0, 2.0)
    assert chat["duration_ms"] >= 4030
    assert (chat["has_capture"], chat["metadata"]) == (True, {"fifo_priority": "0"})
    assert "error_msg" not in chat
    assert stream["resp_content_type"] == "text/event-stream"
    assert tokens(stream) == (3, -1, -1, 5, 2, -1, -1)  # the stream's last usage
    assert (fail["resp_status_code"], fail["error_msg"]) == (400, "the prompt is too long")
    assert tokens(fail) == (0,) * 7
    assert (embed["model"], embed["req_path"]) == ("b", "/v1/embeddings")
    assert tokens(embed) == (0,) * 7  # it said no usage


def test_the_page_is_asked_for_as_llama_swap_s(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port = serve(spawn, tmp_path, arena)
    for i, model in enumerate(["m", "b", "m", "b", "m"]):
        usage = {"usage": {"prompt_tokens": 10 - i, "completion_tokens": i}}
        call_json(port, "POST", "/v1/completions", {"model": model, "reply": usage})

    def ids(query: str) -> list[int]:
        return [e["id"] for e in call_json(port, "GET", f"/api/metrics/activity{query}")["data"]]

    assert ids("") == [5, 4, 3, 2, 1]
    assert ids("?model=b") == [4, 2]
    assert ids("?model=b&model=m&order=asc") == [1, 2, 3, 4, 5]
    assert ids("?min_id=2&max_id=4") == [4, 3, 2]
    assert ids("?sort=prompt&order=asc") == [5, 4, 3, 2, 1]
    assert ids("?sort=model") == [5, 3, 1, 4, 2]  # by model, then by id, both descending
    page = call_json(port, "GET", "/api/metrics/activity?limit=2&page=3")
    assert ([e["id"] for e in page["data"]], page["total"], page["total_pages"]) == ([1], 5, 3)
    first = call_json(port, "GET", "/api/metrics/activity?order=asc&limit=1")["data"][0]
    assert ids(f"?start={first['timestamp'].replace('+', '%2B')}")[-1] == 1  # inclusive
    assert ids("?end=2000-01-01T00:00:00Z") == []
    for query, message in [
        ("?limit=0", "limit must be between 1 and 999"), ("?limit=x", "invalid limit"),
        ("?page=0", "page must be >= 1"), ("?sort=colour", "invalid sort column"),
        ("?order=up", "order must be asc or desc"), ("?min_id=0", "min_id must be >= 1"),
        ("?min_id=4&max_id=2", "min_id must be <= max_id"),
        ("?start=yesterday", "invalid 'start' timestamp, use RFC3339 format"),
        ("?end=2026-01-01", "invalid 'end' timestamp, use RFC3339 format"),
        ("?start=2026-02-01T00:00:00Z&end=2026-01-01T00:00:00Z", "start must be before end"),
    ]:  # fmt: skip
        status, _, body = call(port, "GET", f"/api/metrics/activity{query}")
        assert (status, json.loads(body)["error"]["message"]) == (400, message), query


def test_stats_total_the_tokens_with_the_speeds_histograms(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = serve(spawn, tmp_path, arena)
    empty = call_json(port, "GET", "/api/metrics/stats")
    assert empty == {"total_requests": 0, "total_input_tokens": 0, "total_output_tokens": 0,
                     "total_cache_tokens": 0, "prompt_histogram": None,
                     "gen_histogram": None}  # fmt: skip
    for speed in (10.0, 20.0, 30.0, 40.0, 50.0):
        timings = {"prompt_n": 3, "predicted_n": 2, "cache_n": 1,
                   "prompt_per_second": speed, "predicted_per_second": speed / 10}  # fmt: skip
        call_json(
            port, "POST", "/v1/chat/completions", {"model": "m", "reply": {"timings": timings}}
        )
    call_json(port, "POST", "/v1/chat/completions", {"model": "b"})
    stats = call_json(port, "GET", "/api/metrics/stats?model=m")
    assert stats["total_requests"] == 5
    assert (stats["total_input_tokens"], stats["total_output_tokens"]) == (15, 10)
    assert stats["total_cache_tokens"] == 5
    assert stats["prompt_histogram"] == {"bins": [1, 1, 1, 1, 1], "min": 10.0, "max": 50.0,
                                         "binSize": 8.0, "p50": 30.0, "p95": 48.0,
                                         "p99": 49.6}  # fmt: skip
    assert stats["gen_histogram"]["min"] == 1.0
    assert call_json(port, "GET", "/api/metrics/stats")["total_requests"] == 6


def test_a_capture_holds_the_request_and_its_answer(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = serve(spawn, tmp_path, arena)
    asked = {"model": "m", "stream": True}
    call(port, "POST", "/v1/chat/completions", asked, {"Authorization": "Bearer sk-x"})
    capture = call_json(port, "GET", "/api/captures/1")
    assert set(capture) == {"id", "req_path", "req_headers", "req_body", "resp_headers",
                            "resp_body"}  # fmt: skip
    assert (capture["id"], capture["req_path"]) == (1, "/v1/chat/completions")
    assert capture["req_headers"]["Authorization"] == "[REDACTED]"
    assert json.loads(base64.b64decode(capture["req_body"])) == asked
    assert capture["resp_headers"]["Content-Type"] == "text/event-stream"
    said = base64.b64decode(capture["resp_body"]).decode()
    assert said.startswith('data: {"choices"') and said.endswith("data: [DONE]\n\n")
    # a failure keeps its request only (its message is the entry's error_msg)
    call(port, "POST", "/v1/completions", {"model": "m", "status": 500})
    failed = call_json(port, "GET", "/api/captures/2")
    assert failed["resp_body"] is None and failed["req_body"] is not None
    # large binary payloads are left out, as llama-swap leaves them
    call(port, "POST", "/v1/audio/speech", {"model": "m", "input": "hello"})
    speech = call_json(port, "GET", "/api/captures/3")
    assert speech["resp_body"] is None and speech["resp_headers"] is not None
    for path, status, message in [("/api/captures/9", 404, "capture not found"),
                                  ("/api/captures/one", 400, "invalid capture ID")]:  # fmt: skip
        got, _, body = call(port, "GET", path)
        assert (got, json.loads(body)["error"]["message"]) == (status, message)


def test_capture_buffer_and_metrics_max_in_memory_bound_what_is_kept(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = serve(spawn, tmp_path, arena, "metricsMaxInMemory: 2\ncaptureBuffer: 0\n")
    for _ in range(3):
        call_json(port, "POST", "/v1/completions", {"model": "m"})
    page = call_json(port, "GET", "/api/metrics/activity")
    assert [(e["id"], e["has_capture"]) for e in page["data"]] == [(3, False), (2, False)]
    assert call(port, "GET", "/api/captures/3")[0] == 404


def test_every_new_route_wants_the_api_key(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port = serve(spawn, tmp_path, arena, "apiKeys: [sk-1]\n")
    key = {"x-api-key": "sk-1"}
    call_json(port, "POST", "/v1/completions", {"model": "m"}, headers=key)
    for method, path, answered in [
        ("GET", "/api/metrics/activity", 200), ("GET", "/api/metrics/stats", 200),
        ("GET", "/api/captures/1", 200), ("GET", "/api/hardware", 200),
        ("GET", "/api/performance", 200), ("POST", "/api/inflight/1/cancel", 404),
    ]:  # fmt: skip
        status, headers, body = call(port, method, path)
        assert (status, json.loads(body)["error"]["type"]) == (401, "authentication_error"), path
        assert headers["WWW-Authenticate"] == 'Basic realm="vramlock"'
        assert call(port, method, path, headers=key)[0] == answered, path


# -- the usage, read from the end of an answer -------------------------------------------


def _recorded(
    chunks: list[bytes], *, status: int = 200, kind: str = "application/json",
    path: str = "/v1/chat/completions", encoding: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The entry of one request whose answer came in ``chunks``."""
    activity = Activity(capture_bytes=0)
    flights = Flights(activity.record, activity.keep_bytes)
    flight = flights.start("m", "POST", path, [], None, b"{}")
    headers = [("Content-Type", kind)] + ([("Content-Encoding", encoding)] if encoding else [])
    flight.head(status, headers)
    for chunk in chunks:
        flight.took(chunk)
    flights.end(flight, str(status))
    entry: dict[str, Any] = activity.page(Query(MultiDict()))["data"][0]
    return entry


def _events(*docs: object) -> list[bytes]:
    return [f"data: {json.dumps(d)}\n\n".encode() for d in docs] + [b"data: [DONE]\n\n"]


def test_the_usage_of_a_long_stream_is_its_last_event_s() -> None:
    filler = [{"choices": [{"delta": {"content": "x" * 1000}}]}] * 200  # far past TAIL
    last = {"usage": {"input_tokens": 9, "output_tokens": 4, "cache_read_input_tokens": 2},
            "timings": {"prompt_n": 9, "predicted_n": 200, "prompt_per_second": 90.0,
                        "predicted_per_second": 30.0, "draft_n": 50,
                        "draft_n_accepted": 40}}  # fmt: skip
    entry = _recorded(_events(*filler, last), kind="text/event-stream")
    assert tokens(entry) == (2, 50, 40, 9, 200, 90.0, 30.0)  # the usage's cache: no cache_n


def test_the_usage_of_a_long_json_answer_is_found_near_its_end() -> None:
    body = json.dumps({"choices": [{"text": "y" * (3 * TAIL)}], "usage": {
        "prompt_tokens": 100, "completion_tokens": 50}}).encode()  # fmt: skip
    assert tokens(_recorded([body[:TAIL], body[TAIL:]])) == (-1, -1, -1, 100, 50, -1, -1)


def test_vllm_s_metrics_give_the_speeds_and_drafts() -> None:
    answer = {"usage": {"prompt_tokens": 120, "completion_tokens": 10,
                        "prompt_tokens_details": {"cached_tokens": 20}},
              "metrics": {"time_to_first_token_ms": 50.0, "mean_itl_ms": 25.0,
                          "speculative_decoding": {"num_draft_tokens": 12,
                                                   "num_accepted_draft_tokens": 9}}}  # fmt: skip
    assert tokens(_recorded([json.dumps(answer).encode()])) == (20, 12, 9, 120, 10, 2000.0, 40.0)


def test_a_compressed_answer_and_infill_s_list_are_read() -> None:
    usage = {"usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    zipped = gzip.compress(json.dumps(usage).encode())
    assert tokens(_recorded([zipped], encoding="gzip"))[3:5] == (3, 1)
    infill = [{"content": "a"}, {"content": "b", "timings": {"prompt_n": 7, "predicted_n": 2}}]
    entry = _recorded([json.dumps(infill).encode()], path="/infill")
    assert tokens(entry)[3:5] == (7, 2)


def test_a_failure_says_its_message_or_its_status() -> None:
    long = {"detail": "z" * 600}
    assert _recorded([json.dumps(long).encode()], status=422)["error_msg"] == "z" * 500 + "..."
    assert _recorded([b"<html>oops</html>"], status=503)["error_msg"] == "503 Service Unavailable"
    assert _recorded([], status=599)["error_msg"] == "HTTP 599"


def test_histograms_and_times_as_llama_swap_s() -> None:
    assert histogram([]) is None
    assert histogram([7.0, 7.0]) == {"bins": [2], "min": 7.0, "max": 7.0, "binSize": 0,
                                     "p50": 7.0, "p95": 7.0, "p99": 7.0}  # fmt: skip
    spread = histogram([float(v) for v in range(1, 101)])
    assert spread is not None and len(spread["bins"]) == 8 and sum(spread["bins"]) == 100
    assert rfc3339("2026-01-02T03:04:05Z") == 1767323045.0
    assert rfc3339("2026-01-02T04:04:05.5+01:00") == 1767323045.5
    for bad in ("2026-01-02", "2026-01-02T03:04:05", "2026-01-02 03:04:05Z", "now"):
        assert rfc3339(bad) is None, bad
