"""llama-swap's server tests (its ``internal/server`` apigroup, auth, logs and
llama-swap.go's own behaviour), as cases against a real ``vramlock serve``.

The models are tests/echo_server.py; a request it is asked to hold (``"hold": true``)
stays in progress until serve ends it, and the echo server says so in its output.
"""

from __future__ import annotations

import http.client
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.conformance import Reply, Served, case, echo, serving
from helpers.net import accepts
from helpers.processes import wait_until
from helpers.serve import Events

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(120)

ACTIVITY = (
    "performance: {disabled: true}\n"
    "hooks: {on_startup: {preload: [m3]}}\n"
    "peers: {far: {proxy: 'http://127.0.0.1:9', models: [comfyui_auto]}}\n"
    "models:\n" + echo("m1") + echo("m2") + echo("m3")
)  # fmt: skip


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("api"), ACTIVITY) as served:
        yield served


def page(served: Served, query: str = "") -> Reply:
    return served.ask("GET", "/api/metrics/activity" + query)


def ids(served: Served, query: str) -> list[int]:
    reply = page(served, query)
    assert reply.status == 200, reply
    doc = reply.json()
    assert doc["total"] == len(doc["data"])
    return [e["id"] for e in doc["data"]]


@pytest.mark.parametrize("_", [case("apigroup/metrics-activity-empty", None)])
def test_activity_is_empty_before_any_request(api: Served, _: None) -> None:
    doc = page(api).json()
    assert (doc["total"], doc["data"]) == (0, [])


# Each request's tokens (in, out, cached) and speeds (prompt, generation), as llama-server
# says them.
@pytest.mark.parametrize("_", [case("server/preload", None)])
def test_a_preloaded_model_starts_with_serve(api: Served, _: None) -> None:
    wait_until(lambda: "m3" in running(api), 30)
    assert page(api).json()["total"] == 0  # asked for by no request


USAGE = [(1, 2, 1, 10, 20), (5, 6, 0, 50, 0), (3, 4, 0, 30, 40), (7, 8, 0, 0, 0)]


@pytest.fixture(scope="module")
def recorded(api: Served) -> None:
    """Requests 1..4, for m1, m2, m1, m3, each with its usage."""
    for model, (i, o, c, pps, tps) in zip(["m1", "m2", "m1", "m3"], USAGE, strict=True):
        usage = {"prompt_tokens": i, "completion_tokens": o}
        timings = {
            "prompt_n": i,
            "predicted_n": o,
            "cache_n": c,
            "prompt_per_second": pps,
            "predicted_per_second": tps,
        }
        assert api.chat(model, reply={"usage": usage, "timings": timings}).status == 200
    wait_until(lambda: page(api).json()["total"] == 4)


FILTERED = [
    case("apigroup/activity-filter-repeated-model", "?model=m1&model=m3", [4, 3, 1]),
    case("apigroup/activity-filter-single-model", "?model=m2", [2]),
    case("apigroup/activity-filter-id-range", "?min_id=2&max_id=3", [3, 2]),
    case("apigroup/activity-filter-min-id", "?min_id=4", [4]),
    case("apigroup/activity-filter-max-id", "?max_id=2", [2, 1]),
    case("apigroup/activity-filter-id-and-model", "?model=m1&min_id=2", [3]),
    case("apigroup/activity-filter-none", "", [4, 3, 2, 1]),
    case("apigroup/metrics-activity-model-page", "?model=m1&limit=10&page=1", [3, 1]),
]  # fmt: skip


@pytest.mark.parametrize(("query", "want"), FILTERED)
def test_activity_filters(api: Served, recorded: None, query: str, want: list[int]) -> None:
    assert ids(api, query) == want


INVALID = ["?min_id=abc", "?max_id=0", "?min_id=-1", "?min_id=9&max_id=2", "?start=nonsense",
           "?end=2026-01-01", "?start=2026-02-01T00:00:00Z&end=2026-01-01T00:00:00Z"]  # fmt: skip


@pytest.mark.parametrize(
    "query", [case(f"apigroup/activity-invalid-filter-{i}", q) for i, q in enumerate(INVALID)]
)
def test_activity_refuses_a_bad_filter(api: Served, query: str) -> None:
    assert page(api, query).status == 400


