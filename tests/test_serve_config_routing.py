"""llama-swap's own configuration tests (its ``internal/config``: routing, groups,
matrix, peers and profiles), ported as tables: the YAML of each case and llama-swap's
verdict, checked against ``vramlock serve``'s reader (``helpers.llamaswap``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("yaml")

from helpers.llamaswap import ARENA, Case, named, no, ok, verdict

from vramlock.cli import parse_duration
from vramlock.serve.config import Config, load

pytestmark = pytest.mark.timeout(30)


def read(path: Path) -> Config:
    return load(str(path), parse_duration)


def models(*names: str) -> str:
    return "models:\n" + "".join(f"  {n}:\n    cmd: echo {n} ${{PORT}}\n" for n in names)


TWO = models("gemma", "qwen")


def rules(c: Config) -> tuple[object, ...]:
    r = c.routing
    return r.engine, [g.name for g in r.groups], [name for name, _ in r.sets]


def matrix(vars_: str, sets: str, costs: str = "") -> str:
    return f"matrix:\n  vars: {{{vars_}}}\n" + (f"  evict_costs: {{{costs}}}\n" if costs else "") \
        + f"  sets:\n{sets}"  # fmt: skip


FIVE = models("gemma", "qwen", "mistral", "voxtral", "llama70B", "reranker")

ROUTING = [
    ok(
        "legacy-groups",
        TWO + "groups:\n  g1:\n    members: [gemma, qwen]\n",
        rules,
        ("group", ["g1"], []),
    ),
    ok(
        "legacy-matrix",
        TWO + matrix("g: gemma, q: qwen", '    combo: "g | q"\n'),
        rules,
        ("matrix", [], ["combo"]),
    ),
    ok(
        "router-use-matrix",
        TWO + "routing:\n  router:\n    use: matrix\n    settings:\n"
        "      matrix:\n        vars: {g: gemma, q: qwen}\n        sets:\n"
        '          combo: "g | q"\n',
        rules,
        ("matrix", [], ["combo"]),
    ),
    ok(
        "router-use-group",
        TWO + "routing:\n  router:\n    use: group\n    settings:\n"
        "      groups:\n        g1:\n          members: [gemma, qwen]\n",
        rules,
        ("group", ["g1"], []),
    ),
    ok("routing-default", TWO, rules, (None, [], []), diverges=ARENA),
    no(
        "legacy-and-routing",
        TWO + "groups:\n  g1:\n    members: [gemma, qwen]\nrouting:\n  router:\n    use: group\n",
        "groups: give routing.router or the top-level groups/matrix, not both",
    ),
    no(
        "router-matrix-without-settings",
        TWO + "routing:\n  router:\n    use: matrix\n",
        "routing.router.use is matrix, but routing.router.settings has no matrix",
    ),
    ok(
        "router-settings-groups-and-matrix",
        TWO + "routing:\n  router:\n    use: group\n"
        "    settings:\n      groups:\n        g1:\n          members: [gemma, qwen]\n"
        '      matrix:\n        sets:\n          s: "gemma"\n',
        rules,
        ("group", ["g1"], []),
    ),
    no("router-unknown", TWO + "routing:\n  router:\n    use: bogus\n", "unknown router 'bogus'"),
    no(
        "fifo-priority-of-no-model",
        TWO + "routing:\n  scheduler:\n    settings:\n"
        "      fifo:\n        priority:\n          nope: 5\n",
        "fifo.priority references unknown model 'nope'",
    ),
    ok(
        "fifo-priority",
        TWO + "routing:\n  scheduler:\n    settings:\n      fifo:\n"
        "        priority:\n          gemma: 5\n",
        lambda c: c.routing.priority,
        {"gemma": 5},
    ),
    no(
        "group-member-in-two-groups",
        models("model1", "model2") + "groups:\n  group1:\n"
        "    swap: true\n    exclusive: false\n    members: [model2]\n  group2:\n"
        "    swap: true\n    exclusive: false\n    members: [model2]\n",
        "model 'model2' is in group 'group1' already",
    ),
    no(
        "groups-and-matrix",
        models("model1") + "groups:\n  group1:\n    members: [model1]\n"
        'matrix:\n  sets:\n    s: "model1"\n',
        "give groups or matrix, not both",
    ),
]

MATRIX = [
    ok(
        "matrix-basic",
        FIVE
        + matrix(
            "g: gemma, q: qwen, m: mistral, v: voxtral, L: llama70B",
            '    standard: "(g | q | m) & v"\n    full: "L"\n',
            "L: 30, v: 50",
        ),
        lambda c: (c.routing.evict("gemma", ["voxtral"]), c.routing.evict("llama70B", ["voxtral"])),
        ([], ["voxtral"]),
    ),
    ok(
        "matrix-with-refs",
        FIVE
        + matrix(
            "g: gemma, q: qwen, m: mistral, v: voxtral, e: reranker",
            '    llms: "g | q | m"\n    with_tts: "+llms & v"\n    mega: "+with_tts & e"\n',
        ),
        lambda c: c.routing.evict("reranker", ["gemma", "voxtral"]),
        [],
    ),
    ok(
        "matrix-model-names",
        FIVE + 'matrix:\n  sets:\n    combo: "gemma & voxtral"\n',
        lambda c: c.routing.evict("gemma", ["voxtral"]),
        [],
    ),
    ok(
        "matrix-vars-and-names",
        FIVE + matrix("g: gemma", '    base: "g | qwen"\n    combo: "+base & voxtral"\n'),
        lambda c: c.routing.evict("qwen", ["voxtral"]),
        [],
    ),
    ok(
        "matrix-deduplicated",
        FIVE + matrix("g: gemma", '    combo: "g & gemma"\n'),
        lambda c: c.routing.sets,
        (("combo", (frozenset({"gemma"}),)),),
    ),
    ok(
        "matrix-var-before-model",
        FIVE + matrix("qwen: gemma", '    combo: "qwen"\n'),
        lambda c: c.routing.sets,
        (("combo", (frozenset({"gemma"}),)),),
    ),
    *(
        ok(
            f"matrix-var-{name}",
            FIVE + matrix(f"{key}: gemma", f'    s: "{key}"\n'),
            lambda c: c.routing.sets,
            (("s", (frozenset({"gemma"}),)),),
        )
        for name, key in [
            ("32-long", "abcdefghijklmnopqrstuvwxyzABCDEF"),
            ("dash", "model-var"),
            ("dot", "model.var"),
        ]
    ),
    *(
        no(f"matrix-var-{name}", FIVE + matrix(f"{key}: gemma", f'    s: "{key}"\n'), "bad name")
        for name, key in [
            ("33-long", "abcdefghijklmnopqrstuvwxyzABCDEFG"),
            ("underscore", "a_b"),
            ("empty", "''"),
        ]
    ),
    no(
        "matrix-var-of-no-model",
        FIVE + matrix("x: nonexistent", '    s: "x"\n'),
        "no model 'nonexistent'",
    ),
    no(
        "matrix-cost-0",
        FIVE + matrix("g: gemma", '    s: "g"\n', "g: 0"),
        "must be a whole number above 0",
    ),
    no(
        "matrix-cost-negative",
        FIVE + matrix("g: gemma", '    s: "g"\n', "g: -1"),
        "must be a whole number above 0",
    ),
    no(
        "matrix-cost-of-no-var",
        FIVE + matrix("g: gemma", '    s: "g"\n', "unknown: 5"),
        "no var or model 'unknown'",
    ),
    ok(
        "matrix-cost-by-model-name",
        FIVE + 'matrix:\n  evict_costs: {gemma: 5}\n  sets:\n    s: "gemma"\n',
        lambda c: c.routing.costs,
        {"gemma": 5},
    ),
    no("matrix-cycle", FIVE + matrix("g: gemma", '    a: "+b"\n    b: "+a"\n'), "a cycle"),
    no(
        "matrix-ref-of-no-set",
        FIVE + matrix("g: gemma", '    a: "+nonexistent"\n'),
        "+nonexistent: no set 'nonexistent'",
    ),
    no("matrix-without-sets", FIVE + "matrix: {}\n", "matrix: no sets"),
    no(
        "matrix-name-of-nothing",
        FIVE + matrix("g: gemma", '    s: "g & nonexistent"\n'),
        "no var or model 'nonexistent'",
    ),
    ok(
        "matrix-costs-resolved",
        FIVE + matrix("g: gemma, L: llama70B", '    s: "g"\n', "L: 30, g: 5, mistral: 10"),
        lambda c: c.routing.costs,
        {"llama70B": 30, "gemma": 5, "mistral": 10},
    ),
]

PEERS = [
    ok(
        "peer",
        "peers:\n  p:\n    proxy: http://192.168.1.23\n    models: [model_a, model_b]\n",
        lambda c: (c.peers["p"].base, c.peers["p"].models),
        ("http://192.168.1.23", ("model_a", "model_b")),
    ),
    ok(
        "peer-with-api-key",
        "peers:\n  p:\n    proxy: https://openrouter.ai/api\n"
        "    apiKey: sk-test-key\n    models: [meta-llama/llama-3.1-8b-instruct]\n",
        lambda c: c.peers["p"].api_key,
        "sk-test-key",
    ),
    no("peer-missing-proxy", "peers:\n  p:\n    models: [model_a]\n", "proxy is required"),
    no(
        "peer-empty-proxy",
        'peers:\n  p:\n    proxy: ""\n    models: [model_a]\n',
        "proxy must be an http(s)://HOST[:PORT] URL",
    ),
    no(
        "peer-bad-proxy",
        'peers:\n  p:\n    proxy: "://invalid"\n    models: [model_a]\n',
        "proxy must be an http(s)://HOST[:PORT] URL",
    ),
    no(
        "peer-missing-models",
        "peers:\n  p:\n    proxy: http://localhost:8080\n",
        "models must not be empty",
    ),
    no(
        "peer-empty-models",
        "peers:\n  p:\n    proxy: http://localhost:8080\n    models: []\n",
        "models must not be empty",
    ),
    ok(
        "peer-proxy-url",
        "peers:\n  p:\n    proxy: http://192.168.1.23:8080/api\n"
        "    apiKey: sk-test\n    models: [model_a]\n",
        lambda c: c.peers["p"].base,
        "http://192.168.1.23:8080/api",
    ),
    ok(
        "peer-set-params",
        "peers:\n  p:\n    proxy: https://openrouter.ai/api\n"
        "    models: [model_a]\n    filters:\n      setParams:\n        temperature: 0.7\n"
        "        provider:\n          data_collection: deny\n",
        lambda c: c.peers["p"].filters.set,
        {"temperature": 0.7, "provider": {"data_collection": "deny"}},
    ),
    ok(
        "peer-both-filters",
        "peers:\n  p:\n    proxy: https://openrouter.ai/api\n"
        '    models: [model_a]\n    filters:\n      stripParams: "temperature, top_p"\n'
        "      setParams:\n        max_tokens: 1000\n",
        lambda c: (c.peers["p"].filters.strip, c.peers["p"].filters.set),
        (("temperature", "top_p"), {"max_tokens": 1000}),
    ),
    no(
        "peer-name-ambiguous",
        "peers:\n  a:\n    proxy: http://h\n    models: [b/c]\n"
        "  a/b:\n    proxy: http://h\n    models: [c]\n",
        "a/b/c is also peer 'a''s model",
    ),
    no(
        "peer-name-is-local-model",
        "peers:\n  peer:\n    proxy: http://h\n    models: [model]\n" + models("peer/model"),
        "peer/model is already a local model's name or alias",
    ),
    no(
        "peer-name-is-alias",
        "peers:\n  peer:\n    proxy: http://h\n    models: [model]\n"
        + models("local")
        + "    aliases: [peer/model]\n",
        "peer/model is already a local model's name or alias",
    ),
    no(
        "peer-name-is-selector",
        "peers:\n  peer:\n    proxy: http://h\n    models: [model]\n"
        + models("local")
        + "selectors:\n  peer/model:\n    strategy: pin\n"
        "    targets: [local]\n",
        "a model, alias or peer model is named so",
    ),
    no(
        "peer-name-is-pin",
        "peers:\n  peer:\n    proxy: http://h\n    models: [model]\n"
        + models("local")
        + "profiles:\n  profile:\n    pins:\n      peer/model: local\n",
        "'peer/model' is a peer's model",
    ),
    no(
        "peer-name-is-set-params-alias",
        models("local") + "    filters:\n"
        "      setParamsByID:\n        peer/model:\n          temperature: 0.5\n"
        "peers:\n  peer:\n    proxy: http://example.com\n    models: [model]\n",
        "peer/model is already a local model's name or alias",
    ),
]

PROFILE_BASE = (
    models("local") + "    aliases: [local-fast]\n    filters:\n      setParamsByID:\n"
    "        local-thinking:\n          thinking: true\n"
    "peers:\n  remote:\n    proxy: http://example.com\n    models: [peer-model]\n"
)
PROFILES = [
    ok(
        "profile-pins",
        PROFILE_BASE + "profiles:\n  coding:\n    description: Coding profile\n"
        "    pins:\n      direct: local\n      alias: local-fast\n"
        "      variant: local-thinking\n      peer: peer-model\n"
        '      peer-qualified: remote/peer-model\n      disabled-empty: ""\n'
        "      disabled-null: ~\n      local: peer-model\n",
        lambda c: (c.profiles["coding"].description, c.profiles["coding"].pins),
        (
            "Coding profile",
            {
                "direct": "local",
                "alias": "local-fast",
                "variant": "local-thinking",
                "peer": "peer-model",
                "peer-qualified": "remote/peer-model",
                "disabled-empty": None,
                "disabled-null": None,
                "local": "peer-model",
            },
        ),
    ),
    no(
        "profile-legacy-list",
        models("model") + "profiles:\n  old: [model]\n",
        "a list of models is llama-swap's old profile",
    ),
    no(
        "profile-empty-pins",
        models("model") + "profiles:\n  empty:\n    pins: {}\n",
        "pins must have at least one entry",
    ),
    no(
        "profile-pin-of-no-model",
        models("model") + "profiles:\n  bad:\n    pins:\n      public: missing\n",
        "profiles.bad.pins.public references unknown model 'missing'",
    ),
    no(
        "profiles-do-not-chain",
        models("base") + "profiles:\n  test:\n    pins:\n      first: base\n      second: first\n",
        "references unknown model 'first'",
    ),
]

CASES = [*ROUTING, *MATRIX, *PEERS, *PROFILES]


@pytest.mark.parametrize("case", CASES)
def test_llama_swap_s_verdict(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict(case, read, tmp_path, monkeypatch)


def test_the_count() -> None:
    """How many of llama-swap's cases are here, and how many differ (each named)."""
    assert named(CASES) == (56, 1)
