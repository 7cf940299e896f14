"""llama-swap's own configuration tests (its ``internal/config``: models, filters,
peers, selectors and profiles, ``-config-dir``), ported as tables: the YAML of each case
and llama-swap's verdict, checked against ``vramlock serve``'s reader
(``helpers.llamaswap``). Macros, ports and the environment: test_serve_config_llamaswap.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("yaml")

from helpers.llamaswap import ARENA, COMPAT, Case, m, named, no, ok, verdict

from vramlock.cli import parse_duration
from vramlock.serve.config import Config, ConfigError, load

pytestmark = pytest.mark.timeout(30)


def read(path: Path) -> Config:
    return load(str(path), parse_duration)


PEER = "peers:\n  openrouter:\n    proxy: https://openrouter.ai/api\n    models: [m]\n"
SEL_BASE = """\
models:
  a:
    cmd: echo ${PORT}
    aliases: [alias-a]
    filters:
      setParamsByID:
        variant:
          temperature: 0
  b:
    cmd: echo ${PORT}
peers:
  remote:
    proxy: http://example.com
    models: [remote-model]
"""

CAPS = "models:\n  model1:\n    cmd: path/to/cmd --port ${PORT}\n    capabilities:\n"
MODELS = [
    ok(
        "merge-key-anchors-in-capabilities",
        "defs:\n  llm: &llm\n    in: [text]\n"
        "    out: [text]\n    tools: true\nmodels:\n  glm:\n    capabilities:\n"
        "      <<: [*llm]\n      context: 202752\n    cmd: |\n      ./llama-server\n"
        "      # .... some other parameters\n      --port ${PORT}\n",
        lambda c: m(c, "glm").capabilities,
        {"in": ["text"], "out": ["text"], "tools": True, "context": 202752},
    ),
    ok(
        "merge-key-anchors-with-model-macros",
        "macros:\n  default_ctx: 98304\ndefs:\n"
        "  llm: &llm\n    in: [text]\n    context: ${default_ctx}\nmodels:\n  model1:\n"
        "    cmd: c --port ${PORT}\n    macros:\n      default_ctx: 4096\n"
        "    capabilities:\n      <<: [*llm]\n  model2:\n    cmd: c --port ${PORT}\n"
        "    macros:\n      default_ctx: 8192\n    capabilities:\n      <<: [*llm]\n",
        lambda c: [x.capabilities["context"] for x in c.models.values()],
        [4096, 8192],
    ),
    ok(
        "strip-params-cleaned",
        'macros:\n  default_strip: "temperature, top_p"\n'
        "models:\n  model1:\n    cmd: c --port ${PORT}\n    filters:\n"
        '      stripParams: "model, top_k, top_k, temperature, ${default_strip}, , ,"\n',
        lambda c: sorted(set(m(c, "model1").filters.strip) - {"model"}),
        ["temperature", "top_k", "top_p"],
    ),
    ok(
        "legacy-strip-params",
        'macros:\n  default_strip: "temperature, top_p"\n'
        "models:\n  legacy:\n    cmd: c --port ${PORT}\n    filters:\n"
        '      strip_params: "model, top_k, top_k, temperature, ${default_strip}, , ,"\n',
        lambda c: sorted(set(m(c, "legacy").filters.strip) - {"model"}),
        ["temperature", "top_k", "top_p"],
    ),
    ok(
        "send-loading-state",
        "sendLoadingState: true\nmodels:\n  model1:\n"
        "    cmd: c --port ${PORT}\n    sendLoadingState: false\n  model2:\n"
        "    cmd: c --port ${PORT}\n",
        lambda c: (m(c, "model1").loading_state, m(c, "model2").loading_state),
        (False, True),
    ),
    ok(
        "comfyui-concurrency",
        "models:\n  comfyui_auto:\n    cmd: c --port ${PORT}\n    concurrencyLimit: 5\n",
        lambda c: m(c, "comfyui_auto").concurrency,
        50,
    ),
    ok(
        "line-continuations",
        "models:\n  model1:\n    cmd: |\n      python model1.py \\\n"
        "        --arg1 value1 \\\n        --arg2 ${PORT}\n",
        lambda c: m(c, "model1").command,
        ["python", "model1.py", "--arg1", "value1", "--arg2", "5800"],
    ),
    no(
        "capability-in-video",
        CAPS + "      in: [text, video]\n",
        "capabilities.in: invalid modality 'video'",
    ),
    no(
        "capability-out-video",
        CAPS + "      out: [video]\n",
        "capabilities.out: invalid modality 'video'",
    ),
    no(
        "capability-negative-context",
        CAPS + "      context: -1\n",
        "capabilities.context must be a whole number >= 0",
    ),
    ok(
        "capability-modality-from-macro",
        "macros:\n  img: image\n" + CAPS + "      in: [text, '${img}']\n      out: [text]\n",
        lambda c: m(c, "model1").capabilities["in"],
        ["text", "image"],
    ),
    no(
        "duplicate-alias",
        "models:\n  m1:\n    cmd: c ${PORT}\n    aliases: [a]\n"
        "  m2:\n    cmd: c ${PORT}\n    aliases: [a]\n",
        "alias 'a' is taken",
    ),
    no(
        "set-params-by-id-is-a-model",
        "models:\n  m1:\n    cmd: c ${PORT}\n    filters:\n"
        "      setParamsByID:\n        m2: {t: 1}\n  m2:\n    cmd: c ${PORT}\n",
        "model 'm2' is already an alias",
    ),
    ok(
        "set-params-by-id-own-alias",
        "models:\n  m1:\n    cmd: c ${PORT}\n    aliases: [v]\n"
        "    filters:\n      setParamsByID:\n        v: {t: 1}\n        m1: {t: 2}\n",
        lambda c: m(c, "m1").aliases,
        ("v",),
    ),
    no(
        "negative-ttl",
        "models:\n  m1:\n    cmd: c ${PORT}\n    ttl: -5\n",
        "ttl must be a number of seconds, at least -1",
    ),
    no("negative-global-ttl", "globalTTL: -1\n", "globalTTL must be a number of seconds"),
    ok(
        "ttl-default-is-global",
        "globalTTL: 300\nmodels:\n  m1:\n    cmd: c ${PORT}\n"
        "  m2:\n    cmd: c ${PORT}\n    ttl: 0\n  m3:\n    cmd: c ${PORT}\n    ttl: -1\n",
        lambda c: [x.ttl for x in c.models.values()],
        [300.0, 0.0, 300.0],
    ),
    no("api-key-with-space", 'apiKeys: ["a b"]\n', "apiKeys[0]: a key must be non-empty"),
    no("api-key-empty", 'apiKeys: [""]\n', "apiKeys[0]: a key must be non-empty"),
    no("log-to-stdout-unknown", "logToStdout: all\n", "logToStdout must be one of"),
    no(
        "ignore-paths-bad-regexp",
        "upstream:\n  ignorePaths: ['(']\n",
        "upstream.ignorePaths: invalid regular expression",
    ),
    ok(
        "ignore-paths-default",
        "",
        lambda c: [p.pattern for p in c.ignore_paths],
        [r".*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$"],
    ),
    no(
        "performance-every-too-short",
        "performance:\n  every: 1s\n",
        "performance.every must be a duration of at least 5s",
    ),
    ok(
        "performance-disabled",
        "performance:\n  disabled: true\n",
        lambda c: c.performance_every,
        None,
    ),
    no("peer-without-proxy", "peers:\n  p:\n    models: [m]\n", "proxy is required"),
    no("peer-without-models", "peers:\n  p:\n    proxy: http://h\n", "models must not be empty"),
    no(
        "peer-empty-models",
        "peers:\n  p:\n    proxy: http://h\n    models: []\n",
        "models must not be empty",
    ),
    no(
        "peer-name-is-a-model",
        "peers:\n  p:\n    proxy: http://h\n    models: [x]\nmodels:\n  p/x:\n    cmd: c ${PORT}\n",
        "p/x is already a local model's name",
    ),
    no(
        "peer-names-ambiguous",
        "peers:\n  a:\n    proxy: http://h\n    models: [b/c]\n"
        "  a/b:\n    proxy: http://h\n    models: [c]\n",
        "a/b/c is also peer 'a'",
    ),
    ok("peer-timeouts-default", PEER, lambda c: c.peers["openrouter"].timeouts.header, 60.0),
    *(
        ok(
            f"comfyui-limit-{given}",
            "models:\n  comfyui_auto:\n    cmd: comfyui --port ${PORT}\n"
            + (f"    concurrencyLimit: {given}\n" if given else "")
            + "  regular:\n    cmd: regular --port ${PORT}\n    concurrencyLimit: 10\n",
            lambda c: (m(c, "comfyui_auto").concurrency, m(c, "regular").concurrency),
            (want, 10),
        )
        for given, want in [(0, 50), (10, 50), (50, 50), (60, 60)]
    ),
    ok(
        "model-compat",
        "models:\n  enabled:\n    cmd: enabled --port ${PORT}\n    compat:\n"
        "      ignoreWebsockets: true\n  default:\n    cmd: default --port ${PORT}\n",
        lambda c: sum("compat ignored" in w for w in c.warnings),
        1,
        diverges=COMPAT,
    ),
    ok(
        "set-params-by-id-aliases",
        "models:\n  model1:\n    cmd: path/to/cmd --port ${PORT}\n"
        '    filters:\n      setParamsByID:\n        "${MODEL_ID}:high":\n'
        '          reasoning_effort: high\n        "${MODEL_ID}:low":\n'
        "          reasoning_effort: low\n",
        lambda c: (m(c, "model1").aliases, c.find("model1:low").name),
        (("model1:high", "model1:low"), "model1"),
    ),
    no(
        "set-params-by-id-alias-of-two",
        "models:\n  model1:\n    cmd: c --port ${PORT}\n"
        '    filters:\n      setParamsByID:\n        "shared-alias":\n          e: high\n'
        "  model2:\n    cmd: c --port ${PORT}\n    filters:\n      setParamsByID:\n"
        '        "shared-alias":\n          e: low\n',
        "alias 'shared-alias' is taken",
    ),
    ok(
        "filters-with-set-params",
        "models:\n  model1:\n    cmd: path/to/cmd --port ${PORT}\n"
        '    filters:\n      stripParams: "top_k"\n      setParams:\n        temperature: 0.7\n'
        '        top_p: 0.9\n        stop:\n          - "<|end|>"\n          - "<|stop|>"\n',
        lambda c: (m(c, "model1").filters.strip, m(c, "model1").filters.set),
        (("top_k",), {"temperature": 0.7, "top_p": 0.9, "stop": ["<|end|>", "<|stop|>"]}),
    ),
    ok(
        "capabilities-all",
        CAPS + "      in: [text, audio, image]\n      out: [text, audio, image]\n"
        "      tools: true\n      context: 32000\n",
        lambda c: m(c, "model1").capabilities,
        {
            "in": ["text", "audio", "image"],
            "out": ["text", "audio", "image"],
            "tools": True,
            "context": 32000,
        },
    ),
    ok(
        "capabilities-partial",
        CAPS + "      tools: true\n      context: 8192\n",
        lambda c: m(c, "model1").capabilities,
        {"tools": True, "context": 8192},
    ),
    ok(
        "capabilities-none",
        "models:\n  model1:\n    cmd: c --port ${PORT}\n",
        lambda c: m(c, "model1").capabilities,
        {},
    ),
    ok(
        "capabilities-context-from-macro",
        "macros:\n  default_ctx: 98304\n"
        + CAPS
        + "      in: [text, image]\n      out: [text]\n      tools: true\n"
        "      context: ${default_ctx}\n",
        lambda c: m(c, "model1").capabilities,
        {"in": ["text", "image"], "out": ["text"], "tools": True, "context": 98304},
    ),
    ok(
        "capabilities-context-from-model-macro",
        "macros:\n  default_ctx: 4096\n"
        "models:\n  model1:\n    cmd: c --port ${PORT}\n    macros:\n      default_ctx: 65536\n"
        "    capabilities:\n      context: ${default_ctx}\n",
        lambda c: m(c, "model1").capabilities["context"],
        65536,
    ),
    ok(
        "capabilities-tools-from-macro",
        "macros:\n  has_tools: true\n" + CAPS + "      tools: ${has_tools}\n",
        lambda c: m(c, "model1").capabilities["tools"],
        True,
    ),
    ok(
        "capabilities-reranker-from-macro",
        "macros:\n  is_reranker: true\n" + CAPS + "      reranker: ${is_reranker}\n",
        lambda c: m(c, "model1").capabilities["reranker"],
        True,
    ),
    ok(
        "capabilities-quoted-macros-typed",
        "macros:\n  default_ctx: 32768\n  has_tools: true\n"
        + CAPS
        + '      context: "${default_ctx}"\n      tools: "${has_tools}"\n',
        lambda c: m(c, "model1").capabilities,
        {"context": 32768, "tools": True},
    ),
    no(
        "capabilities-unknown-macro",
        CAPS + "      context: ${undefined_macro}\n",
        "capabilities: ${undefined_macro} is not a defined macro",
    ),
]

SELECTORS = [
    ok(
        "selector-of-a-peer-model",
        "peers:\n  remote:\n    proxy: http://example.com\n"
        "    models: [remote-model]\nselectors:\n  remote-model:\n    strategy: spillover\n"
        "    targets: [remote/remote-model]\n",
        lambda c: c.selectors["remote-model"].targets,
        ("remote/remote-model",),
    ),
    ok(
        "spillover-in-a-group-that-keeps",
        "models:\n  a:\n    cmd: echo ${PORT}\n  b:\n"
        "    cmd: echo ${PORT}\ngroups:\n  pool:\n    swap: false\n    members: [a, b]\n"
        "selectors:\n  public:\n    strategy: spillover\n    targets: [a, b]\n"
        "    settings:\n      spillover: 4\n",
        lambda c: c.selectors["public"].spillover,
        4,
    ),
    ok(
        "spillover-in-a-large-matrix",
        "models:\n  target:\n    cmd: echo ${PORT}\n"
        + "".join(
            f"  model-{d}-{c}:\n    cmd: echo ${{PORT}}\n" for d in range(4) for c in range(11)
        )
        + 'matrix:\n  sets:\n    large: "target & '
        + " & ".join("(" + " | ".join(f"model-{d}-{c}" for c in range(11)) + ")" for d in range(4))
        + '"\nselectors:\n  public:\n    strategy: spillover\n    targets: [target, model-0-0]\n',
        lambda c: c.selectors["public"].targets,
        ("target", "model-0-0"),
    ),
    ok(
        "spillover-of-remote-targets",
        "peers:\n  remote:\n    proxy: http://example.com\n"
        "    models: [a, b]\nselectors:\n  public:\n    strategy: spillover\n"
        "    targets: [remote/a, remote/b]\n",
        lambda c: c.selectors["public"].targets,
        ("remote/a", "remote/b"),
    ),
    ok(
        "spillover-local-and-remote",
        "models:\n  local:\n    cmd: echo ${PORT}\npeers:\n"
        "  remote:\n    proxy: http://example.com\n    models: [remote-model]\nselectors:\n"
        "  public:\n    strategy: spillover\n    targets: [local, remote/remote-model]\n",
        lambda c: c.selectors["public"].targets,
        ("local", "remote/remote-model"),
    ),
    ok(
        "profile-pins-a-selector",
        "models:\n  a:\n    cmd: echo ${PORT}\nselectors:\n"
        "  public:\n    strategy: pin\n    targets: [a]\nprofiles:\n  coding:\n    pins:\n"
        "      llm-code: public\n",
        lambda c: c.profiles["coding"].pins,
        {"llm-code": "public"},
    ),
    ok(
        "selector-defaults-and-fields",
        "models:\n  a:\n    cmd: echo ${PORT}\n  b:\n"
        "    cmd: echo ${PORT}\ngroups:\n  balanced:\n    swap: false\n    members: [a, b]\n"
        "selectors:\n  coding:\n    strategy: warm\n    targets: [a, b]\n"
        "    name: Coding Model\n    description: Best\n    unlisted: true\n"
        "    metadata:\n      family: coding\n  workers:\n    strategy: spillover\n"
        "    targets: [a, b]\n",
        lambda c: (
            c.selectors["coding"].targets,
            c.selectors["coding"].title,
            c.selectors["coding"].unlisted,
            c.selectors["coding"].metadata,
            c.selectors["workers"].spillover,
        ),
        (("a", "b"), "Coding Model", True, {"family": "coding"}, 1),
    ),
    no(
        "selector-blank-name",
        SEL_BASE + 'selectors:\n  " ":\n    strategy: pin\n    targets: [a]\n',
        "a selector's name cannot be blank",
    ),
    no(
        "selector-without-strategy",
        SEL_BASE + "selectors:\n  public:\n    targets: [a]\n",
        "strategy is required",
    ),
    no(
        "selector-unknown-strategy",
        SEL_BASE + "selectors:\n  public:\n    strategy: random\n    targets: [a]\n",
        "'random' is not warm, pin or spillover",
    ),
    no(
        "selector-without-targets",
        SEL_BASE + "selectors:\n  public:\n    strategy: pin\n",
        "targets must have at least one entry",
    ),
    no(
        "selector-unknown-target",
        SEL_BASE + "selectors:\n  public:\n    strategy: pin\n    targets: [missing]\n",
        "selectors.public.targets[0] references unknown model 'missing'",
    ),
    no(
        "selector-chaining",
        SEL_BASE + "selectors:\n  first:\n    strategy: pin\n"
        "    targets: [a]\n  second:\n    strategy: pin\n    targets: [first]\n",
        "'first' is a selector",
    ),
    no(
        "selector-named-as-model",
        SEL_BASE + "selectors:\n  a:\n    strategy: pin\n    targets: [a]\n",
        "a model, alias or peer model is named so",
    ),
    no(
        "selector-named-as-alias",
        SEL_BASE + "selectors:\n  alias-a:\n    strategy: pin\n    targets: [a]\n",
        "a model, alias or peer model is named so",
    ),
    no(
        "selector-named-as-set-params-alias",
        SEL_BASE + "selectors:\n  variant:\n    strategy: pin\n    targets: [a]\n",
        "a model, alias or peer model is named so",
    ),
    no(
        "selector-warm-peer-target",
        SEL_BASE + "selectors:\n  public:\n    strategy: warm\n    targets: [remote-model]\n",
        "warm picks local models only",
    ),
    no(
        "selector-spillover-zero",
        SEL_BASE + "selectors:\n  public:\n"
        "    strategy: spillover\n    targets: [a]\n    settings:\n      spillover: 0\n",
        "spillover must be a number",
    ),
    no(
        "selector-duplicate-resolved",
        SEL_BASE + "selectors:\n  public:\n    strategy: spillover\n    targets: [a, alias-a]\n",
        "'a' is there twice",
    ),
    no(
        "selector-duplicate-resolved-peer",
        SEL_BASE + "selectors:\n  public:\n"
        "    strategy: spillover\n    targets: [remote-model, remote/remote-model]\n",
        "'remote/remote-model' is there twice",
    ),
    no(
        "selector-spillover-swapping-group",
        SEL_BASE + "groups:\n  g:\n    members: [a, b]\n"
        "selectors:\n  public:\n    strategy: spillover\n    targets: [a, b]\n",
        "spillover targets must share a group with swap: false",
    ),
    ok(
        "selector-spillover-without-rules",
        SEL_BASE + "selectors:\n  public:\n    strategy: spillover\n    targets: [a, b]\n",
        lambda c: c.selectors["public"].targets,
        ("a", "b"),
        diverges=ARENA,
    ),
    no(
        "selector-spillover-matrix",
        SEL_BASE + "matrix:\n  sets:\n    one: a | b\n"
        "selectors:\n  public:\n    strategy: spillover\n    targets: [a, b]\n",
        "must all appear together in one expanded matrix set",
    ),
    ok(
        "selector-spillover-matrix-together",
        SEL_BASE + "matrix:\n  sets:\n    one: a & b\n"
        "selectors:\n  public:\n    strategy: spillover\n    targets: [a, b]\n",
        lambda c: c.selectors["public"].strategy,
        "spillover",
    ),
    no("profile-as-a-list", SEL_BASE + "profiles:\n  p: [a]\n", "llama-swap's old profile"),
    no(
        "profile-without-pins",
        SEL_BASE + "profiles:\n  p:\n    description: x\n",
        "pins must have at least one entry",
    ),
    no(
        "profile-pin-to-no-model",
        SEL_BASE + "profiles:\n  p:\n    pins:\n      a: missing\n",
        "profiles.p.pins.a references unknown model 'missing'",
    ),
    ok(
        "profile-pins",
        SEL_BASE + "profiles:\n  p:\n    description: d\n    pins:\n"
        "      a: b\n      c: null\n      d: remote-model\n",
        lambda c: (c.profiles["p"].description, c.profiles["p"].pins),
        ("d", {"a": "b", "c": None, "d": "remote-model"}),
    ),
    no(
        "profile-blank-name",
        SEL_BASE + 'profiles:\n  " ":\n    pins: {a: b}\n',
        "a profile's name cannot be blank",
    ),
]


CASES = [*MODELS, *SELECTORS]


@pytest.mark.parametrize("case", CASES)
def test_llama_swap_s_verdict(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict(case, read, tmp_path, monkeypatch)


def model(name: str, cmd: str = "echo hi") -> str:
    """A model under ``models:``, at a fixed port (no ${PORT} to hand out)."""
    return f"  {name}:\n    cmd: {cmd}\n    proxy: http://localhost:9999\n"


# llama-swap's -config-dir cases: files of the directory (name: text), and "config"
# for a --config file beside it (outside the directory); the verdict as above.
MERGED = [
    ok(
        "config-only",
        {"config": "models:\n" + model("model1") + "groups:\n  group1:\n    members: [model1]\n"},
        lambda c: list(c.models),
        ["model1"],
    ),
    ok(
        "dir-only",
        {"a.yaml": "models:\n" + model("alpha"), "b.yaml": "models:\n" + model("beta")},
        lambda c: list(c.models),
        ["alpha", "beta"],
    ),
    ok(
        "config-and-dir",
        {"config": "models:\n" + model("base"), "extra.yaml": "models:\n" + model("ext")},
        lambda c: list(c.models),
        ["base", "ext"],
    ),
    no(
        "duplicate-model",
        {"a.yaml": "models:\n" + model("dup"), "b.yaml": "models:\n" + model("dup")},
        "models: 'dup' is already in another source",
    ),
    no(
        "duplicate-group",
        {
            "a.yaml": "models:\n" + model("m1") + "groups:\n  g1:\n    members: [m1]\n",
            "b.yaml": "models:\n" + model("m2") + "groups:\n  g1:\n    members: [m2]\n",
        },
        "groups: 'g1' is already in another source",
    ),
    no(
        "duplicate-peer",
        {
            "a.yaml": "peers:\n  remote:\n    proxy: http://x:1\n    models: [m1]\n",
            "b.yaml": "peers:\n  remote:\n    proxy: http://x:2\n    models: [m2]\n",
        },
        "peers: 'remote' is already in another source",
    ),
    no(
        "scalar-conflict",
        {"a.yaml": "globalTTL: 100\n", "b.yaml": "globalTTL: 200\n"},
        "conflict at globalTTL",
    ),
    ok(
        "scalar-same-value",
        {"a.yaml": "globalTTL: 100\nmodels:\n" + model("m1"), "b.yaml": "globalTTL: 100\n"},
        lambda c: m(c, "m1").ttl,
        100.0,
    ),
    ok(
        "macros-merge",
        {
            "a.yaml": "macros:\n  LOW: 1\nmodels:\n" + model("m1", "echo ${LOW}"),
            "b.yaml": "macros:\n  HIGH: 2\nmodels:\n" + model("m2", "echo ${HIGH}"),
        },
        lambda c: (m(c, "m1").command, m(c, "m2").command),
        (["echo", "1"], ["echo", "2"]),
    ),
    ok(
        "api-keys-join",
        {"a.yaml": "apiKeys: [key-a]\n", "b.yaml": "apiKeys: [key-b]\n"},
        lambda c: c.api_keys,
        ("key-a", "key-b"),
    ),
    ok(
        "routing-groups-merge",
        {
            "a.yaml": "models:\n" + model("m1") + "routing:\n"
            "  router:\n    settings:\n      groups:\n        groupA:\n          members: [m1]\n",
            "b.yaml": "models:\n" + model("m2") + "routing:\n  router:\n    settings:\n"
            "      groups:\n        groupB:\n          members: [m2]\n",
        },
        lambda c: [g.name for g in c.routing.groups],
        ["groupA", "groupB"],
    ),
    ok(
        "port-after-merge",
        {
            "a.yaml": "models:\n  m1:\n    cmd: serve --port ${PORT}\n"
            "    proxy: http://localhost:${PORT}\n"
        },
        lambda c: m(c, "m1").upstream,
        "127.0.0.1:5800",
    ),
    ok(
        "env-in-flow-list",
        {"keys.yaml": "apiKeys: [${env.TEST_API_KEY}]\n"},
        lambda c: c.api_keys,
        ("secret123",),
        env={"TEST_API_KEY": "secret123"},
    ),
    ok(
        "sorted-order",
        {
            "z.yaml": "models:\n  zmodel:\n    cmd: s ${PORT}\n",
            "a.yaml": "models:\n  amodel:\n    cmd: s ${PORT}\n",
        },
        lambda c: (list(c.models), m(c, "amodel").upstream),
        (["amodel", "zmodel"], "127.0.0.1:5800"),
    ),
    ok(
        "empty-dir-with-config",
        {"config": "models:\n" + model("m1")},
        lambda c: list(c.models),
        ["m1"],
    ),
    no("empty-dir-only", {}, "no configuration files (*.yaml, *.yml) in it"),
    ok(
        "macro-of-another-file",
        {
            "macros.yaml": "macros:\n  SHARED: hello\n",
            "use.yaml": "models:\n" + model("user", "echo ${SHARED}"),
        },
        lambda c: m(c, "user").command,
        ["echo", "hello"],
    ),
    no(
        "kind-mismatch",
        {"a.yaml": "apiKeys: [a]\n", "b.yaml": "apiKeys: {a: b}\n"},
        "conflict at apiKeys",
    ),
    ok(
        "null-yields",
        {"a.yaml": "globalTTL:\nmodels:\n" + model("m1"), "b.yaml": "globalTTL: 7\n"},
        lambda c: m(c, "m1").ttl,
        7.0,
    ),
    ok(
        "subdirectories-and-other-files-left",
        {
            "a.yaml": "models:\n" + model("a"),
            "notes.txt": "not: [yaml",
            "sub/b.yaml": "models:\n" + model("b"),
        },
        lambda c: list(c.models),
        ["a"],
    ),
]


@pytest.mark.parametrize("case", MERGED)
def test_config_dir_as_llama_swap_merges(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(case.text, dict)
    files = case.text
    directory = tmp_path / "config.d"
    directory.mkdir()
    config = None
    for name, text in files.items():
        path = tmp_path / "config.yaml" if name == "config" else directory / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        config = str(path) if name == "config" else config
    verdict(case, lambda _: load(config, parse_duration, str(directory)), tmp_path, monkeypatch)


def test_a_config_file_in_its_config_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "main.yaml").write_text("models:\n" + model("base"))
    with pytest.raises(ConfigError) as err:
        load(str(tmp_path / "main.yaml"), parse_duration, str(tmp_path))
    assert (
        str(err.value) == f"{tmp_path / 'main.yaml'}: is also in --config-dir {tmp_path}:"
        " give it once"
    )


def test_a_merge_error_names_the_file_and_line_it_comes_from(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("models:\n" + model("dup"))
    (tmp_path / "b.yaml").write_text("# the second\nmodels:\n" + model("dup"))
    with pytest.raises(ConfigError) as err:
        load(None, parse_duration, str(tmp_path))
    assert str(err.value) == f"{tmp_path / 'b.yaml'}:3: models: 'dup' is already in another source"


def test_the_count() -> None:
    """How many of llama-swap's cases are here, and how many differ (each named)."""
    assert named([*CASES, *MERGED]) == (96, 2)