@pytest.mark.parametrize("_", [case("apigroup/metrics-stats", None)])
def test_stats_of_one_model(api: Served, recorded: None, _: None) -> None:
    reply = api.ask("GET", "/api/metrics/stats?model=m1")
    assert reply.status == 200
    stats = reply.json()
    assert (stats["total_requests"], stats["total_input_tokens"], stats["total_output_tokens"],
            stats["total_cache_tokens"]) == (2, 4, 6, 1)  # fmt: skip
    assert stats["prompt_histogram"] is not None and stats["gen_histogram"] is not None


UPSTREAM_METRICS = [
    case("api/upstream-metrics-supported-path", "POST", "/upstream/m1/v1/chat/completions", 1),
    case("api/upstream-metrics-skips-unsupported-path", "POST", "/upstream/m1/probe", 0),
    case("api/upstream-metrics-skips-get", "GET", "/upstream/m1/v1/chat/completions", 0),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "more"), UPSTREAM_METRICS)
def test_upstream_requests_recorded(
    api: Served, recorded: None, method: str, path: str, more: int
) -> None:
    before = page(api).json()["total"]
    body = {"reply": {"usage": {"prompt_tokens": 3, "completion_tokens": 5}}}
    reply = api.ask(method, path, body if method == "POST" else None)
    assert reply.status == 200
    if more:
        wait_until(lambda: page(api).json()["total"] == before + 1)
        entry = page(api).json()["data"][0]
        assert (entry["model"], entry["req_path"]) == ("m1", "/v1/chat/completions")
        assert (entry["tokens"]["input_tokens"], entry["tokens"]["output_tokens"]) == (3, 5)
    else:
        api.chat("m2")  # recorded after it, were it recorded
        wait_until(lambda: page(api).json()["data"][0]["model"] == "m2")
        assert page(api).json()["total"] == before + 1


# -- requests in flight (apigroup: InflightMiddleware, cancel; api: upstream inflight) ---


class Flight:
    """A request held by its echo model until serve ends it, and what serve says of it."""

    def __init__(
        self, served: Served, method: str, path: str, headers: dict[str, str], stream: bool = False
    ):
        self.events = Events(served.port)
        self.events.until("inflight")  # the snapshot
        self.reply: list[Reply] = []
        body = {"model": "m1", "hold": True, "stream": stream}
        self.thread = threading.Thread(target=lambda: self.reply.append(
            served.ask(method, path, body, headers)))  # fmt: skip
        self.thread.start()

    def added(self) -> dict[str, Any]:
        data = self.events.until("inflight", lambda d: d["operation"] == "upsert")
        entry: dict[str, Any] = data["request"]
        return entry

    def end(self, served: Served, entry: dict[str, Any]) -> None:
        assert served.ask("POST", f"/api/inflight/{entry['id']}/cancel").status == 200
        self.thread.join(30)
        self.events.close()


HEADERS = {"User-Agent": "test-agent", "Authorization": "Bearer secret",
           "X-Forwarded-For": "203.0.113.9, 10.0.0.1"}  # fmt: skip
INFLIGHT = [
    case("apigroup/inflight-entry-model-method-path", "POST", "/v1/chat/completions",
         lambda e: (e["model"], e["method"], e["req_path"]) == ("m1", "POST",
                                                                 "/v1/chat/completions")),
    case("apigroup/inflight-entry-remote-ip", "POST", "/v1/chat/completions",
         lambda e: e["remote_ip"] == "203.0.113.9"),
    case("apigroup/inflight-entry-headers-redacted", "POST", "/v1/chat/completions",
         lambda e: e["req_headers"]["User-Agent"] == "test-agent"
         and e["req_headers"]["Authorization"] == "[REDACTED]"),
    case("api/upstream-inflight-post", "POST", "/upstream/m1/v1/chat/completions",
         lambda e: (e["model"], e["req_path"]) == ("m1", "/v1/chat/completions")),
    case("api/upstream-inflight-get", "GET", "/upstream/m1/props",
         lambda e: (e["model"], e["method"], e["req_path"]) == ("m1", "GET", "/props")),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "holds"), INFLIGHT)
