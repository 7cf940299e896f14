"""``vramlock serve CONFIG``: every model of a llama-swap configuration at one address.

Each model runs under its own ``vramlock run --demand listen`` wrapper (``members``),
started on the model's first request (or with serve: ``hooks.on_startup.preload``),
a member of the arena like any other; the router (``router``) takes the OpenAI API at
one address and passes each request to its model's wrapper. Needs the ``serve`` extra
(aiohttp, PyYAML); nothing else in vramlock imports this package.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ..errors import AddressError, VramlockError
from ..net.web import until_signalled

if TYPE_CHECKING:
    from .config import Config, Duration
    from .logs import Logs
    from .members import Wrapper

DEFAULT_LISTEN = "127.0.0.1:8080"
# Requests still open when serve is told to end get this long before they are cut.
SHUTDOWN_GRACE = 2.0


def serve(
    path: str | None,
    listen: str,
    *,
    duration: Duration,
    warn: Callable[[str], None],
    watch: bool = False,
    config_dir: str | None = None,
) -> int:
    """Run until SIGTERM, SIGINT or SIGHUP; 0 then. ConfigError (exit 2) for a bad file,
    UsageError for a bad ``listen``, AddressError when it cannot be listened on.
    ``watch``: the file is read again whenever it changes (``watch``); ``config_dir``:
    its files merged in (``config.merge``)."""
    from importlib.util import find_spec

    for module in ("aiohttp", "yaml"):
        if find_spec(module) is None:
            raise VramlockError(f"vramlock serve needs {module}: pip install 'vramlock[serve]'")
    from ..net import prebind
    from ..net.address import parse

    # llama-swap's :PORT: every interface (the port checked as any address's).
    every = listen.startswith(":")
    host, port = parse(f"0.0.0.0{listen}" if every else listen, "--listen")
    # Listening from the start (most often since before the command line was imported):
    # clients wait in the backlog while the configuration is read and aiohttp imported.
    socks = prebind.take(listen)
    if socks is None:
        try:
            socks = prebind.bind(None if every else host, port)
        except OSError as err:
            raise AddressError("--listen", listen, err.strerror or str(err)) from None
    try:
        where = Where(socks, None if every else host, port)
        return _logged(path, config_dir, where, duration, warn, watch)
    finally:
        for sock in socks:
            sock.close()


class Where(NamedTuple):
    """Where serve listens: its sockets, its host (None: every interface), its port."""

    socks: list[socket.socket]
    host: str | None
    port: int


def _logged(
    path: str | None,
    config_dir: str | None,
    where: Where,
    duration: Duration,
    warn: Callable[[str], None],
    watch: bool,
) -> int:
    from .config import load
    from .drain import Drain
    from .logs import Logs, Out

    config = load(path, duration, config_dir)
    drain = Drain()
    logs = Logs(config.log_to_stdout, config.log_time_format, warn, Out(1), Out(2), drain.hold)

    def reload(again: str) -> Config:
        return load(again, duration, config_dir)

    try:
        return _serve(config, where, logs, reload, watch)
    finally:
        logs.close()
        drain.close()


def _serve(
    config: Config, where: Where, logs: Logs, reload: Callable[[str], Config], watch: bool
) -> int:
    from .members import Wrapper

    warn = logs.say
    for message in config.warnings:
        warn(message)
    wrappers = {name: Wrapper(model, config, warn, logs) for name, model in config.models.items()}
    for w in wrappers.values():
        _check(config, w)
        logs.model(w.model.name)
    unhonoured = _together_without_budget(config, list(wrappers.values()))
    if unhonoured is not None:
        warn(unhonoured)
    return asyncio.run(_main(config, wrappers, where, logs, reload, watch))


def _check(config: Config, w: Wrapper) -> None:
    """What ``vramlock run`` would refuse, refused now, naming the model's line."""
    from ..arena.directory import parse_gpus
    from ..run.options import RunOptions
    from .config import ConfigError

    m = w.model
    opts = RunOptions(
        command=m.command,
        arena=m.arena,
        gpus=parse_gpus(m.gpu) if m.gpu is not None else (),
        name=m.name,
        release=m.release,
        preset=m.preset,
        demand="listen",
        listen=f"127.0.0.1:{w.port}",
        upstream=m.upstream,
        ready_url=w.ready_url,
        ready_within=config.health_timeout,
    )
    try:
        opts.check()
        w.arena().close()
    except VramlockError as err:
        raise ConfigError(config.path, m.line, f"model {m.name!r}: {err}") from None


