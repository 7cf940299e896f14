"""llama-swap's server tests of profiles, selectors and logs, and llama-swap.go's own
behaviour (reload, its flags), as cases against a real ``vramlock serve``.

The models and the peer are tests/echo_server.py, which answers with what it received.
The cases of one table run in order on one serve: a profile set by one is in force for
the next.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.commands import vramlock
from helpers.conformance import (
    Served,
    case,
    echo,
    environment,
    listed,
    peer_server,
    serving,
    status_of,
)
from helpers.processes import kill_group, wait_until

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(120)

PROFILES = """\
profiles:
  coding:
    description: Coding profile
    pins: {public: variant, disabled: ~, real: hidden, expose: hidden, remote-model: hidden,
           author: hidden, author/public: real}
models:
"""


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    proc, port = peer_server("remote")
    text = (f"peers:\n  remote: {{proxy: 'http://127.0.0.1:{port}', models: [remote-model]}}\n"
            + PROFILES + echo("hidden", "name: Hidden Model", "unlisted: true")
            + echo("real", "name: Real Model",
                   "filters: {setParamsByID: {variant: {thinking: true}}}"))  # fmt: skip
    try:
        with serving(tmp_path_factory.mktemp("profiles"), text) as served:
            yield served
    finally:
        kill_group(proc)


ACTIVE = [
    case("profiles/api-list", None, 200, None),
    case("profiles/api-set-active", {"name": "coding"}, 200, "coding"),
    case("profiles/api-set-missing-404", {"name": "missing"}, 404, "coding"),
    case("profiles/api-clear", {"name": None}, 200, None),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "active"), ACTIVE)
def test_the_profile_api(profiles: Served, body: object, status: int, active: str | None) -> None:
    if body is not None:
        assert profiles.ask("PUT", "/api/profiles/active", body).status == status
    listing = profiles.ask("GET", "/api/profiles").json()
    assert listing["active"] == active
    (profile,) = listing["profiles"]
    assert profile["id"] == "coding" and profile["pins"]["disabled"] == ""


@pytest.fixture
def coding(profiles: Served) -> Iterator[Served]:
    assert profiles.ask("PUT", "/api/profiles/active", {"name": "coding"}).status == 200
    yield profiles
    assert profiles.ask("PUT", "/api/profiles/active", {"name": None}).status == 200


def last_activity(served: Served) -> dict[str, Any]:
    entry: dict[str, Any] = served.ask("GET", "/api/metrics/activity").json()["data"][0]
    return entry


PINNED: list[Any] = [
    case("profiles/json-and-filters", "POST", "/v1/chat/completions", {"model": "public"},
         lambda r: r.got()["id"] == "real"
         and r.sent_body() == {"model": "variant", "thinking": True}),
    case("profiles/disabled-404", "POST", "/v1/chat/completions", {"model": "disabled"},
         lambda r: r.status == 404),
    case("profiles/upstream-preserves-body", "POST", "/upstream/public/custom",
         {"model": "public"}, lambda r: (r.got()["id"], r.got()["path"], r.got()["body"])
         == ("real", "/custom", '{"model": "public"}')),
    case("profiles/rewrite-upstream-path-pin", "POST", "/upstream/public/v1/chat/completions",
         {}, lambda r: (r.got()["id"], r.got()["path"]) == ("real", "/v1/chat/completions")),
    case("profiles/rewrite-upstream-path-longest-pin", "POST",
         "/upstream/author/public/v1/chat/completions", {}, lambda r: (r.got()["id"],
         r.got()["path"]) == ("real", "/v1/chat/completions")),
    case("profiles/rewrite-upstream-path-disabled", "POST",
         "/upstream/disabled/v1/chat/completions", {}, lambda r: r.status == 404),
    case("profiles/rewrite-upstream-path-not-pinned", "POST",
         "/upstream/hidden/v1/chat/completions", {}, lambda r: r.got()["id"] == "hidden"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body", "holds"), PINNED)
def test_a_profile_s_pins_route(
    coding: Served, method: str, path: str, body: object, holds: Callable[[Any], bool]
) -> None:
    reply = coding.ask(method, path, body)
    assert holds(reply), reply


@pytest.mark.parametrize("_", [case("profiles/upstream-metrics-resolved-model", None)])
def test_activity_names_the_pinned_model(coding: Served, _: None) -> None:
    body = {"reply": {"usage": {"prompt_tokens": 2, "completion_tokens": 3}}}
    assert coding.ask("POST", "/upstream/public/v1/chat/completions", body).status == 200
    wait_until(lambda: last_activity(coding)["tokens"]["input_tokens"] == 2)
    assert last_activity(coding)["model"] == "real"


LISTING: list[Any] = [
    case("profiles/listing-pin-listed", lambda m, s: "public" in m and not m["public"].get(
        "name") and m["public"]["meta"]["llamaswap"]["type"] == "profile"),
    case("profiles/listing-model-name", lambda m, s: m["real"]["name"] == "Real Model"),
    case("profiles/listing-peer-name", lambda m, s: m["remote/remote-model"]["name"]
         == "remote: remote-model"),
    case("profiles/listing-pin-to-unlisted", lambda m, s: "expose" in m and not m[
        "expose"].get("name")),
    case("profiles/listing-disabled-and-unlisted-absent", lambda m, s: "disabled" not in m
         and "hidden" not in m),
    case("profiles/model-status-concrete", lambda m, s: {"real", "hidden"} <= set(s)
         and s["remote/remote-model"]["peerID"] == "remote"
         and not {"public", "expose", "disabled"} & set(s)),
]  # fmt: skip


@pytest.mark.parametrize("holds", LISTING)
def test_a_profile_s_pins_are_listed(coding: Served, holds: Callable[[Any, Any], bool]) -> None:
    assert holds(listed(coding), status_of(coding))


@pytest.mark.parametrize("_", [case("profiles/management-uses-concrete-model", None)])
def test_unloading_a_pinned_name_unloads_that_model(coding: Served, _: None) -> None:
    assert coding.ask("POST", "/v1/completions", {"model": "variant"}).got()["id"] == "real"
    assert coding.ask("POST", "/api/models/unload/real").status == 200
    wait_until(lambda: "real" not in {r["model"] for r in coding.ask("GET", "/running").json()[
        "running"]})  # fmt: skip


@pytest.mark.parametrize("_", [case("profiles/concurrent-selection-and-listing", None)])
def test_profiles_switched_while_listing(profiles: Served, _: None) -> None:
    statuses: list[int] = []

    def work(n: int) -> None:
        for _ in range(10):
            body = {"name": "coding" if n % 2 == 0 else None}
            statuses.append(profiles.ask("PUT", "/api/profiles/active", body).status)
            statuses.append(profiles.ask("GET", "/v1/models").status)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert statuses == [200] * 80
    assert profiles.ask("PUT", "/api/profiles/active", {"name": None}).status == 200


# -- selectors (selector_test) -----------------------------------------------------------

SELECTORS = """\
groups:
  balanced: {swap: false, members: [a, b, c]}
