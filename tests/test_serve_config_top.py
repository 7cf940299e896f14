"""llama-swap's own configuration tests (its ``internal/config``: macro types and
metadata, apiKeys, ttl, unloadTimeout, timeouts, store, upstream, performance, ui, the
command line split, whole files), ported as tables: the YAML of each case and
llama-swap's verdict, checked against ``vramlock serve``'s reader (``helpers.llamaswap``).
"""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from helpers.llamaswap import PROXY, STORE, Case, m, named, no, ok, verdict

from vramlock.cli import parse_duration
from vramlock.serve.config import Config, Filters, load

pytestmark = pytest.mark.timeout(30)


def read(path: Path) -> Config:
    return load(str(path), parse_duration)


TM = "models:\n  test-model:\n    cmd: /path/to/server -p ${PORT}\n"
ONE = "models:\n  model1:\n    cmd: server --port ${PORT}\n"


def tm(c: Config) -> object:
    return m(c, "test-model").metadata


def unload(c: Config, name: str = "model1") -> object:
    """A model's unloadTimeout as it takes effect: its own, else the top level's."""
    return m(c, name).unload_timeout or c.unload_timeout


METADATA = [
    ok(
        "typed-macros-in-metadata",
        "startPort: 10000\nmacros:\n  PORT_NUM: 10001\n"
        '  TEMP: 0.7\n  ENABLED: true\n  NAME: "llama model"\n  CTX: 16384\n'
        + TM
        + "    metadata:\n      port: ${PORT_NUM}\n      temperature: ${TEMP}\n"
        "      enabled: ${ENABLED}\n      model_name: ${NAME}\n      context: ${CTX}\n"
        '      note: "Running on port ${PORT_NUM} with temp ${TEMP} and context ${CTX}"\n',
        tm,
        {
            "port": 10001,
            "temperature": 0.7,
            "enabled": True,
            "model_name": "llama model",
            "context": 16384,
            "note": "Running on port 10001 with temp 0.7 and context 16384",
        },
    ),
    ok(
        "nested-structures-in-metadata",
        "startPort: 10000\nmacros:\n  TEMP: 0.7\n"
        + TM
        + "    metadata:\n      config:\n        port: ${PORT}\n        temperature: ${TEMP}\n"
        '      tags: ["model:${MODEL_ID}", "port:${PORT}"]\n      nested:\n        deep:\n'
        "          value: ${TEMP}\n",
        tm,
        {
            "config": {"port": 10000, "temperature": 0.7},
            "tags": ["model:test-model", "port:10000"],
            "nested": {"deep": {"value": 0.7}},
        },
    ),
    ok(
        "model-macro-precedence-in-metadata",
        "startPort: 10000\nmacros:\n  TEMP: 0.5\n"
        '  GLOBAL_VAL: "global"\n' + TM + "    macros:\n      TEMP: 0.9\n"
        '      LOCAL_VAL: "local"\n    metadata:\n      temperature: ${TEMP}\n'
        "      global: ${GLOBAL_VAL}\n      local: ${LOCAL_VAL}\n",
        tm,
        {"temperature": 0.9, "global": "global", "local": "local"},
    ),
    no(
        "unknown-macro-in-metadata",
        "startPort: 10000\n" + TM + "    metadata:\n      value: ${UNKNOWN_MACRO}\n",
        "model 'test-model': metadata: ${UNKNOWN_MACRO} is not a defined macro",
    ),
    no(
        "macro-of-a-mapping",
        "startPort: 10000\nmacros:\n  INVALID:\n    nested: value\n" + TM,
        "INVALID must be a string, a number or a flag",
    ),
    *(
        ok(
            f"macro-of-type-{kind}",
            f"startPort: 10000\nmacros:\n  {value}\n" + TM,
            lambda c: list(c.models),
            ["test-model"],
        )
        for kind, value in [
            ("string", 'STR: "test"'),
            ("int", "NUM: 42"),
            ("float", "FLOAT: 3.14"),
            ("bool", "BOOL: true"),
        ]
    ),
    no(
        "macro-of-type-array",
        "startPort: 10000\nmacros:\n  ARR: [1, 2, 3]\n" + TM,
        "ARR must be a string, a number or a flag",
    ),
    no(
        "macro-of-type-map",
        "startPort: 10000\nmacros:\n  MAP:\n    key: value\n" + TM,
        "MAP must be a string, a number or a flag",
    ),
]