def test_a_request_in_flight_is_told(
    api: Served, method: str, path: str, holds: Callable[[dict[str, Any]], bool]
) -> None:
    flight = Flight(api, method, path, HEADERS)
    entry = flight.added()
    try:
        assert holds(entry), entry
    finally:
        flight.end(api, entry)


@pytest.mark.parametrize("_", [case("api/upstream-inflight-skips-unsupported-path", None)])
def test_a_probe_through_upstream_is_not_told_in_flight(api: Served, _: None) -> None:
    events = Events(api.port)
    try:
        events.until("inflight")  # the snapshot
        assert api.ask("POST", "/upstream/m1/probe", {}).status == 200
        assert api.chat("m1").status == 200  # told after it, were it told
        told = events.until("inflight", lambda d: d["operation"] == "upsert")["request"]
        assert told["req_path"] == "/v1/chat/completions", told
    finally:
        events.close()


@pytest.mark.parametrize("_", [case("apigroup/cancel-inflight", None)])
def test_a_cancelled_request_ends_at_its_model(api: Served, _: None) -> None:
    flight = Flight(api, "POST", "/v1/chat/completions", {})
    entry = flight.added()
    flight.end(api, entry)
    assert not flight.thread.is_alive()
    assert said(api, "m1", "m1 saw its client go")
    assert api.ask("POST", "/api/inflight/missing/cancel").status == 404


@pytest.mark.parametrize("_", [case("apigroup/inflight-streams-response-updates", None)])
def test_a_stream_in_flight_tells_its_headers_and_bytes(api: Served, _: None) -> None:
    first = 'data: {"choices": [{"delta": {"content": "m1"}}]}\n\n'  # then held

    def told(d: dict[str, Any]) -> bool:
        return d["operation"] == "upsert" and bool(d["request"].get("resp_bytes") == len(first))

    flight = Flight(api, "POST", "/v1/chat/completions", {}, stream=True)
    entry = flight.events.until("inflight", told)["request"]
    try:
        assert entry["resp_headers"]["Content-Type"] == "text/event-stream"
    finally:
        flight.end(api, entry)


@pytest.mark.parametrize("_", [case("apigroup/inflight-removed-after", None)])
def test_a_request_done_leaves_the_flights(api: Served, _: None) -> None:
    events = Events(api.port)
    try:
        events.until("inflight")
        assert api.chat("m1").status == 200
        added = events.until("inflight", lambda d: d["operation"] == "upsert")["request"]
        removed = events.until("inflight", lambda d: d["operation"] == "remove")
        assert removed["id"] == added["id"]
    finally:
        events.close()


def said(served: Served, model: str, line: str) -> bool:
    """Is ``line`` in the model's output, as /logs/stream/MODEL tells it?"""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request("GET", f"/logs/stream/{model}")
        reply = conn.getresponse()
        out = b""
        while line.encode() not in out:
            chunk = reply.read1(4096)
            if not chunk:
                return False
            out += chunk
        return True
    finally:
        conn.close()


def events_at_connect(served: Served) -> set[str]:
    """The types of the events /api/events sends at once (within a second of quiet)."""
    events = Events(served.port)
    assert events.conn.sock is not None
    events.conn.sock.settimeout(1)
    seen = set()
    try:
        while True:
            seen.add(events.next()[0])
    except TimeoutError:
        return seen
    finally:
        events.close()


PLAIN: list[Any] = [
    case("apigroup/api-version", lambda s: {"version", "commit", "build_date"}
         <= set(s.ask("GET", "/api/version").json())),
    case("apigroup/api-performance-unavailable", lambda s: s.ask(
        "GET", "/api/performance").status == 503),
    case("apigroup/events-initial-payload", lambda s: {"modelStatus", "inflight",
         "profileChanged", "logData"} <= events_at_connect(s)),
    case("apigroup/events-initial-ui-config", lambda s: "uiConfig" in events_at_connect(s)),
    case("apigroup/api-hardware", lambda s: (lambda r: r.status == 200 and r.json()[
        "architecture"]["name"])(s.ask("GET", "/api/hardware"))),
    case("api/comfyui-requires-local-model-missing", lambda s: s.ask(
        "GET", "/comfyui/").status == 404),
    case("api/comfyui-requires-local-model-peer", lambda s: s.ask(
        "GET", "/comfyui/").status == 404 and b"comfyui_auto" in s.ask("GET", "/comfyui/").body),
    case("log/logs-plain", lambda s: (lambda r: r.status == 200 and r.headers["Content-Type"]
         .startswith("text/plain") and b"serving m1, m2, m3" in r.body)(s.ask("GET", "/logs"))),
]  # fmt: skip


