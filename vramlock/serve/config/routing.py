"""``routing:`` (``router`` and ``scheduler``) and the older top-level ``groups:`` and
``matrix:``, read into ``vramlock.serve.routing.Routing`` (what they mean is said there)."""

from __future__ import annotations

import yaml

from ..routing import Group, Routing
from .matrix import read_matrix
from .reader import Reader

ENGINES = ("group", "matrix")
SCHEDULERS = ("fifo",)


def read(
    reader: Reader,
    top: dict[str, tuple[yaml.Node, yaml.Node]],
    models: set[str],
    aliases: dict[str, str] | None = None,
) -> Routing:
    """``routing:``, ``groups:`` and ``matrix:`` of the file's top level (``aliases``:
    alias -> its model, for the priorities, which name either)."""
    router: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    scheduler: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    if "routing" in top:
        entries = reader.keyed(top["routing"][1], "routing", frozenset({"router", "scheduler"}))
        if "router" in entries:
            router = reader.keyed(
                entries["router"][1], "routing.router", frozenset({"use", "settings"})
            )
        if "scheduler" in entries:
            scheduler = reader.entries(entries["scheduler"][1], "routing.scheduler")
            known = frozenset({"use", "settings"})
            reader.check_keys(scheduler, known, {}, "routing.scheduler: ")
    legacy = [k for k in ("groups", "matrix") if k in top]
    if legacy and router:
        raise reader.fail(top[legacy[0]][0], f"{legacy[0]}: give routing.router or the"
                                             " top-level groups/matrix, not both")  # fmt: skip
    if len(legacy) == 2:
        raise reader.fail(top["matrix"][0], "matrix: give groups or matrix, not both")
    priority = _scheduler(reader, scheduler, {**(aliases or {}), **{m: m for m in models}})
    if legacy:
        name = legacy[0]
        rules = _engine(reader, name if name == "matrix" else "group", top[name][1], models)
        line = top[name][0].start_mark.line + 1
    elif router:
        rules, line = _router(reader, router, models), _line(router)
    else:
        return Routing(priority=priority)
    return Routing(engine=rules.engine, groups=rules.groups, sets=rules.sets,
                   costs=rules.costs, priority=priority, line=line)  # fmt: skip


def _line(router: dict[str, tuple[yaml.Node, yaml.Node]]) -> int:
    key = next(iter(router.values()))[0]
    return key.start_mark.line + 1


def _router(
    reader: Reader, router: dict[str, tuple[yaml.Node, yaml.Node]], models: set[str]
) -> Routing:
    use = "group"
    if "use" in router:
        use = reader.text(router["use"][1], "routing.router.use")
        if use not in ENGINES:
            raise reader.fail(router["use"][1], f"routing.router.use: unknown router {use!r}"
                                                " (group or matrix)")  # fmt: skip
    settings: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    if "settings" in router:
        settings = reader.entries(router["settings"][1], "routing.router.settings")
        known = frozenset({"groups", "matrix"})
        reader.check_keys(settings, known, {}, "routing.router.settings: ")
    if use == "matrix" and "matrix" not in settings:
        where = router["use"][1]
        raise reader.fail(where, "routing.router.use is matrix, but"
                                 " routing.router.settings has no matrix")  # fmt: skip
    key = "matrix" if use == "matrix" else "groups"
    if key not in settings:
        return Routing(engine="group")  # no groups: every model in the default one
    return _engine(reader, use, settings[key][1], models, f"routing.router.settings.{key}")


def _engine(reader: Reader, use: str, node: yaml.Node, models: set[str], what: str = "") -> Routing:
    if use == "matrix":
        return read_matrix(reader, node, models, what or "matrix")
    return Routing(engine="group", groups=_groups(reader, node, models, what or "groups"))


def _scheduler(
    reader: Reader, scheduler: dict[str, tuple[yaml.Node, yaml.Node]], names: dict[str, str]
) -> dict[str, int]:
    """routing.scheduler: fifo (the only one), and its priorities (``names``: each name
    a priority may have, a model's or an alias, -> the model's)."""
    if "use" in scheduler:
        use = reader.text(scheduler["use"][1], "routing.scheduler.use")
        if use not in SCHEDULERS:
            raise reader.fail(scheduler["use"][1], "routing.scheduler.use: unknown scheduler"
                                                   f" {use!r} (fifo)")  # fmt: skip
    if "settings" not in scheduler:
        return {}
    where = "routing.scheduler.settings"
    settings = reader.keyed(scheduler["settings"][1], where, frozenset({"fifo"}))
    if "fifo" not in settings:
        return {}
    fifo = reader.keyed(settings["fifo"][1], f"{where}.fifo", frozenset({"priority"}))
    if "priority" not in fifo:
        return {}
    out = {}
    for name, key, value in reader.pairs(fifo["priority"][1], f"{where}.fifo.priority"):
        number = reader.value(value)
        if not isinstance(number, int) or isinstance(number, bool):
            raise reader.fail(value, f"{where}.fifo.priority: {name}'s must be a whole number")
        if name not in names:
            raise reader.fail(key, f"{where}.fifo.priority references unknown model {name!r}")
        out[names[name]] = number
    return out


def _groups(reader: Reader, node: yaml.Node, models: set[str], what: str) -> tuple[Group, ...]:
    groups: list[Group] = []
    taken: dict[str, str] = {}  # model -> its group
    known = frozenset({"swap", "exclusive", "persistent", "members"})
    for name, key, value in reader.pairs(node, what):
        where = f"{what}: group {name!r}"
        fields = reader.keyed(value, where, known)
        if "members" not in fields:
            raise reader.fail(key, f"{where}: no members")
        members = fields["members"][1]
        if not isinstance(members, yaml.SequenceNode):
            raise reader.fail(members, f"{where}: members must be a list")
        names: list[str] = []
        for item in members.value:
            model = reader.text(item, f"{where}: members")
            if model in taken:
                raise reader.fail(item, f"{where}: model {model!r} is in group"
                                        f" {taken[model]!r} already")  # fmt: skip
            taken[model] = name
            if model not in models:
                # llama-swap takes such a member too (its own example has some).
                reader.warn(item, f"{where}: no model {model!r}: left out of the group")
                continue
            names.append(model)
        flags = {k: reader.flag(fields[k][1], f"{where}: {k}") for k in known - {"members"}
                 if k in fields}  # fmt: skip
        groups.append(Group(name, tuple(names), **flags))
    return tuple(groups)
