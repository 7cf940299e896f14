"""llama-swap's routing keys as ``vramlock serve`` reads them: groups and the matrix
(which models may be resident together, and whom a request's model evicts), the fifo
scheduler's priorities; every mistake a ConfigError naming its file and line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from vramlock.cli import parse_duration
from vramlock.serve.config import Config, ConfigError, load

pytestmark = pytest.mark.timeout(30)


def read(tmp_path: Path, text: str, names: str = "a b c d e") -> Config:
    models = "".join(f"  {n}:\n    cmd: srv ${{PORT}}\n" for n in names.split())
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text) + "models:\n" + models)
    return load(str(path), parse_duration)


GROUPS = """\
    routing:
      router:
        use: group
        settings:
          groups:
            pair:
              swap: false
              exclusive: false
              members: [a, b]
            swapped:
              members: [c, d]
            forever:
              persistent: true
              swap: false
              exclusive: false
              members: [e]
    """


def test_groups_decide_whom_a_model_evicts(tmp_path: Path) -> None:
    rules = read(tmp_path, GROUPS, "a b c d e f").routing
    assert rules.engine == "group"
    assert rules.evict("b", ["a"]) == []  # swap: false, together
    assert rules.evict("d", ["a", "c", "e"]) == ["a", "c"]  # swaps, exclusive; e persists
    assert rules.evict("a", ["c", "e"]) == []  # not exclusive: other groups stay
    assert rules.evict("f", ["a", "c", "e"]) == ["a", "c"]  # in no group: swaps, exclusive
    assert rules.evict("c", ["c", "d"]) == []  # resident already: nothing to do
    assert rules.together("a", "b") and not rules.together("c", "d")


def test_old_top_level_groups_mean_the_same(tmp_path: Path) -> None:
    text = "groups:\n  g:\n    members: [a, b]\n"
    rules = read(tmp_path, text).routing
    assert rules.evict("b", ["a", "c"]) == ["a", "c"]
    # no groups: every model in llama-swap's default group, one at a time
    assert read(tmp_path, "groups: {}\n").routing.evict("b", ["a"]) == ["a"]
    router = "routing:\n  router:\n    use: group\n"
    assert read(tmp_path, router).routing.evict("b", ["a", "c"]) == ["a", "c"]


MATRIX = """\
    matrix:
      vars:
        x: a
      evict_costs:
        x: 50
        d: 30
      sets:
        standard: "(x | b) & c"
        more: "+standard & e"
        alone: "d"
    """


def test_the_matrix_evicts_the_cheapest_way(tmp_path: Path) -> None:
    rules = read(tmp_path, MATRIX, "a b c d e f").routing
    assert rules.engine == "matrix"
    assert rules.sets[0] == ("standard", (frozenset("ac"), frozenset("bc")))
    assert rules.sets[1][1] == (frozenset("ace"), frozenset("bce"))
    assert rules.evict("c", ["a", "b"]) == ["b"]  # a costs 50 to evict, b 1
    assert rules.evict("e", ["a", "c"]) == []  # [a, c, e] holds all three
    assert rules.evict("d", ["a", "c"]) == ["a", "c"]  # d alone
    assert rules.evict("f", ["d"]) == ["d"]  # in no set: alone
    assert rules.evict("c", ["e", "d"]) == ["d"]  # [a, c, e]: only d goes
    assert rules.together("a", "e") and not rules.together("a", "b")


def test_matrix_ties_go_to_the_first_combination_defined(tmp_path: Path) -> None:
    first = read(tmp_path, 'matrix:\n  sets:\n    s: "(a | b) & c"\n').routing
    assert first.evict("c", ["a", "b"]) == ["b"]
    second = read(tmp_path, 'matrix:\n  sets:\n    s: "b & c"\n    t: "a & c"\n').routing
    assert second.evict("c", ["a", "b"]) == ["a"]


def test_routing_matrix_and_the_scheduler_s_priorities(tmp_path: Path) -> None:
    text = """\
        routing:
          router:
            use: matrix
            settings:
              groups: {g: {members: [a]}}
              matrix: {sets: {s: "a & b"}}
          scheduler:
            use: fifo
            settings: {fifo: {priority: {a: 10, b: 5}}}
        """
    rules = read(tmp_path, text).routing
    assert (rules.engine, rules.evict("b", ["a", "c"])) == ("matrix", ["c"])
    assert rules.priority == {"a": 10, "b": 5}
    assert read(tmp_path, "routing: {scheduler: {use: fifo}}\n").routing.engine is None


def test_a_group_member_that_is_no_model_is_left_out_saying_so(tmp_path: Path) -> None:
    """As llama-swap does (its own example's groups name models it does not define)."""
    config = read(tmp_path, "groups:\n  g:\n    members: [a, nope]\n")
    assert config.routing.groups[0].members == ("a",)
    assert config.warnings == [
        f"{tmp_path / 'config.yaml'}:3: groups: group 'g': no model 'nope': left out of the group"
    ]


def test_a_priority_of_an_alias_is_its_model_s(tmp_path: Path) -> None:
    """llama-swap takes a model's alias as a priority's name, as it takes the model's."""
    text = "routing:\n  scheduler:\n    settings:\n      fifo:\n        priority: {al: 3}\n"
    models = "models:\n  a:\n    cmd: srv ${PORT}\n    aliases: [al]\n"
    path = tmp_path / "config.yaml"
    path.write_text(text + models)
    config = load(str(path), parse_duration)
    assert (config.routing.priority, config.warnings) == ({"a": 3}, [])


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("groups:\n  g:\n    members: [a]\n  h:\n    members:\n      - b\n      - a\n", 7,
         "groups: group 'h': model 'a' is in group 'g' already"),
        ("groups:\n  g:\n    swap: no\n", 2, "groups: group 'g': no members"),
        ("groups:\n  g:\n    members: [a]\n    swap: maybe\n", 4, "swap must be true or false"),
        ("matrix:\n  sets:\n    s: \"a & (b | c\"\n", 3, "matrix.sets: s: a '(' is not closed"),
        ("matrix:\n  sets:\n    s: \"a & & b\"\n", 3, "matrix.sets: s: unexpected '&'"),
        ("matrix:\n  sets:\n    s: \"a ; b\"\n", 3, "s: unexpected character ';'"),
        ("matrix:\n  sets:\n    s: \"a & +t\"\n", 3, "matrix.sets: s: +t: no set 't'"),
        ("matrix:\n  sets:\n    s: \"a & +t\"\n    t: \"+s\"\n", 3,
         "matrix.sets: a cycle: s -> t -> s"),
        ("matrix:\n  sets:\n    s: \"a & zz\"\n", 3, "matrix.sets: s: no var or model 'zz'"),
        ("matrix:\n  vars:\n    bad_name: a\n  sets: {s: a}\n", 3,
         "matrix.vars: bad name 'bad_name' (1-32 letters, digits, '-' or '.')"),
        ("matrix:\n  vars:\n    v: nope\n  sets: {s: a}\n", 3, "matrix.vars: v: no model 'nope'"),
        ("matrix:\n  evict_costs:\n    a: 0\n  sets: {s: a}\n", 3,
         "matrix.evict_costs: a's must be a whole number above 0"),
        ("matrix:\n  evict_costs:\n    q: 2\n  sets: {s: a}\n", 3,
         "matrix.evict_costs: no var or model 'q'"),
        ("matrix:\n  vars: {}\n", 2, "matrix: no sets"),
        ("matrix:\n  sets:\n    s: \"" + " & ".join(["(a | b)"] * 16) + "\"\n", 3,
         "s: expands to more than 32768 combinations"),
        ("groups: {}\nmatrix:\n  sets: {s: a}\n", 2, "give groups or matrix, not both"),
        ("groups: {}\nrouting:\n  router: {use: group}\n", 1,
         "groups: give routing.router or the top-level groups/matrix, not both"),
        ("routing:\n  router:\n    use: random\n", 3, "routing.router.use: unknown router"
         " 'random' (group or matrix)"),
        ("routing:\n  router:\n    use: matrix\n", 3,
         "routing.router.use is matrix, but routing.router.settings has no matrix"),
        ("routing:\n  scheduler:\n    use: lifo\n", 3,
         "routing.scheduler.use: unknown scheduler 'lifo' (fifo)"),
        ("routing:\n  scheduler:\n    settings:\n      fifo:\n        priority:\n          a: hi\n",
         6, "priority: a's must be a whole number"),
        ("routing:\n  scheduler:\n    settings:\n      fifo:\n        priority: {a: 3, A: 10}\n",
         5, "routing.scheduler.settings.fifo.priority references unknown model 'A'"),
        ("unloadTimeout: -1\n", 1, "unloadTimeout must be a number of seconds, at least 0"),
    ],
    ids=["two-groups", "no-members", "bad-flag", "paren", "operator",
         "character", "unknown-ref", "cycle", "unknown-name", "var-name", "var-model",
         "cost-zero", "cost-unknown", "no-sets", "too-many", "groups-and-matrix",
         "legacy-and-routing", "unknown-router", "matrix-missing", "unknown-scheduler",
         "priority-number", "priority-no-model", "unload-timeout"],
)  # fmt: skip
def test_routing_errors_name_file_and_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        read(tmp_path, text)
    assert str(err.value).startswith(f"{tmp_path / 'config.yaml'}:{line}: ")
    assert message in str(err.value)
    assert err.value.exit_status == 2


