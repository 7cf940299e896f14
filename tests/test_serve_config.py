"""``vramlock serve``'s configuration: llama-swap's YAML, read as llama-swap documents it.

The two configurations of llama-swap's README (the short one and the "very powerful"
one) and its configuration guide's macros; every error names its file and line.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from vramlock.cli import parse_duration
from vramlock.serve.config import Config, ConfigError, load

pytestmark = pytest.mark.timeout(30)

README_SHORT = """\
models:
  "qwen2.5":
    proxy: "http://127.0.0.1:9999"
    cmd: |
      /app/llama-server
      -hf bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
      --port 9999

  "smollm2":
    proxy: "http://127.0.0.1:9999"
    cmd: |
      /app/llama-server
      -hf bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M
      --port 9999
"""

README_FULL = """\
# Seconds to wait for upstream to load and be ready to serve requests
healthCheckTimeout: 500

logLevel: info

startPort: 10001

models:
  "llama":
    cmd: |
      llama-server --port 8999
      --model path/to/Qwen2.5-1.5B-Instruct-Q4_K_M.gguf

    env:
      - "CUDA_VISIBLE_DEVICES=0"

    proxy: http://127.0.0.1:8999

    aliases:
      - "gpt-4o-mini"
      - "gpt-3.5-turbo"

    checkEndpoint: /custom-endpoint

    ttl: 60

    useModelName: "qwen:qwq"

  "qwen-unlisted":
    unlisted: true
    cmd: llama-server --port ${PORT} -m Llama-3.2-1B-Instruct-Q4_K_M.gguf -ngl 0

  "docker-llama":
    proxy: "http://127.0.0.1:${PORT}"
    cmd: |
      docker run --name dockertest
      --init --rm -p ${PORT}:8080 -v /mnt/nvme/models:/models
      ghcr.io/ggerganov/llama.cpp:server
      --model '/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf'

    cmdStop: docker stop dockertest

groups:
  "group1":
    swap: true
    exclusive: true
    members:
      - "llama"
      - "qwen-unlisted"
"""

MACROS = """\
macros:
  "latest-llama": >
    /path/to/llama-server --port ${PORT}
  "default_ctx": 4096
  "default_args": "--ctx-size ${default_ctx}"
  "models_dir": "${env.SERVE_TEST_HOME}/models"
models:
  model1:
    cmd: llama-server --port ${PORT} --model /path/to/model.gguf
  "gpt-oss":
    macros:
      "default_ctx": 16384
    name: "gpt-oss 120B"
    description: "A thinking model"
    cmd: |
      # ${latest-llama} is a macro that is defined above
      ${latest-llama}
      --model ${models_dir}/gpt-oss.gguf
      --ctx-size ${default_ctx} ${default_args}
      --alias ${MODEL_ID}