API_KEYS = [
    *(
        no(
            f"api-key-{name}",
            f"apiKeys: {keys}\n",
            f"apiKeys[{index}]: a key must be non-empty, without spaces",
        )
        for name, keys, index in [
            ("empty", '[""]', 0),
            ("blank", '["   "]', 0),
            ("leading-space", '[" key123"]', 0),
            ("trailing-space", '["key123 "]', 0),
            ("middle-space", '["key 123"]', 0),
            ("second-has-space", '["valid-key", "bad key"]', 1),
            ("empty-among-valid", '["valid-key", "", "another-key"]', 1),
        ]
    ),
    ok(
        "api-key-from-env",
        'apiKeys: ["${env.TEST_API_KEY}"]\n',
        lambda c: c.api_keys,
        ("secret-key-123",),
        env={"TEST_API_KEY": "secret-key-123"},
    ),
    ok(
        "api-keys-from-env",
        'apiKeys: ["${env.TEST_API_KEY_1}", "${env.TEST_API_KEY_2}", "static-key"]\n',
        lambda c: c.api_keys,
        ("key-one", "key-two", "static-key"),
        env={"TEST_API_KEY_1": "key-one", "TEST_API_KEY_2": "key-two"},
    ),
    no(
        "api-key-env-unset",
        'apiKeys: ["${env.NONEXISTENT_API_KEY}"]\n',
        "NONEXISTENT_API_KEY is not set",
    ),
    no(
        "api-key-env-empty",
        'apiKeys: ["${env.TEST_EMPTY_KEY}"]\n',
        "apiKeys[0]: a key must be non-empty",
        env={"TEST_EMPTY_KEY": ""},
    ),
]

LIFETIMES = [
    ok("global-ttl-for-models", "globalTTL: 300\n" + ONE, lambda c: m(c, "model1").ttl, 300.0),
    ok(
        "ttl-0-over-global-ttl",
        "globalTTL: 300\n" + ONE + "    ttl: 0\n",
        lambda c: m(c, "model1").ttl,
        0.0,
    ),
    ok(
        "ttl-over-global-ttl",
        "globalTTL: 300\n" + ONE + "    ttl: 600\n",
        lambda c: m(c, "model1").ttl,
        600.0,
    ),
    ok("global-ttl-default-0", ONE, lambda c: m(c, "model1").ttl, 0.0),
    no(
        "global-ttl-negative",
        "globalTTL: -1\n" + ONE,
        "globalTTL must be a number of seconds, at least 0",
    ),
    ok("unload-timeout-global", "unloadTimeout: 25\n" + ONE, unload, 25.0),
    ok(
        "unload-timeout-per-model",
        "unloadTimeout: 25\n" + ONE + "    unloadTimeout: 45\n"
        "  model2:\n    cmd: server --port ${PORT}\n",
        lambda c: (unload(c), unload(c, "model2")),
        (45.0, 25.0),
    ),
    ok(
        "unload-timeout-0-is-global",
        "unloadTimeout: 25\n" + ONE + "    unloadTimeout: 0\n",
        unload,
        25.0,
    ),
    no(
        "unload-timeout-negative",
        "unloadTimeout: -1\n" + ONE,
        "unloadTimeout must be a number of seconds, at least 0",
    ),
    no(
        "model-unload-timeout-negative",
        ONE + "    unloadTimeout: -1\n",
        "unloadTimeout must be a number of seconds, at least 0",
    ),
    ok(
        "timeouts",
        ONE + "    timeouts:\n      connect: 45\n      responseHeader: 120\n",
        lambda c: astuple(m(c, "model1").timeouts),
        (45.0, 120.0, None),
    ),
    ok("timeouts-default", ONE, lambda c: astuple(m(c, "model1").timeouts), (30.0, None, None)),
    ok(
        "timeouts-0-is-none",
        ONE + "    timeouts:\n      connect: 0\n      responseHeader: 0\n",
        lambda c: astuple(m(c, "model1").timeouts),
        (None, None, None),
    ),
    ok(
        "peer-timeouts",
        "peers:\n  peer1:\n    proxy: http://example.com\n    models: [model1]\n"
        "    timeouts:\n      connect: 45\n      responseHeader: 120\n",
        lambda c: astuple(c.peers["peer1"].timeouts),
        (45.0, 120.0, 10.0),
    ),
    ok(
        "peer-timeouts-default",
        "peers:\n  peer1:\n    proxy: http://example.com\n    models: [model1]\n",
        lambda c: astuple(c.peers["peer1"].timeouts),
        (30.0, 60.0, 10.0),
    ),
]

