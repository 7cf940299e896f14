"""``vramlock serve --watch-config``: the configuration read again when its file changes.

The file is looked at every ``POLL`` seconds (its modification time, size and inode:
the standard library has no inotify). A model whose command, proxy, checkEndpoint, env
and vramlock keys read the same as before keeps its wrapper, still running, still
resident (its other keys, aliases, ttl, filters and the like, take effect at once); a
model whose command or wrapper changed is ended and comes back under its new entry (on
its next request, or at once if preloaded); a removed one is ended, a new one added.
A file that no longer loads changes nothing: the error is logged and the configuration
in use stays. The file is read off the event loop (and only a regular file of bounded
size is read at all: ``config.reader``), so that serve answers all along.
SIGHUP reads the file again at once, with or without ``--watch-config``, as llama-swap
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from ..errors import VramlockError
from .passing import briefly
from .selectors import Resolver

if TYPE_CHECKING:
    from .config import Config, Model
    from .logs import Logs
    from .members import Wrapper
    from .router import Router

POLL = 0.5


def _seen(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


# What a model's wrapper is started with: a change to any of them restarts the model;
# the others (aliases, ttl, filters, ...) are the router's, taken at once.
_PROCESS = ("command", "upstream", "prefix", "check_endpoint", "env", "release", "preset",
            "run_options", "arena", "gpu")  # fmt: skip


def _same(a: Model, b: Model) -> bool:
    """Do two entries run the same wrapper and command?"""
    return all(getattr(a, f) == getattr(b, f) for f in _PROCESS)


class Watcher:
    """Reloads ``router``'s configuration from its file when the file changes."""

    def __init__(
        self,
        router: Router,
        logs: Logs,
        load: Callable[[str], Config],
        check: Callable[[Config, Wrapper], None],
    ) -> None:
        self.router, self.logs, self.load, self.check = router, logs, load, check
        self.path = router.config.path
        self._last = _seen(self.path)
        self._one = asyncio.Lock()  # one reload at a time
        self._hangups: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await asyncio.sleep(POLL)
            now = _seen(self.path)
            if now is None or now == self._last:
                continue
            self._last = now
            await self.reload()

    async def reload(self) -> None:
        """Read the file (off the event loop) and serve what it says; a file that does
        not load is said, and changes nothing."""
        async with self._one:
            try:
                new = await briefly(lambda: self.load(self.path))
                await self.apply(new)
            except VramlockError as err:
                self.logs.say(f"{err}; the configuration in use is kept")

    def hangup(self) -> None:
        """SIGHUP: reload now, as llama-swap does (serve goes on)."""
        self.logs.say(f"{self.path}: SIGHUP: reading it again")
        task = asyncio.ensure_future(self.reload())
        self._hangups.add(task)
        task.add_done_callback(self._hangups.discard)

    async def apply(self, new: Config) -> None:
        """Serve ``new``: keep the wrappers of unchanged models, replace the others."""
        from .members import Wrapper, stop_all

        old, wrappers = self.router.config, self.router.wrappers
        kept = {
            name: w for name, w in wrappers.items()
            if name in new.models and _same(w.model, new.models[name])
            and new.health_timeout == old.health_timeout
        }  # fmt: skip
        fresh = {n: Wrapper(m, new, self.logs.say, self.logs) for n, m in new.models.items()
                 if n not in kept}  # fmt: skip
        try:
            for w in fresh.values():
                self.check(new, w)
        except VramlockError:
            for w in fresh.values():
                w.close()
            raise
        for message in new.warnings:
            self.logs.say(message)
        if new.api_keys != old.api_keys:
            self.logs.say(f"{new.path}: apiKeys changed: they take effect when serve restarts")
        gone = [w for name, w in wrappers.items() if name not in kept]
        for w in gone:
            w.disarm_ttl()
        await briefly(lambda: stop_all(gone))
        for w in gone:
            w.drain_output()
            w.close()
            pool = self.router.pools.pop(w.model.name, None)
            if pool is not None:
                pool.close()
        for name, w in kept.items():
            w.renew(new, new.models[name])
        wrappers.clear()
        wrappers.update({name: kept.get(name) or fresh[name] for name in new.models})
        self.router.config = new
        self.router.resolver = Resolver(new, self.router.resolver.state)  # no profile active
        await self.router.observe(new)
        self.logs.configure(new.log_to_stdout, new.log_time_format)
        for name in fresh:
            self.logs.model(name)
            if name in new.preload:
                fresh[name].start()
        changed = ", ".join(fresh) or "none"
        self.logs.say(f"{new.path}: reloaded; models started afresh: {changed}")


@contextlib.asynccontextmanager
async def watching(watcher: Watcher | None) -> AsyncIterator[None]:
    """Run ``watcher`` (if any) for as long as the block runs."""
    task = None if watcher is None else asyncio.ensure_future(watcher.run())
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