@pytest.mark.parametrize("holds", PLAIN)
def test_the_api_routes(api: Served, holds: Callable[[Served], bool]) -> None:
    assert holds(api)


# -- the request log (log_test ClientIP, RequestLogMiddleware) ---------------------------

REQUEST_LOG = [
    case("log/client-ip-remote-addr", {}, "127.0.0.1"),
    case("log/client-ip-x-forwarded-for", {"X-Forwarded-For": "1.2.3.4, 5.6.7.8"}, "1.2.3.4"),
    case("log/client-ip-x-real-ip", {"X-Real-IP": "9.9.9.9"}, "9.9.9.9"),
]  # fmt: skip


@pytest.mark.parametrize(("headers", "client"), REQUEST_LOG)
def test_a_request_s_line_names_its_client(
    api: Served, headers: dict[str, str], client: str
) -> None:
    body = {"model": "m1", "reply": {"pad": "x" * 7}}
    size = len(api.ask("POST", "/v1/chat/completions", body, headers).body)
    line = api.ask("GET", "/logs").body.decode().splitlines()[-1]
    assert "POST /v1/chat/completions" in line and " 200 " in line
    assert f'{client} "POST /v1/chat/completions" 200 {size} "' in line, line


@pytest.mark.parametrize(
    "path", [case(f"log/request-log-skips-{p.strip('/').replace('/', '-')}", p)
             for p in ("/wol-health", "/api/performance", "/metrics")]
)  # fmt: skip
def test_routine_requests_are_not_logged(api: Served, path: str) -> None:
    before = api.ask("GET", "/logs").body
    api.ask("GET", path)
    assert api.ask("GET", "/logs").body == before


# -- apiKeys (auth_test AuthMiddleware, api_test HandleComfyUI_UsesAuthentication) -------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    text = "apiKeys: [secret]\nmodels:\n" + echo("m1") + echo("comfyui_auto")
    with serving(tmp_path_factory.mktemp("keyed"), text) as served:
        yield served


BEARER = {"Authorization": "Bearer secret"}
AUTH = [
    case("auth/valid-key", "POST", "/v1/chat/completions", BEARER, 200),
    case("auth/invalid-key", "POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"},
         401),
    case("api/comfyui-unauthenticated-401", "GET", "/comfyui/", {}, 401),
    case("api/comfyui-authenticated", "GET", "/comfyui/", BEARER, 200),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "headers", "status"), AUTH)
def test_api_keys(
    keyed: Served, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    reply = keyed.ask(method, path, {"model": "m1"} if method == "POST" else None, headers)
    assert reply.status == status, reply
    if status == 401:
        assert reply.headers.get("WWW-Authenticate")


@pytest.mark.parametrize("_", [case("auth/no-keys-passes-through", None)])
def test_without_keys_nothing_is_asked(api: Served, _: None) -> None:
    assert api.ask("GET", "/api/version").status == 200


# -- llama-swap.go: the command itself -------------------------------------------------


@pytest.mark.parametrize("how", [case("main/sigterm-shuts-down", signal.SIGTERM),
                                 case("main/sigint-shuts-down", signal.SIGINT)])  # fmt: skip
def test_a_signal_ends_serve_and_its_models(
    tmp_path_factory: pytest.TempPathFactory, how: signal.Signals
) -> None:
    with serving(tmp_path_factory.mktemp("ended"), "models:\n" + echo("m1")) as served:
        assert served.chat("m1").status == 200
        (running,) = served.ask("GET", "/running").json()["running"]
        port = int(running["proxy"].rpartition(":")[2])
        assert accepts(port)
        served.proc.send_signal(how)
        assert served.proc.wait(30) == 0
        assert not accepts(port)  # the model's server ended with serve


def running(served: Served) -> list[str]:
    return [r["model"] for r in served.ask("GET", "/running").json()["running"]]