selectors:
  public: {strategy: pin, targets: [variant, remote/remote-model], name: Public Model,
           description: Public selector, metadata: {purpose: testing}}
  pinab: {strategy: pin, targets: [a, b]}
  warm: {strategy: warm, targets: [a, b, c]}
  balanced: {strategy: spillover, targets: [a, b, c], settings: {spillover: 1}}
  hidden-selector: {strategy: pin, targets: [a], unlisted: true}
profiles:
  coding: {pins: {llm-code: public}}
models:
"""


@pytest.fixture(scope="module")
def selectors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    proc, port = peer_server("remote")
    text = (f"peers:\n  remote: {{proxy: 'http://127.0.0.1:{port}', models: [remote-model]}}\n"
            + SELECTORS + echo("a", "aliases: [alias-a]",
                               "filters: {setParamsByID: {variant: {thinking: true}}}")
            + echo("b") + echo("c"))  # fmt: skip
    try:
        with serving(tmp_path_factory.mktemp("selectors"), text) as served:
            yield served
    finally:
        kill_group(proc)


@pytest.mark.parametrize("_", [case("selectors/rewrites-before-filters", None)])
def test_a_pin_selector_s_target_gets_its_filters(selectors: Served, _: None) -> None:
    reply = selectors.chat("public")
    assert reply.got()["id"] == "a"
    assert reply.sent_body() == {"model": "variant", "thinking": True}


@pytest.mark.parametrize("_", [case("selectors/records-activity", None)])
def test_activity_names_the_selector(selectors: Served, _: None) -> None:
    assert selectors.chat("public", reply={"usage": {"prompt_tokens": 7}}).status == 200
    wait_until(lambda: last_activity(selectors)["tokens"]["input_tokens"] == 7)
    entry = last_activity(selectors)
    assert (entry["model"], entry["metadata"]["selector"]) == ("a", "public")


@pytest.mark.parametrize("_", [case("selectors/profile-runs-first", None)])
def test_a_profile_pin_to_a_selector(selectors: Served, _: None) -> None:
    assert selectors.ask("PUT", "/api/profiles/active", {"name": "coding"}).status == 200
    try:
        reply = selectors.chat("llm-code", reply={"usage": {"prompt_tokens": 9}})
        assert reply.got()["id"] == "a"
        wait_until(lambda: last_activity(selectors)["tokens"]["input_tokens"] == 9)
        assert last_activity(selectors)["metadata"]["selector"] == "public"
    finally:
        selectors.ask("PUT", "/api/profiles/active", {"name": None})


WARM = [
    case("selectors/warm-prefers-ready", ["c"], "c"),
    case("selectors/warm-first-ready-in-order", ["c", "b"], "b"),
    case("selectors/warm-none-ready-first", [], "a"),
]  # fmt: skip


@pytest.mark.parametrize(("loaded", "chosen"), WARM)
def test_a_warm_selector_picks_a_ready_target(
    selectors: Served, loaded: list[str], chosen: str
) -> None:
    assert selectors.ask("GET", "/unload").status == 200
    for model in loaded:
        assert selectors.chat(model).status == 200
    assert selectors.chat("warm").got()["id"] == chosen


@pytest.mark.parametrize("_", [case("selectors/spillover-reservations", None)])
def test_a_spillover_selector_spreads_requests_in_flight(selectors: Served, _: None) -> None:
    for model in "abc":
        assert selectors.chat(model).status == 200
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(
        selectors.chat("balanced", sleep=1).got()["id"])) for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(set(got)) == 2, got


SELECTOR_LISTING: list[Any] = [
    case("selectors/upstream-unsupported", lambda s: s.ask(
        "POST", "/upstream/public/v1/chat/completions", {"model": "public"}).status == 404),
    case("selectors/listing-fields", lambda s: (lambda p: (p["name"], p["description"],
         p["meta"]["llamaswap"]) == ("Public Model", "Public selector", {
         "purpose": "testing", "type": "selector", "strategy": "pin",
         "targets": ["variant", "remote/remote-model"]}))(listed(s)["public"])),
    case("selectors/listing-spillover", lambda s: (lambda m: (m["strategy"], m["targets"],
         m["spillover"]) == ("spillover", ["a", "b", "c"], 1))(
         listed(s)["balanced"]["meta"]["llamaswap"])),
    case("selectors/listing-unlisted-absent", lambda s: "hidden-selector" not in listed(s)),
    case("selectors/listing-status-loaded", lambda s: listed(s)["public"]["status"]["value"]
         == "loaded"),
    case("selectors/listing-pin-uses-first-target", lambda s: s.ask("GET", "/unload").status
         == 200 and s.chat("b").status == 200 and listed(s)["pinab"]["status"]["value"]
         == "unloaded"),
]  # fmt: skip


@pytest.mark.parametrize("holds", SELECTOR_LISTING)
def test_selectors_are_listed(selectors: Served, holds: Callable[[Served], bool]) -> None:
    assert holds(selectors)


# -- logs (log_test) ---------------------------------------------------------------------

LOGGERS = [
    case("log/new-loggers-proxy", "proxy", True, False),
    case("log/new-loggers-both", "both", True, True),
    case("log/new-loggers-none", "none", False, False),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "proxy", "upstream"), LOGGERS)
def test_log_to_stdout_decides_the_combined_log(
    tmp_path_factory: pytest.TempPathFactory, mode: str, proxy: bool, upstream: bool
) -> None:
    text = f"logToStdout: {mode}\nmodels:\n" + echo("m1")
    with serving(tmp_path_factory.mktemp("loggers"), text) as served:
        assert served.chat("m1").status == 200
        logs = served.ask("GET", "/logs").body.decode()
        assert ("serving m1" in logs, "m1 listening" in logs) == (proxy, upstream), logs


# -- llama-swap.go -----------------------------------------------------------------------


@pytest.mark.parametrize("_", [case("main/no-config-refused", None, diverges=True)])
def test_serve_without_a_configuration_is_a_usage_error(
    tmp_path_factory: pytest.TempPathFactory, _: None
) -> None:
    env = environment(tmp_path_factory.mktemp("noconfig"))
    done = subprocess.run(vramlock("serve"), capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and "configuration" in done.stderr


@pytest.mark.parametrize("_", [case("main/sighup-reloads", None)])
def test_sighup_reads_the_configuration_again(
    tmp_path_factory: pytest.TempPathFactory, _: None
) -> None:
    with serving(tmp_path_factory.mktemp("hup"), "models:\n" + echo("m1")) as served:
        config = served.dir / "serve.yaml"
        config.write_text(config.read_text() + echo("m2"))
        served.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: served.proc.poll() is not None or "m2" in listed(served), 30)
        assert served.proc.poll() is None


@pytest.mark.parametrize("_", [case("main/config-dir", None)])
def test_a_configuration_directory_is_merged(
    tmp_path_factory: pytest.TempPathFactory, _: None
) -> None:
    tmp = tmp_path_factory.mktemp("confdir")
    (tmp / "conf.d").mkdir()
    (tmp / "conf.d" / "more.yaml").write_text("models:\n" + echo("m2"))
    with serving(tmp, "models:\n" + echo("m1"), "--config-dir", str(tmp / "conf.d")) as served:
        assert {"m1", "m2"} <= set(listed(served))


@pytest.mark.parametrize("_", [case("main/watch-config", None)])
def test_watch_config_reads_a_changed_file(
    tmp_path_factory: pytest.TempPathFactory, _: None
) -> None:
    with serving(tmp_path_factory.mktemp("watch"), "models:\n" + echo("m1"),
                 "--watch-config") as served:  # fmt: skip
        config = served.dir / "serve.yaml"
        config.write_text(config.read_text() + echo("m2"))
        wait_until(lambda: "m2" in listed(served), 30)


@pytest.mark.parametrize("_", [case("main/listen-default-loopback", None, diverges=True)])
def test_serve_listens_on_loopback_unless_told(_: None) -> None:
    done = subprocess.run(vramlock("serve", "--help"), capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert "127.0.0.1:8080" in done.stdout