def test_unload_timeout_and_timeouts(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent("""\
        unloadTimeout: 5
        models:
          a:
            cmd: srv ${PORT}
            unloadTimeout: 0
            timeouts: {connect: 0, responseHeader: 60, idleConn: 90, tlsHandshake: 10}
          b:
            cmd: srv ${PORT}
            unloadTimeout: 2
            timeouts: {connect: soon}
        """)
    )
    with pytest.raises(ConfigError, match=r"config.yaml:10: model 'b': timeouts: connect must"):
        load(str(path), parse_duration)
    path.write_text(path.read_text().replace("connect: soon", "responseHeader: 0"))
    config = load(str(path), parse_duration)
    a, b = config.models["a"], config.models["b"]
    assert (config.unload_timeout, a.unload_timeout, b.unload_timeout) == (5, None, 2)
    assert (a.timeouts.connect, a.timeouts.header) == (None, 60)
    assert (b.timeouts.connect, b.timeouts.header) == (30, None)  # llama-swap's defaults
    assert [w.split(": ", 3)[3].split(" ignored")[0] for w in config.warnings] == [
        "idleConn", "tlsHandshake"]  # fmt: skip


def test_cmd_stop_is_a_shell_line_its_pid_the_command_s(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent("""\
        macros: {stopper: "docker stop"}
        models:
          box:
            cmd: docker run --name ${MODEL_ID} -p ${PORT}:8080 image
            cmdStop: ${stopper} ${MODEL_ID} "a b" x${PID}y
          plain:
            cmd: srv ${PORT}
        """)
    )
    config = load(str(path), parse_duration)
    box = config.models["box"]
    assert box.stop_command == "docker stop box 'a b' x\"$VRAMLOCK_CHILD_PID\"y"
    assert box.release == "restart" and box.run_options[:2] == ("--release", "restart")
    assert config.models["plain"].stop_command is None


