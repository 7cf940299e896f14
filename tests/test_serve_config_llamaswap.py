"""llama-swap's own configuration tests (its ``internal/config``: macros, ports, the
environment), ported as tables: the YAML of each case and llama-swap's verdict, checked
against ``vramlock serve``'s reader (``helpers.llamaswap``). The models', filters',
peers', selectors' and ``--config-dir``'s cases are in test_serve_config_sections.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("yaml")

from helpers.llamaswap import CHECK, PROXY, Case, m, named, no, ok, verdict

from vramlock.cli import parse_duration
from vramlock.serve.config import Config, load

pytestmark = pytest.mark.timeout(30)


def read(path: Path) -> Config:
    return load(str(path), parse_duration)


MACROS = [
    ok(
        "macro-in-macro",
        'macros:\n  A: value-A\n  B: "prefix-${A}-suffix"\n'
        "models:\n  test:\n    cmd: echo ${B}\n" + PROXY,
        lambda c: m(c).command,
        ["echo", "prefix-value-A-suffix"],
    ),
    ok(
        "macro-lifo-order",
        'macros:\n  base: /models\n  path: "${base}/llama"\n'
        '  full: "${path}/model.gguf"\nmodels:\n  test:\n    cmd: load ${full}\n' + PROXY,
        lambda c: m(c).command,
        ["load", "/models/llama/model.gguf"],
    ),
    ok(
        "model-id-in-global-macro",
        'macros:\n  podman: "podman run --name ${MODEL_ID} img"\n'
        "models:\n  my-model:\n    cmd: ${podman} -m model.gguf\n" + PROXY,
        lambda c: m(c, "my-model").command,
        ["podman", "run", "--name", "my-model", "img", "-m", "model.gguf"],
    ),
    ok(
        "model-macro-inside-global-macro",
        'macros:\n  tag: global\n  msg: "value-${tag}"\n'
        "models:\n  test:\n    macros:\n      tag: model-level\n    cmd: echo ${msg}\n" + PROXY,
        lambda c: m(c).command,
        ["echo", "value-model-level"],
    ),
    no(
        "macro-self-reference",
        'macros:\n  recursive: "value-${recursive}"\n'
        "models:\n  test:\n    cmd: echo ${recursive}\n" + PROXY,
        "recursive uses itself",
    ),
    ok(
        "macro-in-name-description",
        "macros:\n  VARIANT: Q4_K_M\n  FAMILY: llama\n"
        "models:\n  my-model:\n    cmd: echo ok\n" + PROXY + '    name: "${FAMILY} ${VARIANT}"\n'
        '    description: "A ${FAMILY} model in ${VARIANT} format"\n',
        lambda c: (m(c, "my-model").title, m(c, "my-model").description),
        ("llama Q4_K_M", "A llama model in Q4_K_M format"),
    ),
    ok(
        "model-id-in-name-description",
        "models:\n  llama-3b:\n    cmd: echo ok\n"
        + PROXY
        + '    name: "Model: ${MODEL_ID}"\n    description: "Running ${MODEL_ID}"\n',
        lambda c: (m(c, "llama-3b").title, m(c, "llama-3b").description),
        ("Model: llama-3b", "Running llama-3b"),
    ),
    no(
        "unknown-macro-in-name",
        "models:\n  test:\n    cmd: echo ok\n" + PROXY + '    name: "Model ${UNDEFINED}"\n',
        "name: ${UNDEFINED} is not a defined macro",
    ),
    no(
        "unknown-macro-in-macro",
        'macros:\n  A: "value-${UNDEFINED}"\nmodels:\n  test:\n    cmd: echo ${A}\n' + PROXY,
        "${UNDEFINED} is not a defined",
    ),
    no("macro-name-bad-characters", "macros:\n  bad.name: value\n", "bad name 'bad.name'"),
    no("macro-name-too-long", f"macros:\n  {'a' * 64}: value\n", "bad name"),
    no(
        "model-macro-named-pid",
        "models:\n  model1:\n    macros:\n      PID: 1234\n",
        "bad name 'PID'",
    ),
    no(
        "model-macro-does-not-leak",
        "models:\n  owner:\n    macros:\n      LOCAL: v\n"
        "    cmd: echo ${LOCAL}\n" + PROXY + "  other:\n    cmd: echo ${LOCAL}\n"
        "    proxy: http://localhost:8081\n",
        "model 'other': cmd: ${LOCAL} is not a defined",
    ),
    ok(
        "model-macros-in-merged-anchors",
        "defs:\n  model: &model\n    cmd: echo ${LOCAL}\n"
        + PROXY.replace("    ", "    ", 1)
        + '    env: ["MODEL_VALUE=${LOCAL}"]\n    metadata:\n      value: "${LOCAL}"\n'
        "models:\n  first:\n    <<: *model\n    macros:\n      LOCAL: first-value\n"
        "  second:\n    <<: *model\n    macros:\n      LOCAL: second-value\n",
        lambda c: [(x.command, x.env, x.metadata) for x in c.models.values()],
        [
            (["echo", "first-value"], {"MODEL_VALUE": "first-value"}, {"value": "first-value"}),
            (["echo", "second-value"], {"MODEL_VALUE": "second-value"}, {"value": "second-value"}),
        ],
    ),
    ok(
        "start-port-from-macro",
        'macros:\n  FIRST_PORT: 6200\nstartPort: "${FIRST_PORT}"\n'
        "models:\n  model1:\n    cmd: server --port ${PORT}\n",
        lambda c: (m(c, "model1").command, m(c, "model1").upstream),
        (["server", "--port", "6200"], "127.0.0.1:6200"),
    ),
    ok(
        "pid-deferred-from-macro",
        "macros:\n  STOP: kill ${PID}\nmodels:\n  model1:\n"
        '    cmd: server\n    cmdStop: "${STOP}"\n' + PROXY,
        lambda c: m(c, "model1").stop_command,
        'kill "$VRAMLOCK_CHILD_PID"',
    ),
    ok(
        "port-in-set-params-by-id-keys",
        "startPort: 6300\nmodels:\n  model1:\n"
        "    cmd: server --port ${PORT}\n    filters:\n      setParamsByID:\n"
        '        "model1:${PORT}":\n          temperature: 0.5\n',
        lambda c: (m(c, "model1").aliases, m(c, "model1").filters.by_name),
        (("model1:6300",), {"model1:6300": {"temperature": 0.5}}),
    ),
    ok(
        "macros-across-configuration",
        "macros:\n  GLOBAL_TTL: 120\n  MODEL_TTL: 45\n  LOADING: true\n  MODEL_NAME: model1\n"
        'globalTTL: "${GLOBAL_TTL}"\nsendLoadingState: "${LOADING}"\n'
        'hooks:\n  on_startup:\n    preload: ["${MODEL_NAME}"]\n'
        "models:\n  model1:\n    macros:\n      MODEL_TTL: 30\n      CONNECT_TIMEOUT: 12\n"
        '    cmd: server --port ${PORT}\n    ttl: "${MODEL_TTL}"\n    timeouts:\n'
        '      connect: "${CONNECT_TIMEOUT}"\n    env:\n      - "MODEL=${MODEL_ID}"\n',
        lambda c: (
            m(c, "model1").ttl,
            m(c, "model1").loading_state,
            c.preload,
            m(c, "model1").timeouts.connect,
            m(c, "model1").env,
        ),
        (30.0, True, ("model1",), 12.0, {"MODEL": "model1"}),
    ),
    ok(
        "global-ttl-from-macro",
        'macros:\n  T: 120\nglobalTTL: "${T}"\n'
        "models:\n  model1:\n    cmd: server --port ${PORT}\n",
        lambda c: m(c, "model1").ttl,
        120.0,
    ),
    ok(
        "metadata-keys-stay-literal",
        "macros:\n  KEY: expanded\nmodels:\n  model1:\n"
        "    cmd: server\n" + PROXY + '    metadata:\n      "${KEY}": value\n',
        lambda c: m(c, "model1").metadata,
        {"${KEY}": "value"},
    ),
    no(
        "set-params-by-id-keys-collide",
        "macros:\n  FIRST: shared\n  SECOND: shared\n"
        "models:\n  model1:\n    cmd: server\n" + PROXY + "    filters:\n      setParamsByID:\n"
        '        "${FIRST}":\n          temperature: 0.1\n        "${SECOND}":\n'
        "          temperature: 0.2\n",
        "are both 'shared' once expanded",
    ),
    no(
        "macro-forward-reference",
        'macros:\n  FIRST: "value-${SECOND}"\n  SECOND: later\n'
        "models:\n  model1:\n    cmd: echo ${FIRST}\n" + PROXY,
        "${SECOND} is not a defined",
    ),
    ok(
        "port-throughout-its-model",
        "startPort: 6100\nmodels:\n  model1:\n"
        "    cmd: server --port ${PORT}\n    proxy: http://localhost:${PORT}\n"
        '    checkEndpoint: /health/${PORT}\n    aliases: ["port-${PORT}"]\n'
        '    metadata:\n      port: "${PORT}"\n',
        lambda c: (
            m(c, "model1").upstream,
            m(c, "model1").check_endpoint,
            m(c, "model1").aliases,
            m(c, "model1").metadata,
        ),
        ("127.0.0.1:6100", "/health/6100", ("port-6100",), {"port": 6100}),
    ),
    ok(
        "pid-deferred-in-cmd-stop",
        "models:\n  model1:\n    cmd: server\n    cmdStop: kill ${PID}\n" + PROXY,
        lambda c: m(c, "model1").stop_command,
        'kill "$VRAMLOCK_CHILD_PID"',
    ),
    no(
        "pid-outside-cmd-stop",
        "models:\n  model1:\n    cmd: server\n" + PROXY + '    metadata:\n      pid: "${PID}"\n',
        "metadata: ${PID} is for cmdStop",
    ),
    ok(
        "macro-replacement",
        "startPort: 9990\nmacros:\n  svr-path: path/to/server\n"
        '  argOne: "--arg1"\n  argTwo: "--arg2"\n  autoPort: "--port ${PORT}"\n'
        "  overridden: failed\nmodels:\n  model1:\n    macros:\n      overridden: success\n"
        "    cmd: |\n      ${svr-path} ${argTwo}\n      # the automatic ${PORT} is replaced\n"
        "      ${autoPort}\n      ${argOne}\n      --arg3 three\n"
        "      --overridden ${overridden}\n    cmdStop: |\n"
        "      /path/to/stop.sh --port ${PORT} ${argTwo}\n",
        lambda c: (m(c, "model1").command, m(c, "model1").stop_command),
        (
            [
                "path/to/server",
                "--arg2",
                "--port",
                "9990",
                "--arg1",
                "--arg3",
                "three",
                "--overridden",
                "success",
            ],
            "/path/to/stop.sh --port 9990 --arg2",
        ),
    ),
    ok(
        "macro-in-comment-not-expanded",
        "models:\n  model1:\n    cmd: |\n"
        "      # ${unknown} in a comment\n      server --port ${PORT}\n",
        lambda c: m(c, "model1").command,
        ["server", "--port", "5800"],
    ),
    ok(
        "model-id-in-cmd",
        "models:\n  model1:\n    cmd: server --alias ${MODEL_ID} --port ${PORT}\n",
        lambda c: m(c, "model1").command,
        ["server", "--alias", "model1", "--port", "5800"],
    ),
    ok(
        "typed-macros-in-metadata",
        "macros:\n  ctx: 4096\n  temp: 0.7\n  flag: true\n"
        "models:\n  model1:\n    cmd: server --port ${PORT}\n    metadata:\n"
        '      ctx: "${ctx}"\n      temp: "${temp}"\n      flag: "${flag}"\n'
        '      note: "ctx ${ctx}"\n',
        lambda c: m(c, "model1").metadata,
        {"ctx": 4096, "temp": 0.7, "flag": True, "note": "ctx 4096"},
    ),
    ok(
        "model-macro-precedence-in-metadata",
        "macros:\n  v: global\nmodels:\n  model1:\n"
        "    macros:\n      v: local\n    cmd: server --port ${PORT}\n"
        '    metadata:\n      v: "${v}"\n',
        lambda c: m(c, "model1").metadata,
        {"v": "local"},
    ),
    no(
        "unknown-macro-in-metadata",
        'models:\n  model1:\n    cmd: server --port ${PORT}\n    metadata:\n      v: "${nope}"\n',
        "metadata: ${nope} is not a defined macro",
    ),
    no(
        "macro-of-invalid-type",
        "macros:\n  list: [a, b]\nmodels: {}\n",
        "list must be a string, a number or a flag",
    ),
]

RESERVED = [
    no(f"reserved-{where}-{name}", text, f"bad name '{name}'")
    for where, name, text in [
        ("global", "PORT", 'macros:\n  PORT: "1111"\n'),
        ("global", "MODEL_ID", "macros:\n  MODEL_ID: model1\n"),
        ("global", "PID", "macros:\n  PID: 1234\n"),
        ("model", "PORT", "models:\n  model1:\n    macros:\n      PORT: 1111\n"),
        ("model", "MODEL_ID", "models:\n  model1:\n    macros:\n      MODEL_ID: model1\n"),
    ]
]

UNKNOWN = [
    no(
        f"unknown-macro-in-{field_}",
        "startPort: 9990\nmacros:\n  svr: path/to/server\nmodels:\n  model1:\n" + body,
        f"model1': {field_}: ${{unknownMacro}} is not a defined",
    )
    for field_, body in [
        ("cmd", "    cmd: |\n      ${svr} --port ${PORT}\n      ${unknownMacro}\n"),
        ("cmdStop", '    cmd: "${svr} --port ${PORT}"\n    cmdStop: "kill ${unknownMacro}"\n'),
        (
            "proxy",
            '    cmd: "${svr} --port ${PORT}"\n    proxy: "http://${unknownMacro}:${PORT}"\n',
        ),
        (
            "checkEndpoint",
            '    cmd: "${svr} --port ${PORT}"\n    checkEndpoint: "/health/${unknownMacro}"\n',
        ),
        (
            "filters",
            '    cmd: "${svr} --port ${PORT}"\n    filters:\n'
            '      stripParams: "model,${unknownMacro}"\n',
        ),
    ]
]

PORTS = [
    ok("empty-config-loads", "", lambda c: (c.models, c.health_timeout), ({}, 120.0)),
    ok("start-port-only", "startPort: 1000\n", lambda c: c.models, {}),
    no("start-port-not-a-number", "startPort: abcd\n", "startPort must be a port number"),
    no("start-port-negative", "startPort: -99\n", "startPort must be a port number"),
    ok(
        "automatic-ports",
        "startPort: 5800\nmodels:\n  model1:\n    cmd: svr --port ${PORT}\n"
        '  model2:\n    cmd: svr --port ${PORT}\n    proxy: "http://172.11.22.33:${PORT}"\n'
        '  model3:\n    cmd: svr --port 1999\n    proxy: "http://1.2.3.4:1999"\n',
        lambda c: [(x.command[-1], x.upstream) for x in c.models.values()],
        [("5800", "127.0.0.1:5800"), ("5801", "172.11.22.33:5801"), ("1999", "1.2.3.4:1999")],
    ),
    ok(
        "ports-in-sorted-model-ids",
        "models:\n  zeta:\n    cmd: svr ${PORT}\n  alpha:\n    cmd: svr ${PORT}\n",
        lambda c: (m(c, "alpha").upstream, m(c, "zeta").upstream),
        ("127.0.0.1:5800", "127.0.0.1:5801"),
    ),
    no(
        "default-proxy-needs-port-in-cmd",
        "models:\n  model1:\n    cmd: svr --port 111\n",
        "model 'model1': the default proxy http://localhost:${PORT} uses ${PORT}, but cmd",
    ),
    no(
        "proxy-port-needs-port-in-cmd",
        "models:\n  model1:\n    cmd: svr --port 111\n    proxy: http://localhost:${PORT}\n",
        "model 'model1': proxy uses ${PORT}, but cmd",
    ),
]

E = {"TEST_MODEL_PATH": "/opt/models", "TEST_HOST": "myserver", "TEST_PORT": "9999",
     "TEST_BASE_PATH": "/usr/local", "TEST_MODEL_DIR": "/models/llama",
     "TEST_API_KEY": "secret123", "TEST_STRIP_PARAMS": "temperature,top_p",
     "TEST_KILL_SIGNAL": "SIGTERM", "TEST_ROOT": "/data", "TEST_USER": "admin",
     "TEST_PASS": "secret", "TEST_MULTILINE": "line1\nline2", "TEST_CR": "line1\rline2",
     "TEST_QUOTED": 'value with "quotes"', "TEST_BACKSLASH": "path\\to\\file",
     "TEST_PEER_API_KEY": "sk-peer-secret-123", "TEST_PEER_KEY_1": "key-one",
     "TEST_PEER_KEY_2": "key-two", "TEST_RETENTION": "deny",
     "TEST_PEER_STRIP": "frequency_penalty, presence_penalty"}  # fmt: skip
ONE = "models:\n  test:\n"
PEER = "peers:\n  openrouter:\n    proxy: https://openrouter.ai/api\n    models: [m]\n"

ENV = [
    ok(
        "env-in-cmd",
        ONE + '    cmd: "${env.TEST_MODEL_PATH}/llama-server"\n' + PROXY,
        lambda c: m(c).command,
        ["/opt/models/llama-server"],
        env=E,
    ),
    ok(
        "env-in-several-fields",
        ONE + '    cmd: "server --host ${env.TEST_HOST}"\n'
        '    proxy: "http://${env.TEST_HOST}:${env.TEST_PORT}"\n',
        lambda c: (m(c).command, m(c).upstream),
        (["server", "--host", "myserver"], "myserver:9999"),
        env=E,
    ),
    no(
        "env-in-check-endpoint-url",
        ONE + "    cmd: server\n" + PROXY + '    checkEndpoint: "http://${env.TEST_HOST}/health"\n',
        "checkEndpoint must be /PATH",
        env=E,
        diverges=CHECK,
    ),
    ok(
        "env-in-global-macro",
        'macros:\n  SERVER: "${env.TEST_BASE_PATH}/bin/server"\n'
        + ONE
        + '    cmd: "${SERVER} --port 8080"\n'
        + PROXY,
        lambda c: m(c).command,
        ["/usr/local/bin/server", "--port", "8080"],
        env=E,
    ),
    ok(
        "env-in-model-macro",
        ONE + '    macros:\n      FILE: "${env.TEST_MODEL_DIR}/m.gguf"\n'
        '    cmd: "server --model ${FILE}"\n' + PROXY,
        lambda c: m(c).command,
        ["server", "--model", "/models/llama/m.gguf"],
        env=E,
    ),
    ok(
        "env-in-metadata",
        ONE + '    cmd: "server"\n' + PROXY + "    metadata:\n"
        '      api_key: "${env.TEST_API_KEY}"\n      nested:\n'
        '        key: "${env.TEST_API_KEY}"\n',
        lambda c: m(c).metadata,
        {"api_key": "secret123", "nested": {"key": "secret123"}},
        env=E,
    ),
    ok(
        "env-in-strip-params",
        ONE + '    cmd: "server"\n' + PROXY + "    filters:\n"
        '      stripParams: "${env.TEST_STRIP_PARAMS}"\n',
        lambda c: m(c).filters.strip,
        ("temperature", "top_p"),
        env=E,
    ),
    ok(
        "env-in-cmd-stop",
        ONE + '    cmd: "server --port ${PORT}"\n'
        '    cmdStop: "kill -${env.TEST_KILL_SIGNAL} ${PID}"\n',
        lambda c: m(c).stop_command,
        'kill -SIGTERM "$VRAMLOCK_CHILD_PID"',
        env=E,
    ),
    no(
        "env-unset-in-cmd",
        ONE + '    cmd: "${env.UNDEFINED_VAR_12345}/server"\n' + PROXY,
        "UNDEFINED_VAR_12345 is not set",
    ),
    no(
        "env-unset-in-global-macro",
        'macros:\n  P: "${env.UNDEFINED_GLOBAL_VAR}"\n' + ONE + '    cmd: "server"\n' + PROXY,
        "UNDEFINED_GLOBAL_VAR is not set",
    ),
    no(
        "env-unset-in-model-macro",
        ONE + '    macros:\n      P: "${env.UNDEFINED_MODEL_VAR}"\n    cmd: "server"\n' + PROXY,
        "UNDEFINED_MODEL_VAR is not set",
    ),
    no(
        "env-unset-in-metadata",
        ONE
        + '    cmd: "server"\n'
        + PROXY
        + '    metadata:\n      key: "${env.UNDEFINED_META_VAR}"\n',
        "UNDEFINED_META_VAR is not set",
    ),
    ok(
        "env-with-macros",
        'macros:\n  BASE: "${env.TEST_ROOT}/models"\n'
        + ONE
        + '    cmd: "server --model ${BASE}/${MODEL_ID}.gguf"\n'
        + PROXY,
        lambda c: m(c).command,
        ["server", "--model", "/data/models/test.gguf"],
        env=E,
    ),
    ok(
        "env-twice-in-a-string",
        ONE + '    cmd: "server --auth ${env.TEST_USER}:${env.TEST_PASS}"\n' + PROXY,
        lambda c: m(c).command,
        ["server", "--auth", "admin:secret"],
        env=E,
    ),
    no(
        "env-with-newline",
        ONE + '    cmd: "server --config ${env.TEST_MULTILINE}"\n' + PROXY,
        "TEST_MULTILINE's value holds a line break",
        env=E,
    ),
    no(
        "env-with-carriage-return",
        ONE + '    cmd: "server ${env.TEST_CR}"\n' + PROXY,
        "TEST_CR's value holds a line break",
        env=E,
    ),
    ok(
        "env-with-quotes",
        ONE + '    cmd: "server --arg \\"${env.TEST_QUOTED}\\""\n' + PROXY,
        lambda c: m(c).command,
        ["server", "--arg", "value with quotes"],
        env=E,
    ),
    ok(
        "env-with-backslashes",
        ONE + '    cmd: "server --path \\"${env.TEST_BACKSLASH}\\""\n' + PROXY,
        lambda c: m(c).command,
        ["server", "--path", "path\\to\\file"],
        env=E,
    ),
    ok(
        "env-in-api-keys",
        'apiKeys: ["${env.TEST_API_KEY}"]\n',
        lambda c: c.api_keys,
        ("secret123",),
        env=E,
    ),
    ok(
        "env-in-flow-list",
        "apiKeys: [${env.TEST_API_KEY}]\n",
        lambda c: c.api_keys,
        ("secret123",),
        env=E,
    ),
    ok(
        "env-in-peer-api-key",
        PEER + '    apiKey: "${env.TEST_PEER_API_KEY}"\n',
        lambda c: c.peers["openrouter"].api_key,
        "sk-peer-secret-123",
        env=E,
    ),
    no(
        "env-unset-in-peer-api-key",
        PEER + '    apiKey: "${env.NONEXISTENT_PEER_KEY}"\n',
        "NONEXISTENT_PEER_KEY is not set",
    ),
    ok(
        "static-peer-api-key",
        PEER + "    apiKey: sk-static-key\n",
        lambda c: c.peers["openrouter"].api_key,
        "sk-static-key",
    ),
    ok(
        "env-in-two-peers",
        "peers:\n  peer1:\n    proxy: https://peer1.example.com\n"
        '    apiKey: "${env.TEST_PEER_KEY_1}"\n    models: [a]\n  peer2:\n'
        '    proxy: https://peer2.example.com\n    apiKey: "${env.TEST_PEER_KEY_2}"\n'
        "    models: [b]\n",
        lambda c: [p.api_key for p in c.peers.values()],
        ["key-one", "key-two"],
        env=E,
    ),
    ok(
        "macro-in-peer-api-key",
        "macros:\n  API_KEY: sk-from-global-macro\n" + PEER + '    apiKey: "${API_KEY}"\n',
        lambda c: c.peers["openrouter"].api_key,
        "sk-from-global-macro",
    ),
    ok(
        "macro-in-peer-strip-params",
        'macros:\n  STRIP: "temperature, top_p"\n'
        + PEER
        + '    filters:\n      stripParams: "${STRIP}"\n',
        lambda c: c.peers["openrouter"].filters.strip,
        ("temperature", "top_p"),
    ),
    ok(
        "macro-in-peer-set-params",
        "macros:\n  MAX_TOKENS: 4096\n"
        + PEER
        + '    filters:\n      setParams:\n        max_tokens: "${MAX_TOKENS}"\n',
        lambda c: c.peers["openrouter"].filters.set,
        {"max_tokens": 4096},
    ),
    ok(
        "env-in-peer-set-params",
        PEER + '    filters:\n      setParams:\n        data_collection: "${env.TEST_RETENTION}"\n',
        lambda c: c.peers["openrouter"].filters.set,
        {"data_collection": "deny"},
        env=E,
    ),
    ok(
        "env-in-peer-strip-params",
        PEER + '    filters:\n      stripParams: "${env.TEST_PEER_STRIP}"\n',
        lambda c: c.peers["openrouter"].filters.strip,
        ("frequency_penalty", "presence_penalty"),
        env=E,
    ),
    no(
        "unknown-macro-in-peer-api-key",
        PEER + '    apiKey: "${UNDEFINED_MACRO}"\n',
        "peers: ${UNDEFINED_MACRO} is not a defined macro",
    ),
    no(
        "unknown-macro-in-peer-set-params",
        PEER + '    filters:\n      setParams:\n        value: "${UNDEFINED_MACRO}"\n',
        "${UNDEFINED_MACRO} is not a defined",
    ),
]


CASES = [*MACROS, *RESERVED, *UNKNOWN, *PORTS, *ENV]


@pytest.mark.parametrize("case", CASES)
def test_llama_swap_s_verdict(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict(case, read, tmp_path, monkeypatch)


def test_the_count() -> None:
    """How many of llama-swap's cases are here, and how many differ (each named)."""
    assert named(CASES) == (81, 1)