"""


def read(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return load(str(path), parse_duration)


def test_readme_short_example(tmp_path: Path) -> None:
    config = read(tmp_path, README_SHORT)
    assert list(config.models) == ["qwen2.5", "smollm2"]
    qwen = config.models["qwen2.5"]
    hf = "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    assert qwen.command == ["/app/llama-server", "-hf", hf, "--port", "9999"]
    assert qwen.upstream == "127.0.0.1:9999"
    assert qwen.check_endpoint == "/health"
    assert qwen.ttl == 0
    assert config.health_timeout == 120
    assert config.warnings == []


def test_readme_full_example(tmp_path: Path) -> None:
    config = read(tmp_path, README_FULL)
    llama, unlisted, docker = config.models.values()
    assert config.health_timeout == 500
    assert llama.aliases == ("gpt-4o-mini", "gpt-3.5-turbo")
    assert config.find("gpt-3.5-turbo") is llama
    assert llama.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert (llama.upstream, llama.check_endpoint) == ("127.0.0.1:8999", "/custom-endpoint")
    assert llama.ttl == 60
    assert llama.filters.model == "qwen:qwq"  # useModelName
    assert config.log_level == "info"
    # ${PORT}: startPort, then the next one, in the file's order
    # ${PORT} in the models' sorted IDs, as llama-swap: docker-llama before qwen-unlisted
    assert unlisted.unlisted and unlisted.command[:3] == ["llama-server", "--port", "10002"]
    assert unlisted.upstream == "127.0.0.1:10002"
    assert docker.upstream == "127.0.0.1:10001"
    assert "10001:8080" in docker.command
    assert docker.command[-1] == "/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
    # one warning per key that means nothing here, each with its line and why
    assert config.routing.groups[0].members == ("llama", "qwen-unlisted")
    # cmdStop: docker-llama is released by being stopped
    assert (docker.stop_command, docker.release) == ("docker stop dockertest", "restart")
    assert config.warnings == []


def test_macros_env_model_macros_and_model_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SERVE_TEST_HOME", "/home/u")
    config = read(tmp_path, MACROS)
    assert config.models["model1"].upstream == "127.0.0.1:5801"  # gpt-oss < model1
    oss = config.models["gpt-oss"]
    # The model's default_ctx is seen inside the global default_args too, as llama-swap.
    assert oss.command == ["/path/to/llama-server", "--port", "5800", "--model",
                           "/home/u/models/gpt-oss.gguf", "--ctx-size", "16384", "--ctx-size",
                           "16384", "--alias", "gpt-oss"]  # fmt: skip
    assert (oss.title, oss.description) == ("gpt-oss 120B", "A thinking model")


def test_no_proxy_and_no_port_in_cmd_is_refused_as_llama_swap_refuses_it(tmp_path: Path) -> None:
    """The default proxy is http://localhost:${PORT}, and ${PORT} is given only to a
    model whose cmd uses it: the server would be looked for where it does not listen."""
    with pytest.raises(ConfigError) as err:
        read(tmp_path, "models:\n  next:\n    cmd: srv --port ${PORT}\n"
                       "  fixed:\n    cmd: some-upstream-server\n")  # fmt: skip
    assert str(err.value) == (
        f"{tmp_path / 'config.yaml'}:4: model 'fixed': the default proxy"
        " http://localhost:${PORT} uses ${PORT}, but cmd does not: ${PORT} is given to a"
        " model whose cmd uses it"
    )


def test_an_environment_value_is_not_expanded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SERVE_TEST_ODD", "${PORT}-${env.HOME}-${nope}")
    with pytest.raises(ConfigError, match=r"\$\{nope\} is not a defined macro"):
        # llama-swap's verdict: its macros are expanded in what the environment gave.
        read(tmp_path, "models:\n  a:\n    cmd: srv ${PORT} ${env.SERVE_TEST_ODD}\n")
    monkeypatch.setenv("SERVE_TEST_ODD", "${env.HOME}")
    with pytest.raises(ConfigError, match=r"\$\{env.HOME\}: not expanded"):
        read(tmp_path, "models:\n  a:\n    cmd: srv ${PORT} ${env.SERVE_TEST_ODD}\n")
    monkeypatch.setenv("SERVE_TEST_ODD", "--odd")
    config = read(tmp_path, """\
        macros:
          odd: "${env.SERVE_TEST_ODD}"
        models:
          a:
            cmd: srv --port ${PORT} --odd ${env.SERVE_TEST_ODD} --macro ${odd}
            env: ["ODD=${env.SERVE_TEST_ODD}"]
        """)  # fmt: skip
    a = config.models["a"]
    odd = "--odd"
    assert a.command == ["srv", "--port", "5800", "--odd", odd, "--macro", odd]
    assert a.env == {"ODD": odd}


def test_preload_names_models_or_aliases(tmp_path: Path) -> None:
    config = read(tmp_path, """\
        models:
          a:
            cmd: srv --port ${PORT}
            aliases: [first]
          b:
            cmd: srv --port ${PORT}
        hooks:
          on_startup:
            preload: [first, nope, a]
            later: [b]
        """)  # fmt: skip
    assert config.preload == ("a",)
    path = tmp_path / "config.yaml"
    assert config.warnings == [
        f"{path}:10: hooks.on_startup: unknown key later ignored",
        f"{path}:9: hooks.on_startup.preload: no model 'nope'; not preloaded",
    ]
    assert read(tmp_path, "models:\n  a:\n    cmd: srv ${PORT}\n").preload == ()


def test_an_alias_may_be_an_object_with_a_name_or_unlisted(tmp_path: Path) -> None:
    """The alias objects of llama-swap's proposed form (id, name, unlisted) beside plain
    strings: each id is an alias; name and unlisted are for /v1/models."""
    config = read(tmp_path, """\
        models:
          a:
            cmd: srv --port ${PORT}
            aliases:
              - plain
              - id: named
                name: A, named
              - {id: hidden, unlisted: true, colour: red}
        """)  # fmt: skip
    a = config.models["a"]
    assert a.aliases == ("plain", "named", "hidden")
    assert config.find("hidden") is a
    assert (a.alias_names, a.unlisted_aliases) == ({"named": "A, named"}, ("hidden",))
    assert config.known() == ["a", "plain", "named"]  # an unlisted alias is not told
    assert config.warnings == [
        f"{tmp_path / 'config.yaml'}:8: model 'a': aliases[2]: unknown key colour ignored"
    ]


def test_concurrency_limit_zero_or_absent_is_llama_swap_s_default(tmp_path: Path) -> None:
    config = read(tmp_path, """\
        models:
          a:
            cmd: srv --port ${PORT}
            concurrencyLimit: 0
          b:
            cmd: srv --port ${PORT}
            concurrencyLimit: 2
          c:
            cmd: srv --port ${PORT}
        """)  # fmt: skip
    assert [m.concurrency for m in config.models.values()] == [10, 2, 10]


def test_filters_change_the_body_the_model_gets(tmp_path: Path) -> None:
    config = read(tmp_path, """\
        models:
          a:
            cmd: srv --port ${PORT}
            useModelName: upstream-name
            filters:
              stripParams: "temperature, model, top_k"
              setParams: {top_p: 0.9, model: no}
              setParamsByID:
                "${MODEL_ID}:high": {effort: high}
                "${MODEL_ID}": {effort: medium}
        """)  # fmt: skip
    a = config.models["a"]
    assert a.aliases == ("a:high",)  # setParamsByID's names are aliases
    assert config.find("a:high") is a
    body = {"model": "a:high", "temperature": 1, "top_k": 5, "prompt": "x"}
    assert a.filters.apply(body, "a:high") == {"model": "upstream-name", "prompt": "x",
                                               "top_p": 0.9, "effort": "high"}  # fmt: skip
    assert a.filters.apply({"model": "a"}, "a")["effort"] == "medium"


def test_metadata_and_capabilities_keep_their_types(tmp_path: Path) -> None:
    config = read(tmp_path, """\
        macros:
          temp: 0.7
        includeAliasesInList: true
        models:
          a:
            cmd: srv --port ${PORT}
            metadata:
              port: ${PORT}
              temperature: ${temp}
              note: "${MODEL_ID} on ${PORT}"
              a_list: [1, "${MODEL_ID}"]
            capabilities: {in: [text], context: 32000}
        """)  # fmt: skip
    a = config.models["a"]
    assert a.metadata == {"port": 5800, "temperature": 0.7, "note": "a on 5800",
                          "a_list": [1, "a"]}  # fmt: skip
    assert a.capabilities == {"in": ["text"], "context": 32000}
    assert config.aliases_listed


def test_vramlock_keys_become_run_options(tmp_path: Path) -> None:
    config = read(tmp_path, """\
        models:
          a:
            cmd: srv --port ${PORT}
            release: restart
            min_hold: 2s
            yield_within: 30
            gpu: 1
          b:
            cmd: srv --port ${PORT}
            arena: shared
            preset: llama-server
            vram: 6G
        """)  # fmt: skip
    a, b = config.models.values()
    assert a.run_options == ("--release", "restart", "--min-hold", "2s", "--yield-within", "30",
                             "--gpu", "1")  # fmt: skip
    assert b.run_options == ("--release", "auto", "--preset", "llama-server", "--vram", "6G",
                             "--arena", str(tmp_path / "shared"))  # fmt: skip


def test_llama_swap_s_other_keys_are_ignored_saying_why(tmp_path: Path) -> None:
    config = read(tmp_path, """\
        store: {path: /tmp/activity.sqlite}
        models:
          a:
            cmd: srv --port ${PORT}
            compat: {ignoreWebsockets: true}
        """)  # fmt: skip
    said = [w.split(": ", 1)[1] for w in config.warnings]
    assert [w.split(" ignored: ")[0] for w in said] == ["store", "model 'a': compat"]
    assert "unknown" not in " ".join(said)


def test_activity_and_performance_keys_as_llama_swap_reads_them(tmp_path: Path) -> None:
    plain = read(tmp_path, "models:\n  a:\n    cmd: srv ${PORT}\n")
    assert (plain.activity_kept, plain.capture_mb, plain.performance_every) == (1000, 5, 5.0)
    config = read(tmp_path, """\
        metricsMaxInMemory: 50
        captureBuffer: 0
        performance: {every: 1m30s}
        models:
          a:
            cmd: srv ${PORT}
        """)  # fmt: skip
    assert (config.activity_kept, config.capture_mb, config.performance_every) == (50, 0, 90.0)
    assert config.warnings == []
    off = read(tmp_path, """\
        metricsMaxInMemory: 0
        performance: {disabled: true, every: 10s}
        models:
          a:
            cmd: srv ${PORT}
        """)  # fmt: skip
    assert (off.activity_kept, off.performance_every) == (1000, None)  # 0: the default


def test_unknown_keys_warn_once_each(tmp_path: Path) -> None:
    config = read(tmp_path, """\
        colour: blue
        models:
          a:
            cmd: srv --port ${PORT}
            flavour: x
        """)  # fmt: skip
    path = tmp_path / "config.yaml"
    assert config.warnings == [f"{path}:1: unknown key colour ignored",
                               f"{path}:5: model 'a': unknown key flavour ignored"]  # fmt: skip


ONE_MODEL = "models:\n  a:\n    cmd: srv ${PORT}\n    aliases: [al]\n"


def test_a_peer_s_timeouts_have_llama_swap_s_defaults_for_peers(tmp_path: Path) -> None:
    from vramlock.serve.timeouts import Timeouts

    text = ("peers:\n  p: {proxy: 'http://h', models: [x]}\n"
            "  q:\n    proxy: https://h\n    models: [y]\n    timeouts:\n"
            "      connect: 5\n      responseHeader: 0\n      idleConn: 9\n"
            + ONE_MODEL)  # fmt: skip
    config = read(tmp_path, text)
    assert config.peers["p"].timeouts == Timeouts(30.0, 60.0, 10.0)
    assert config.peers["q"].timeouts == Timeouts(5.0, None, 10.0)  # 0: no bound
    assert config.warnings == [
        f"{tmp_path / 'config.yaml'}:9: peer 'q': timeouts: idleConn ignored: the HTTP client"
        " closes idle connections after its own 15 s"
    ]


def test_a_value_that_aliases_make_huge_is_refused_at_once(tmp_path: Path) -> None:
    """Nine lines of YAML aliases name 9**9 strings; serve walked them all (it hung)."""
    lines = ["x-a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"x-a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    text = "\n".join(lines) + "\nmodels:\n  m:\n    cmd: srv ${PORT}\n    metadata:\n"
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        read(tmp_path, text + "      bomb: *a8\n")
    assert time.monotonic() - started < 5
    assert str(err.value) == (
        f"{tmp_path / 'config.yaml'}:14: a value of more than 100000 values (aliases of aliases?)"
    )
    assert err.value.exit_status == 2
    small = read(tmp_path, text + "      fine: *a2\n")  # 81 values: aliases are fine
    assert len(small.models["m"].metadata["fine"]) == 9


def test_a_pin_may_name_an_alias_a_selector_or_nothing(tmp_path: Path) -> None:
    """As llama-swap takes them: a model's alias, a selector, or null (it answers 404)."""
    text = ("selectors:\n  s: {strategy: pin, targets: [al]}\n"
            "profiles:\n  p: {pins: {x: al, y: s, z: null}}\n" + ONE_MODEL)  # fmt: skip
    config = read(tmp_path, text)
    assert config.profiles["p"].pins == {"x": "al", "y": "s", "z": None}
    assert config.warnings == []