@pytest.mark.parametrize(
    ("model", "line", "message"),
    [
        ("    cmdStop: stop\n    release: signal\n", 5,
         "model 'a': cmdStop stops the model to release it: release must be restart"),
        ("    cmdStop: kill \"${PID}\n", 4, "model 'a': cmdStop: No closing quotation"),
        ("    cmdStop: \"\"\n", 4, "model 'a': cmdStop is empty"),
    ],
    ids=["release", "quote", "empty"],
)  # fmt: skip
def test_cmd_stop_errors(tmp_path: Path, model: str, line: int, message: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"models:\n  a:\n    cmd: srv ${{PORT}}\n{model}")
    with pytest.raises(ConfigError) as err:
        load(str(path), parse_duration)
    assert str(err.value) == f"{path}:{line}: {message}"


@pytest.mark.parametrize(
    ("model", "line", "where"),
    [("    cmd: srv ${PORT} ${PID}\n", 3, "cmd"),
     ("    cmd: srv ${PORT}\n    env: ['A=${kill}']\n", 4, "env")],
    ids=["cmd", "env-by-macro"],
)  # fmt: skip
def test_pid_is_for_cmd_stop_only(tmp_path: Path, model: str, line: int, where: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"macros: {{kill: 'kill ${{PID}}'}}\nmodels:\n  a:\n{model}")
    with pytest.raises(ConfigError) as err:
        load(str(path), parse_duration)
    assert str(err.value) == f"{path}:{line + 1}: model 'a': {where}: ${{PID}} is for cmdStop"


def test_a_macro_may_hold_pid_for_cmd_stop(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("macros: {kill: 'kill ${PID}'}\nmodels:\n  a:\n    cmd: srv ${PORT}\n"
                    "    cmdStop: ${kill}\n")  # fmt: skip
    model = load(str(path), parse_duration).models["a"]
    assert model.stop_command == 'kill "$VRAMLOCK_CHILD_PID"'
