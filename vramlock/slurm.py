"""A Slurm node's side of its GPUs' arenas, run as root by the scripts in contrib/slurm/:
``python -m vramlock.slurm epilog JOB UID ARENAS`` after a job, however it ended, and
``python -m vramlock.slurm metrics ARENAS FILE`` for node_exporter's textfile collector.

The arenas are ``ARENAS/gpu<N>``, N Slurm's index of the GPU on the node; a job's members
are named ``job<ID>.<step>`` (contrib/slurm/slurm-task), which is how a member and a
journal line are tied to a job.
"""

from __future__ import annotations

import os
import pwd
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

from . import procfs
from .arena import journal, records
from .arena.directory import MEMBERS, Arena
from .errors import ArenaError
from .observe.prometheus import Family, text
from .observe.stats import compute

_ARENA = re.compile(r"gpu(\d+)")
_MEMBER = re.compile(r"job(\d+)\.")
_USAGE = "usage: python -m vramlock.slurm epilog JOB UID ARENAS | metrics ARENAS FILE"


def _ancestors() -> set[int]:
    """This process and those above it (the Epilog has the job's id in its environment)."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        pid = procfs.ppid(pid) or 0
    return found


def job_processes(job: str, uid: int) -> list[int]:
    """The processes of Slurm job ``job`` of user ``uid`` (the job's id in their
    environment), those that left the job's process tree included; not the Epilog."""
    mine = _ancestors()
    return [p for p in procfs.all_pids()
            if p not in mine and procfs.uid(p) == uid
            and procfs.environ(p).get("SLURM_JOB_ID") == job]  # fmt: skip


def end_job(job: str, uid: int, within: float = 10.0) -> list[int]:
    """SIGKILL every process of ``job`` until none is left (their locks die with them);
    what is still there after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = job_processes(job, uid)
        if not left or time.monotonic() >= deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # a zombie's environment reads empty: it is gone as far as locks go


def arenas(root: str) -> Iterator[tuple[int, Arena]]:
    """Each ``gpu<N>`` arena under ``root``, opened: (N, arena)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        found = _ARENA.fullmatch(name)
        if found is None:
            continue
        try:
            arena = Arena.open(os.path.join(root, name))
        except ArenaError:
            continue
        try:
            yield int(found.group(1)), arena
        finally:
            arena.close()


def sweep(arena: Arena) -> None:
    """Remove the records of members that are gone (a member killed had no time to)."""
    fd = os.open(MEMBERS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=arena.dirfd)
    try:
        records.sweep(fd)
    finally:
        os.close(fd)


def epilog(job: str, uid: int, root: str) -> int:
    """End what is left of ``job`` (of user ``uid``) and sweep the arenas: 0, or 1 (said)
    where a process of it outlived SIGKILL."""
    left = end_job(job, uid)
    for _, arena in arenas(root):
        try:
            sweep(arena)
        except OSError:
            pass  # no members/ directory: no records to sweep
    if left:
        print(f"vramlock: job {job}: processes {left} outlived SIGKILL", file=sys.stderr)
        return 1
    return 0


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _uuids() -> dict[int, str]:
    from .arena.roster import gpu_view  # NVML, where there is one

    view = gpu_view(None)
    return {g.index: g.uuid for g in view.gpus} if view is not None else {}


def job_families(root: str) -> list[Family]:
    """Per job and GPU: the seconds it held the GPU, the seconds it waited and its waits
    (from each arena's journal), labelled gpu, uuid, job and user."""
    uuids = _uuids()
    held: dict[tuple[str, ...], float] = {}
    waited: dict[tuple[str, ...], float] = {}
    waits: dict[tuple[str, ...], int] = {}
    for gpu, arena in arenas(root):
        for m in compute(journal.read(arena)).members:
            found = _MEMBER.match(m.name)
            if found is None or not m.trusted:
                continue
            key = (str(gpu), uuids.get(gpu, ""), found.group(1), _user(m.uid))
            held[key] = held.get(key, 0.0) + m.resident
            waited[key] = waited.get(key, 0.0) + sum(m.waits)
            waits[key] = waits.get(key, 0) + len(m.waits)
    names = ("gpu", "uuid", "job", "user")

    def samples(name: str, values: dict[tuple[str, ...], float] | dict[tuple[str, ...], int]
                ) -> list[tuple[str, list[tuple[str, str]], float]]:  # fmt: skip
        return [(name, list(zip(names, k, strict=True)), v) for k, v in sorted(values.items())]

    return [
        Family("vramlock_job_resident_seconds_total", "counter",
               "Seconds the Slurm job's members held the GPU.",
               samples("vramlock_job_resident_seconds_total", held)),
        Family("vramlock_job_wait_seconds_total", "counter",
               "Seconds the Slurm job's members waited for the GPU (waits that ended).",
               samples("vramlock_job_wait_seconds_total", waited)),
        Family("vramlock_job_waits_total", "counter",
               "Waits for the GPU of the Slurm job's members that ended.",
               samples("vramlock_job_waits_total", waits)),
    ]  # fmt: skip


def write_metrics(root: str, path: str) -> None:
    """The jobs' metrics into ``path``, replaced at once (node_exporter never reads half)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".vramlock-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text(job_families(root)))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: Sequence[str]) -> int:
    if len(argv) == 4 and argv[0] == "epilog" and argv[2].isdigit():
        return epilog(argv[1], int(argv[2]), argv[3])
    if len(argv) == 3 and argv[0] == "metrics":
        try:
            write_metrics(argv[1], argv[2])
        except OSError as err:
            print(f"vramlock: {argv[2]}: {err.strerror}", file=sys.stderr)
            return 1
        return 0
    print(_USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
