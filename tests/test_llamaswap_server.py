"""llama-swap's server tests (its ``internal/server`` api, auth, filters and server
cases), as cases against one real ``vramlock serve``.

The models and the peers are tests/echo_server.py, which answers with what it received:
each case checks serve's answer and what the upstream got, as llama-swap's tests check
their stub router's.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.conformance import (
    Served,
    case,
    echo,
    listed,
    peer_server,
    serving,
    status_of,
)
from helpers.processes import kill_group

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(120)


CAPS = {
    "cap-all": "{in: [text, image], out: [text, audio], tools: true, context: 100000}",
    "cap-in": "{in: [text, image]}",
    "cap-out": "{out: [audio]}",
    "cap-tools": "{tools: true}",
    "cap-reranker": "{reranker: true}",
    "cap-context": "{context: 32768}",
    "cap-audio-tr": "{in: [audio], out: [text]}",
    "cap-image-gen": "{in: [text], out: [image]}",
    "cap-i2i": "{in: [image], out: [image]}",
    "cap-meta": "{in: [text]}",
}
META = "{architecture: should-be-dropped, custom_field: should-remain, capabilities: x}"


def config(peer: int, strix: int) -> str:
    local = [
        echo("m1"), echo("visible", "name: Visible", "description: a model"),
        echo("hidden", "unlisted: true"), echo("shared"), echo("real", "aliases: [nick]"),
        echo("author"), echo("author/model"), echo("simple"), echo("comfyui_auto"),
        echo("whisper", "useModelName: whisper-large-v3"),
        echo("um", "aliases: [alias-um]", "useModelName: real-model"),
        echo("filt", "filters: {stripParams: temperature, setParams: {top_p: 0.9}}"),
        echo("byid", "filters: {setParams: {top_p: 0.5}, setParamsByID: {alias: {top_p: 0.1}}}"),
        echo("cap-empty"),
        echo("cap-meta-nocaps", "metadata: {architecture: preserved, context_length: 4096,"
             " capabilities: preserved, custom_field: preserved}"),
        *(echo(n, f"capabilities: {c}") for n, c in CAPS.items() if n != "cap-meta"),
        echo("cap-meta", f"capabilities: {CAPS['cap-meta']}", f"metadata: {META}"),
    ]  # fmt: skip
    return (
        "includeAliasesInList: true\n"
        "upstream: {ignorePaths: ['.*\\.(js|css)$']}\n"
        "peers:\n"
        f"  peer1: {{proxy: 'http://127.0.0.1:{peer}', models: [remote-model, shared, org/model],"
        " filters: {stripParams: temperature}}\n"
        f"  strix: {{proxy: 'http://127.0.0.1:{strix}', models: [shared, cdn]}}\n"
        "models:\n" + "".join(local)
    )


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("main")
    peers = [peer_server("peer1"), peer_server("strix")]
    try:
        with serving(tmp, config(peers[0][1], peers[1][1])) as served:
            yield served
    finally:
        for proc, _ in peers:
            kill_group(proc)


# -- /v1/models (api_test: HandleListModels, PeerNamespaces, Aliases, Status) -------------

Check = Callable[[Served], bool]

LISTING: list[Any] = [
    case("api/list-models-visible", lambda s: "visible" in listed(s)),
    case("api/list-models-peer", lambda s: "peer1/remote-model" in listed(s)),
    case("api/list-models-unlisted", lambda s: "hidden" not in listed(s)),
    case("api/list-models-cors", lambda s: s.ask("GET", "/v1/models", headers={
        "Origin": "http://example.com"}).headers.get("Access-Control-Allow-Origin")
        == "http://example.com"),
    case("api/peer-namespaces-listed", lambda s: {"shared", "peer1/shared", "strix/shared"}
         <= set(listed(s)) and "cdn" not in listed(s)),
    case("api/peer-namespaces-status", lambda s: {"shared", "peer1/shared", "strix/shared"}
         <= set(status_of(s))),
    case("api/list-models-aliases", lambda s: {"real", "nick"} <= set(listed(s))),
    case("api/list-models-status-unloaded", lambda s: listed(s)["simple"].get("status")
         == {"value": "unloaded"}),
    case("api/list-models-status-peer", lambda s: listed(s)["peer1/remote-model"].get("status")
         == {"value": "unloaded"}),
]  # fmt: skip


@pytest.mark.parametrize("holds", LISTING)
def test_the_model_list(main: Served, holds: Check) -> None:
    assert holds(main)


@pytest.mark.parametrize("_", [case("api/list-models-status-loaded", None)])
def test_a_loaded_model_and_its_alias_are_listed_loaded(main: Served, _: None) -> None:
    assert main.chat("real").status == 200
    models = listed(main)
    assert models["real"]["status"]["value"] == "loaded"
    assert models["nick"]["status"]["value"] == "loaded"


def caps(served: Served, model: str) -> dict[str, Any]:
    return listed(served)[model]


CAPABILITIES: list[Any] = [
    case("api/capabilities-all-fields", "cap-all", lambda m: m["architecture"] == {
        "input_modalities": ["text", "image"], "output_modalities": ["text", "audio"],
        "modality": "text+image->text+audio"} and m["capabilities"]["vision"] is True
        and m["capabilities"]["audio_speech"] is True
        and m["capabilities"]["function_calling"] is True
        and m["supported_parameters"] == ["tools", "tool_choice"]
        and m["context_length"] == 100000),
    case("api/capabilities-in-only", "cap-in", lambda m: "output_modalities" not in
         m["architecture"] and "modality" not in m["architecture"]
         and m["capabilities"]["vision"] is True and "supported_parameters" not in m
         and "context_length" not in m),
    case("api/capabilities-out-only", "cap-out", lambda m: "input_modalities" not in
         m["architecture"] and not m.get("capabilities")),
    case("api/capabilities-tools", "cap-tools", lambda m: m["capabilities"]
         ["function_calling"] is True and m["supported_parameters"] == ["tools", "tool_choice"]
         and "architecture" not in m),
    case("api/capabilities-reranker", "cap-reranker", lambda m: m["capabilities"]["reranker"]
         is True and "architecture" not in m),
    case("api/capabilities-context", "cap-context", lambda m: m["context_length"] == 32768
         and "architecture" not in m),
    case("api/capabilities-audio-transcriptions", "cap-audio-tr",
         lambda m: m["capabilities"]["audio_transcriptions"] is True),
    case("api/capabilities-image-generation", "cap-image-gen",
         lambda m: m["capabilities"]["image_generation"] is True),
    case("api/capabilities-image-to-image", "cap-i2i",
         lambda m: m["capabilities"]["image_to_image"] is True),
    case("api/capabilities-empty-skip", "cap-empty", lambda m: not {"architecture",
         "capabilities", "supported_parameters", "context_length"} & set(m)),
    case("api/capabilities-metadata-precedence", "cap-meta", lambda m: m["architecture"]
         ["input_modalities"] == ["text"] and "architecture" not in m["meta"]["llamaswap"]
         and m["meta"]["llamaswap"]["custom_field"] == "should-remain"),
    case("api/capabilities-metadata-passthrough", "cap-meta-nocaps", lambda m: "architecture"
         not in m and m["meta"]["llamaswap"]["architecture"] == "preserved"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "holds"), CAPABILITIES)
def test_capabilities_in_the_model_list(
    main: Served, model: str, holds: Callable[[dict[str, Any]], bool]
) -> None:
    entry = caps(main, model)
    assert holds(entry), entry


MODEL_STATUS = [
    case("api/model-status-capabilities", "cap-all", lambda m: m["capabilities"]["vision"]
         is True and m["capabilities"]["function_calling"] is True
         and m["context_length"] == 100000),
    case("api/model-status-omits-empty", "cap-empty",
         lambda m: "capabilities" not in m and "context_length" not in m),
]  # fmt: skip


@pytest.mark.parametrize(("model", "holds"), MODEL_STATUS)
def test_capabilities_in_the_model_status(
    main: Served, model: str, holds: Callable[[dict[str, Any]], bool]
) -> None:
    entry = status_of(main)[model]
    assert holds(entry), entry


# -- /upstream (api_test: FindModelInPath, HandleUpstream, PreservesEscapedPath, ...) -----

UPSTREAM = [
    case("api/find-model-simple", "/upstream/simple/v1/chat", 200, "simple", "/v1/chat"),
    case("api/find-model-two-segments", "/upstream/author/model/v1/chat", 200, "author/model",
         "/v1/chat"),
    case("api/find-model-longest-not-prefix", "/upstream/author/v1/chat", 200, "author",
         "/v1/chat"),
    case("api/find-model-missing", "/upstream/missing/v1", 404, None, None),
    case("api/upstream-proxies-local", "/upstream/m1/v1/chat", 200, "m1", "/v1/chat"),
    case("api/upstream-unknown-404", "/upstream/nope/v1", 404, None, None),
    case("api/upstream-escaped-slash", "/upstream/m1/api/userdata/workflows%2Fexample.json",
         200, "m1", "/api/userdata/workflows%2Fexample.json"),
    case("api/upstream-escaped-two-segments", "/upstream/author/model/api/x%2Fy", 200,
         "author/model", "/api/x%2Fy"),
    case("api/upstream-escaped-separator-in-name", "/upstream/author%2Fmodel/api/x%2Fy", 200,
         "author/model", "/api/x%2Fy"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "status", "model", "got"), UPSTREAM)
def test_upstream_finds_the_model_in_the_path(
    main: Served, path: str, status: int, model: str | None, got: str | None
) -> None:
    reply = main.ask("POST", path, data=b"{}")
    assert reply.status == status, reply
    if model is not None:
        assert (reply.got()["id"], reply.got()["path"]) == (model, got)


REDIRECTS = [
    case("api/upstream-redirects-bare-model", "GET", "/upstream/m1", 301, "/upstream/m1/"),
    case("api/find-model-bare-two-segments", "GET", "/upstream/author/model", 301,
         "/upstream/author/model/"),
    case("api/comfyui-bare-get", "GET", "/comfyui?token=value", 301, "/comfyui/?token=value"),
    case("api/comfyui-bare-head", "HEAD", "/comfyui?token=value", 301, "/comfyui/?token=value"),
    case("api/comfyui-bare-post", "POST", "/comfyui?token=value", 308, "/comfyui/?token=value"),
    case("api/redirect-root-to-ui", "GET", "/", 302, "/ui"),
    case("api/redirect-upstream-to-ui-models", "GET", "/upstream", 302, "/ui/models"),
    case("log/logs-html-redirect", "GET", "/logs", 302, "/ui/"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "status", "location"), REDIRECTS)
def test_redirects(main: Served, method: str, path: str, status: int, location: str) -> None:
    reply = main.ask(method, path, headers={"Accept": "text/html"})
    assert (reply.status, reply.headers.get("Location")) == (status, location)
    while location.startswith("/ui"):  # on to the page
        page = main.ask("GET", location, headers={"Accept": "text/html"})
        location = page.headers.get("Location", "")
    if path in ("/", "/upstream", "/logs"):
        assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")


IGNORED = [
    case("api/ignore-paths-matched-not-loaded", "m1", "/foo.js", 409, "not loaded"),
    case("api/ignore-paths-not-matched-loads", "m1", "/v1/chat/completions", 200, "m1"),
    case("api/ignore-paths-matched-loaded", "m1", "/foo.js", 200, "m1"),
    case("api/ignore-paths-peer-model", "strix/cdn", "/foo.js", 200, "strix"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "path", "status", "said"), IGNORED)
def test_ignore_paths_start_no_model(
    main: Served, model: str, path: str, status: int, said: str
) -> None:
    if status == 409:  # the cases run in order: first with nothing loaded
        assert main.ask("GET", "/unload").status == 200
    reply = main.ask("GET", f"/upstream/{model}{path}")
    assert reply.status == status, reply
    assert said.encode() in reply.body


# -- /comfyui/ (api_test: HandleComfyUI, RequiresExactLocalModel) ------------------------


COMFY = [
    case("api/comfyui-subpath-unloaded-409", "/comfyui/api/prompt", "GET", 409, None),
    case("api/comfyui-root-starts", "/comfyui/?token=value", "GET", 200, "/?token=value"),
    case("api/comfyui-escaped-slash", "/comfyui/api/userdata/workflows%2Fexample.json?preview=1",
         "POST", 200, "/api/userdata/workflows%2Fexample.json?preview=1"),
    case("api/comfyui-double-escaped", "/comfyui/api/userdata/workflows%252Fexample.json",
         "POST", 200, "/api/userdata/workflows%252Fexample.json"),
    case("api/comfyui-utf8-escaped", "/comfyui/api/%E2%9C%93%2Ffile.json", "POST", 200,
         "/api/%E2%9C%93%2Ffile.json"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "method", "status", "got"), COMFY)
def test_comfyui(main: Served, path: str, method: str, status: int, got: str | None) -> None:
    if status == 409:
        assert main.ask("GET", "/unload").status == 200
    reply = main.ask(method, path, data=b"{}" if method == "POST" else None)
    assert reply.status == status, reply
    if got is None:
        assert b"only /comfyui/ can start it" in reply.body
    else:
        assert (reply.got()["id"], reply.got()["path"]) == ("comfyui_auto", got)


# -- requests by model (server_test, auth_test RequestContext, filters_test) ---------------

ROUTED = [
    case("server/route-to-local-model", "/v1/chat/completions", {"model": "m1"}, 200, "m1",
         "/v1/chat/completions"),
    case("server/route-to-peer-model", "/v1/chat/completions", {"model": "remote-model"}, 200,
         "peer1", "/v1/chat/completions"),
    case("server/route-prefers-local-collision", "/v1/chat/completions", {"model": "shared"},
         200, "shared", "/v1/chat/completions"),
    case("server/unknown-model-404", "/v1/chat/completions", {"model": "unknown-model"}, 404,
         None, None),
    case("server/audio-api-routes-task", "/audioapi/v1/tasks/run", {"model": "m1"}, 200, "m1",
         "/v1/tasks/run"),
    case("auth/request-context-known-model", "/v1/chat/completions", {"model": "simple"}, 200,
         "simple", "/v1/chat/completions"),
    case("auth/request-context-missing-model", "/v1/chat/completions", {}, 400, None, None,
         diverges=True),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "upstream", "got"), ROUTED)
def test_a_request_reaches_its_model(
    main: Served, path: str, body: object, status: int, upstream: str | None, got: str | None
) -> None:
    reply = main.ask("POST", path, body)
    assert reply.status == status, reply
    if upstream is not None:
        assert (reply.got()["id"], reply.got()["path"]) == (upstream, got)


FILTERS = [
    case("filters/use-model-name-rewrite", {"model": "alias-um", "temp": 1},
         lambda b: b == {"model": "real-model", "temp": 1}),
    case("filters/strip-and-set-params", {"model": "filt", "temperature": 0.7},
         lambda b: "temperature" not in b and b["top_p"] == 0.9),
    case("filters/set-params-by-id-overrides", {"model": "alias"}, lambda b: b["top_p"] == 0.1),
    case("filters/qualified-peer-filters", {"model": "peer1/org/model", "temperature": 0.7},
         lambda b: "temperature" not in b and b["model"] == "org/model"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "holds"), FILTERS)
def test_filters_change_what_the_model_gets(
    main: Served, body: dict[str, Any], holds: Callable[[dict[str, Any]], bool]
) -> None:
    reply = main.ask("POST", "/v1/chat/completions", body)
    assert reply.status == 200, reply
    assert holds(reply.sent_body()), reply.sent_body()


@pytest.mark.parametrize("_", [case("filters/form-filter-use-model-name", None)])
def test_a_form_s_model_is_rewritten_and_its_file_kept(main: Served, _: None) -> None:
    mark = "b0undary"
    form = (f"--{mark}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n"
            f"--{mark}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\nxx\r\n--{mark}--\r\n")  # fmt: skip
    reply = main.ask("POST", "/v1/audio/transcriptions", data=form.encode(),
                     headers={"Content-Type": f"multipart/form-data; boundary={mark}"})  # fmt: skip
    assert reply.status == 200, reply
    got = reply.got()["body"]
    assert 'name="model"\r\n\r\nwhisper-large-v3\r\n' in got
    assert 'filename="a.wav"' in got and "\r\n\r\nxx\r\n" in got


# -- the rest of serve's own routes (server_test) ----------------------------------------

PLAIN: list[Any] = [
    case("server/unknown-path-404", lambda s: s.ask("GET", "/does-not-exist").status == 404),
    case("server/health", lambda s: (lambda r: (r.status, r.body) == (200, b"OK"))(
        s.ask("GET", "/health"))),
    case("server/wol-health", lambda s: (lambda r: (r.status, r.body) == (200, b"OK"))(
        s.ask("GET", "/wol-health"))),
    case("server/cors-preflight", lambda s: (lambda r: r.status == 204 and r.headers[
        "Access-Control-Allow-Origin"] == "*")(s.ask("OPTIONS", "/v1/chat/completions"))),
    case("server/log-stream-unknown-400", lambda s: s.ask(
        "GET", "/logs/stream/no-such-model").status == 400),
    case("api/metrics-unavailable-503", lambda s: s.ask("GET", "/metrics").status == 200,
         diverges=True),
]  # fmt: skip


@pytest.mark.parametrize("holds", PLAIN)
def test_serve_s_own_routes(main: Served, holds: Check) -> None:
    assert holds(main)


SANITIZED = [
    case("auth/sanitize-acrh-plain", "Content-Type, Authorization", "Content-Type, Authorization"),
    case("auth/sanitize-acrh-spaces", "  X-Custom ,  Accept ", "X-Custom, Accept"),
    case("auth/sanitize-acrh-bad-dropped", "Valid, Bad Header", "Valid"),
    case("auth/sanitize-acrh-all-bad", "Bad@Header", ""),
]  # fmt: skip


@pytest.mark.parametrize(("asked", "allowed"), SANITIZED)
def test_a_preflight_echoes_only_token_header_names(main: Served, asked: str, allowed: str) -> None:
    reply = main.ask("OPTIONS", "/v1/chat/completions",
                     headers={"Access-Control-Request-Headers": asked})  # fmt: skip
    assert reply.headers.get("Access-Control-Allow-Headers", "") == allowed


@pytest.mark.parametrize("_", [case("server/unload", None)])
def test_unload_ends_every_model(main: Served, _: None) -> None:
    assert main.chat("m1").status == 200
    reply = main.ask("GET", "/unload")
    assert (reply.status, reply.body) == (200, b"OK")
    assert main.ask("GET", "/running").json() == {"running": []}


@pytest.mark.parametrize("_", [case("server/log-stream-model-id", None)])
def test_a_model_s_log_stream_begins_with_its_history(main: Served, _: None) -> None:
    assert main.chat("simple").status == 200
    conn = http.client.HTTPConnection("127.0.0.1", main.port, timeout=30)
    try:
        conn.request("GET", "/logs/stream/simple")
        reply = conn.getresponse()
        assert reply.status == 200
        said = b""
        while b"simple listening" not in said:
            chunk = reply.read1(4096)
            assert chunk, said
            said += chunk
    finally:
        conn.close()