OTHERS = [
    ok(
        "store-path", "store:\n  path: /tmp/llama-swap.db\n", lambda c: c.models, {}, diverges=STORE
    ),
    ok("store-path-empty", 'store:\n  path: ""\n', lambda c: c.models, {}, diverges=STORE),
    ok(
        "store-path-in-no-directory",
        "store:\n  path: /no/such/dir/llama-swap.db\n",
        lambda c: c.models,
        {},
        diverges=STORE,
    ),
    ok(
        "upstream-default",
        "models:\n  model1:\n    cmd: path/to/cmd --arg1 one\n" + PROXY,
        lambda c: [
            bool(p.search(x))
            for p in c.ignore_paths
            for x in ("/foo.js", "/bar/baz.json", "/favicon.ico", "/v1/models")
        ],
        [True, True, True, False],
    ),
    ok("upstream-empty", "upstream: {}\n", lambda c: len(c.ignore_paths), 1),
    ok(
        "upstream-ignore-paths",
        "upstream:\n  ignorePaths:\n"
        '    - ".*\\\\.(js|json|css|png|gif|jpg|jpeg|txt)$"\n    - "^/static/.*"\n',
        lambda c: [
            bool(p.search(x))
            for p in c.ignore_paths
            for x in ("/foo.js", "/static/foo.png", "/v1/chat/completions")
        ],
        [True, True, False, False, True, False],
    ),
    no(
        "upstream-bad-regexp",
        'upstream:\n  ignorePaths:\n    - "[invalid("\n',
        "upstream.ignorePaths: invalid regular expression",
    ),
    ok("performance-default", ONE, lambda c: c.performance_every, 5.0),
    ok(
        "performance-every",
        "performance:\n  enable: true\n  every: 30s\n" + ONE,
        lambda c: c.performance_every,
        30.0,
    ),
    ok(
        "performance-disabled",
        "performance:\n  disabled: true\n" + ONE,
        lambda c: c.performance_every,
        None,
    ),
    ok(
        "performance-every-only",
        "performance:\n  every: 10s\n" + ONE,
        lambda c: c.performance_every,
        10.0,
    ),
    no(
        "performance-every-4s",
        "performance:\n  every: 4s\n" + ONE,
        "performance.every must be a duration of at least 5s",
    ),
    ok(
        "performance-every-1m30s",
        "performance:\n  every: 1m30s\n" + ONE,
        lambda c: c.performance_every,
        90.0,
    ),
    ok(
        "ui-session-id-default",
        "",
        lambda c: c.session_headers,
        ("X-Session-ID", "X-Litellm-Session-Id"),
    ),
    ok(
        "ui-session-id",
        "ui:\n  activity:\n    session_id: [' X-Trace-ID ', '', x-trace-id, X-Session-ID]\n",
        lambda c: c.session_headers,
        ("X-Trace-ID", "X-Session-ID"),
    ),
    ok(
        "ui-session-id-empty",
        "ui:\n  activity:\n    session_id: []\n",
        lambda c: c.session_headers,
        (),
    ),
    ok(
        "command-split",
        "models:\n  model1:\n    proxy: http://localhost:8080\n    cmd: |\n"
        '      python model1.py \\\n        -a "double quotes" \\\n'
        "        --arg2 'single quotes'\n        -s\n        # comment 1\n"
        "        --arg3 123 \\\n          # comment 2\n        --arg4 '\"string in string\"'\n"
        "        # this will get stripped out as well as the white space above\n"
        "        -c \"'single quoted'\"\n",
        lambda c: m(c, "model1").command,
        [
            "python",
            "model1.py",
            "-a",
            "double quotes",
            "--arg2",
            "single quotes",
            "-s",
            "--arg3",
            "123",
            "--arg4",
            '"string in string"',
            "-c",
            "'single quoted'",
        ],
    ),
    no("command-empty", 'models:\n  model1:\n    cmd: ""\n' + PROXY, "cmd is empty"),
    ok(
        "model-defaults",
        "models:\n  model1:\n    cmd: path/to/cmd --port ${PORT}\n",
        lambda c: (
            c.health_timeout,
            c.log_level,
            c.log_time_format,
            m(c, "model1").command,
            m(c, "model1").upstream,
            m(c, "model1").check_endpoint,
            m(c, "model1").aliases,
            m(c, "model1").env,
            m(c, "model1").ttl,
            m(c, "model1").unlisted,
            m(c, "model1").filters,
            m(c, "model1").stop_command,
        ),
        (
            120.0,
            "info",
            None,
            ["path/to/cmd", "--port", "5800"],
            "127.0.0.1:5800",
            "/health",
            (),
            {},
            0.0,
            False,
            Filters(),
            None,
        ),
    ),
    ok(
        "find-by-name-or-alias",
        "models:\n  model1:\n    cmd: python model1.py\n"
        + PROXY
        + "    aliases: [m1, model-one]\n  model2:\n    cmd: python model2.py\n"
        "    proxy: http://localhost:8081\n    aliases: [m2, model-two]\n",
        lambda c: [
            x.name if (x := c.find(n)) else None for n in ("m1", "model-one", "model2", "m2", "m3")
        ],
        ["model1", "model1", "model2", "model2", None],
    ),
]

CASES = [*METADATA, *API_KEYS, *LIFETIMES, *OTHERS]


@pytest.mark.parametrize("case", CASES)
def test_llama_swap_s_verdict(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict(case, read, tmp_path, monkeypatch)


def test_the_count() -> None:
    """How many of llama-swap's cases are here, and how many differ (each named)."""
    assert named(CASES) == (57, 3)