def _together_without_budget(config: Config, wrappers: list[Wrapper]) -> str | None:
    """What to say when the routing rules let two models of an arena without a budget
    be resident together: its token lets one at a time (the rules' evictions are
    applied all the same)."""
    from contextlib import closing

    from ..arena.budget import read_budget

    rules = config.routing
    if rules.engine is None:
        return None
    arenas: dict[tuple[str | None, str | None], list[Wrapper]] = {}
    for w in wrappers:
        arenas.setdefault((w.model.arena, w.model.gpu), []).append(w)
    for members in arenas.values():
        names = [w.model.name for w in members]
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]
                 if rules.together(a, b)]  # fmt: skip
        if not pairs:
            continue
        with closing(members[0].arena()) as opened:
            if read_budget(opened) is not None:
                continue
        a, b = pairs[0]
        return (f"{config.path}:{rules.line}: routing lets {a} and {b} be resident together,"
                " but their arena has no budget (vramlock arena --budget): one model is"
                " resident there at a time")  # fmt: skip
    return None


class _OneLine(logging.Handler):
    """Each record as one line through ``warn``, its exception reduced to its words: a
    malformed request from any client must not put a traceback on serve's output."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.warn = warn

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        why = "" if exc is None else f": {type(exc).__name__}: {' '.join(str(exc).split())}"
        self.warn(f"{record.getMessage()}{why}")


def _one_line_logger(warn: Callable[[str], None]) -> logging.Logger:
    """aiohttp's server logger for serve's requests: one line each, nowhere else."""
    logger = logging.getLogger("vramlock.serve")
    logger.propagate = False
    logger.handlers[:] = [_OneLine(warn)]
    return logger


async def _main(
    config: Config,
    wrappers: dict[str, Wrapper],
    where: Where,
    logs: Logs,
    reload: Callable[[str], Config],
    watch: bool,
) -> int:
    """Serve until told to end; ``reload``: the loader of the file, for SIGHUP and
    ``watch`` (--watch-config)."""
    from aiohttp import web

    from .front import Front
    from .members import stop_all
    from .router import Router
    from .watch import Watcher, watching

    warn = logs.say
    router = Router(config, wrappers, logs)
    runner = web.AppRunner(
        router.app,
        access_log=None,
        logger=_one_line_logger(warn),
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_GRACE,
    )
    await runner.setup()
    handoff = runner.server
    assert handoff is not None
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda: Front(router, handoff), sock=sock)
               for sock in where.socks]  # fmt: skip
    stop = until_signalled()
    try:
        for name in config.preload:  # the others start on their first request
            wrappers[name].start()
        warn(f"serving {', '.join(wrappers)} {_at(where)}")
        watcher = Watcher(router, logs, reload, _check)
        loop.add_signal_handler(signal.SIGHUP, watcher.hangup)  # not an end: a reload
        async with watching(watcher if watch else None):
            await stop.wait()
    finally:
        logs.end_streams()
        for server in servers:
            server.close()
        await router.close_fronts(SHUTDOWN_GRACE)
        await runner.cleanup()
        stop_all(list(wrappers.values()))
        for w in wrappers.values():
            w.drain_output()
            w.close()
    return 0


def _at(where: Where) -> str:
    from ..net.address import show

    if where.host is None:
        return f"on port {where.port} of every interface"
    return f"at http://{show((where.host, where.port))}"