# Each error a user can make in a configuration, by name: the text, the line the
# message names, and what it says.
ERRORS = [
    ("yaml", "models:\n  a:\n    cmd: [srv\n", 4, "not valid YAML"),
    ("no-cmd", "models:\n  a:\n    proxy: http://127.0.0.1:1\n", 2, "model 'a': no cmd"),
    ("not-mapping", "- a\n- b\n", 1, "the file must be a mapping (models:, macros:, ...)"),
    ("macro", "models:\n  a:\n    cmd: srv ${PORT} ${nope}\n", 3, "${nope} is not a defined macro"),
    ("https", "models:\n  a:\n    cmd: srv ${PORT}\n    proxy: https://h:1\n", 4,
     "proxy must be an http://HOST:PORT URL"),
    ("ttl", "models:\n  a:\n    cmd: srv ${PORT}\n    ttl: soon\n", 4, "ttl must be a number"),
    ("duration", "models:\n  a:\n    cmd: srv ${PORT}\n    min_hold: forever\n", 4, "bad duration"),
    ("vram", "models:\n  a:\n    cmd: srv ${PORT}\n    vram: lots\n", 4, "vram: bad size 'lots'"),
    ("alias-clash",
     "models:\n  a:\n    cmd: srv ${PORT}\n    aliases: [b]\n  b:\n    cmd: srv ${PORT}\n",
     5, "model 'b' is already an alias"),
    ("twice",
     "models:\n  a:\n    cmd: srv ${PORT}\n  a:\n    cmd: srv ${PORT}\n", 4, "appears twice"),
    ("env", "models:\n  a:\n    cmd: srv ${PORT}\n    env: [NOEQUALS]\n", 4, "is not NAME=value"),
    ("env-macro",
     "models:\n  a:\n    cmd: srv ${env.SERVE_TEST_UNSET}\n", 3, "SERVE_TEST_UNSET is not set"),
    ("quote", "models:\n  a:\n    cmd: srv ${PORT} -m \"x\n", 3, "cmd: No closing quotation"),
    ("cmd-nul", 'models:\n  a:\n    cmd: "srv\\0 ${PORT}"\n', 3, "cmd: a NUL character cannot"),
    ("env-nul",
     'models:\n  a:\n    cmd: srv ${PORT}\n    env: ["A=\\0"]\n', 4, "is not NAME=value"),
    ("ttl-inf", "models:\n  a:\n    cmd: srv ${PORT}\n    ttl: .inf\n", 4, "ttl must be a number"),
    ("health-inf",
     "healthCheckTimeout: .inf\nmodels: {}\n", 1, "healthCheckTimeout must be a number"),
    ("macros-double",
     "macros:\n" + "".join(f"  m{i}: ${{m{i - 1}}}${{m{i - 1}}}\n" for i in range(1, 40))
     .replace("${m0}${m0}", "xx") + "models:\n  a:\n    cmd: srv ${m39}\n",
     43, "model 'a': its macros expand to more than 1 MiB"),
    ("gpu", "models:\n  a:\n    cmd: srv ${PORT}\n    gpu: one\n", 4,
     "model 'a': gpu: expected a GPU number"),
    ("check-crlf",
     'models:\n  a:\n    cmd: srv ${PORT}\n    checkEndpoint: "/health\\r\\nX-A: b"\n', 4,
     "checkEndpoint must be /PATH (no spaces or control characters)"),
    ("proxy-crlf",
     'models:\n  a:\n    cmd: srv ${PORT}\n    proxy: "http://127.0.0.1:9/v1\\r\\nX-A: b"\n', 4,
     "model 'a': proxy must be an http://HOST:PORT URL, without spaces or control"),
    ("proxy-space", 'models:\n  a:\n    cmd: srv ${PORT}\n    proxy: "http://127.0.0.1:9/a b"\n', 4,
     "model 'a': proxy must be an http://HOST:PORT URL, without spaces or control"),
    ("peer-proxy-crlf",
     'peers:\n  p:\n    proxy: "http://h/v1\\r\\nX-A: b"\n    models: [x]\n' + ONE_MODEL, 3,
     "peer 'p': proxy must be an http(s)://HOST[:PORT] URL, without spaces or control"),
    ("api-key", 'apiKeys: ["sk-a", "has space"]\nmodels:\n  a:\n    cmd: srv ${PORT}\n', 1,
     "apiKeys[1]: a key must be non-empty, without spaces"),
    ("concurrency", "models:\n  a:\n    cmd: srv ${PORT}\n    concurrencyLimit: -1\n", 4,
     "model 'a': concurrencyLimit must be 0 or more"),
    ("log-level", "logLevel: chatty\nmodels:\n  a:\n    cmd: srv ${PORT}\n", 1,
     "logLevel must be one of debug, info, warn, error"),
    ("log-to-stdout", "logToStdout: all\nmodels:\n  a:\n    cmd: srv ${PORT}\n", 1,
     "logToStdout must be one of proxy, upstream, both, none"),
    ("log-time-format", "logTimeFormat: iso\nmodels:\n  a:\n    cmd: srv ${PORT}\n", 1,
     "logTimeFormat must be one of ansic, unixdate,"),
    ("peer-proxy", "peers:\n  p:\n    models: [x]\nmodels:\n  a:\n    cmd: srv ${PORT}\n", 2,
     "peer 'p': proxy is required"),
    ("peer-scheme", "peers:\n  p:\n    proxy: ftp://h\n    models: [x]\n" + ONE_MODEL, 3,
     "peer 'p': proxy must be an http(s)://HOST[:PORT] URL"),
    ("peer-models", "peers:\n  p:\n    proxy: http://h\n    models: []\n" + ONE_MODEL, 2,
     "peer 'p': models must not be empty"),
    ("peer-clash", "peers:\n  p:\n    proxy: http://h\n    models: [x]\nmodels:\n  p/x:\n"
     "    cmd: srv ${PORT}\n", 4, "peer 'p': p/x is already a local model's name or alias"),
    ("loading-state", "models:\n  a:\n    cmd: srv ${PORT}\n    sendLoadingState: yes please\n", 4,
     "model 'a': sendLoadingState must be true or false"),
    ("selector-strategy", "selectors:\n  s: {strategy: best, targets: [a]}\n" + ONE_MODEL, 2,
     "selectors.s.strategy 'best' is not warm, pin or spillover"),
    ("selector-no-strategy",
     "selectors:\n  s: {targets: [a]}\n" + ONE_MODEL, 2, "selectors.s.strategy is required"),
    ("selector-no-targets", "selectors:\n  s: {strategy: pin, targets: []}\n" + ONE_MODEL, 2,
     "selectors.s.targets must have at least one entry"),
    ("selector-chain",
     "selectors:\n  s: {strategy: pin, targets: [t]}\n  t: {strategy: pin, targets: [a]}\n"
     + ONE_MODEL, 2, "selectors.s.targets[0]: 't' is a selector"),
    ("selector-clash", "selectors:\n  al: {strategy: pin, targets: [a]}\n" + ONE_MODEL, 2,
     "selectors.al: a model, alias or peer model is named so"),
    ("selector-warm-peer", "peers:\n  p: {proxy: 'http://h', models: [x]}\nselectors:\n"
     "  s: {strategy: warm, targets: [x]}\n" + ONE_MODEL, 4,
     "selectors.s.targets[0]: warm picks local models only"),
    ("selector-twice", "selectors:\n  s: {strategy: spillover, targets: [a, al]}\n" + ONE_MODEL, 2,
     "selectors.s.targets: 'a' is there twice"),
    ("selector-no-model",
     "selectors:\n  s:\n    strategy: pin\n    targets:\n      - al\n      - zz\n" + ONE_MODEL, 6,
     "selectors.s.targets[1] references unknown model 'zz'"),
    ("pin-no-model", "profiles:\n  p:\n    pins:\n      y: a\n      x: zz\n" + ONE_MODEL, 5,
     "profiles.p.pins.x references unknown model 'zz'"),
    ("pin-of-a-pin", "profiles:\n  p:\n    pins:\n      y: a\n      x: y\n" + ONE_MODEL, 5,
     "profiles.p.pins.x references unknown model 'y'"),
    ("profile-empty",
     "profiles:\n  p: {pins: {}}\n" + ONE_MODEL, 2, "profiles.p.pins must have at least one"),
    ("profile-list", "profiles:\n  p: [a]\n" + ONE_MODEL, 2,
     "profiles.p: a list of models is llama-swap's old profile, which it no longer takes"
     " either: for models resident together, use a group with swap: false"),
    ("profile-text", "profiles:\n  p: a\n" + ONE_MODEL, 2,
     "profiles.p: a profile is a mapping of description and pins"),
    ("alias-no-id", "models:\n  a:\n    cmd: srv ${PORT}\n    aliases:\n      - name: x\n", 5,
     "model 'a': aliases[0]: an alias object needs an id"),
    ("alias-list", "models:\n  a:\n    cmd: srv ${PORT}\n    aliases:\n      - [x]\n", 5,
     "model 'a': aliases[0] must be a name or a mapping with an id"),
    ("capture-buffer",
     "captureBuffer: 5MB\n" + ONE_MODEL, 1, "captureBuffer must be a whole number"),
    ("metrics-kept",
     "metricsMaxInMemory: 1.5\n" + ONE_MODEL, 1, "metricsMaxInMemory must be a whole number"),
    ("every-short", "performance:\n  every: 1s\n" + ONE_MODEL, 2,
     "performance.every must be a duration of at least 5s"),
    ("every-unit",
     "performance:\n  every: 5\n" + ONE_MODEL, 2, "performance.every must be a duration"),
    ("perf-disabled", "performance:\n  disabled: no thanks\n" + ONE_MODEL, 2,
     "performance.disabled must be true or false"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "line", "message"), [pytest.param(*case[1:], id=case[0]) for case in ERRORS]
)
def test_errors_name_file_and_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        read(tmp_path, text)
    assert str(err.value).startswith(f"{tmp_path / 'config.yaml'}:{line}: ")
    assert message in str(err.value)
    assert err.value.exit_status == 2


def test_man_page_states_the_defaults_in_the_code() -> None:
    from helpers import ROOT

    from vramlock.serve.config import DEFAULT_HEALTH_TIMEOUT, DEFAULT_START_PORT
    from vramlock.serve.ending import DEFAULT_GRACE
    from vramlock.serve.router import GROUP_WAIT

    page = " ".join((ROOT / "man" / "man1" / "vramlock-serve.1").read_text().split())
    assert f"(default {DEFAULT_START_PORT})" in page
    assert f"(default {DEFAULT_HEALTH_TIMEOUT:g} s, taken as given)" in page
    assert f"turn lasts {GROUP_WAIT:g} seconds more at most" in page
    assert f"SIGKILL after its unloadTimeout, {DEFAULT_GRACE:g} s by default" in page
