"""A real single-node Slurm for the tests: munged, slurmctld and slurmd started without
systemd, configured in a temporary directory for one fake GPU (a device node the test
makes) split into shards, with contrib/slurm's plugin, Prolog and Epilog installed."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import portalocker
import pytest

from helpers import ROOT
from helpers.net import free_ports
from helpers.processes import wait_until

CONTRIB = ROOT / "contrib" / "slurm"
NVML = ROOT / "tests" / "fake_nvml"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def missing() -> str | None:
    """Why Slurm cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (it starts slurmd and makes users)"
    for tool in (*DAEMONS, "useradd", "setpriv", "runuser", "cc"):
        if shutil.which(tool) is None:
            return f"no {tool} (Debian: apt-get install slurm-wlm munge libslurm-dev)"
    if not Path("/usr/include/slurm/spank.h").exists():
        return "no slurm/spank.h (Debian: apt-get install libslurm-dev)"
    return None


SLURM_CONF = """\
ClusterName=vramlock
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort={ctld}
SlurmdPort={slurmd}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu,shard
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=2
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=60
PlugStackConfig={d}/plugstack.conf
Prolog={d}/prolog
Epilog={d}/epilog
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=500 \
Gres=gpu:1,shard:3 State=UNKNOWN
PartitionName=main Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

GRES_CONF = """\
AutoDetect=off
NodeName=localhost Name=gpu File={d}/nvidia0
NodeName=localhost Name=shard Count=3 File={d}/nvidia0
"""


@dataclass
class Cluster:
    """The running Slurm, its directory (readable by everyone) and its users."""

    top: Path
    env: dict[str, str]  # SLURM_CONF, and vramlock's tree on PYTHONPATH
    arenas: Path
    textfiles: Path
    group: str
    users: list[str] = field(default_factory=list)
    daemons: list[subprocess.Popen[str]] = field(default_factory=list)

    def cmd(self, *args: str, user: str | None = None, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """A Slurm command, as ``user`` (with its groups) where given."""
        pre: list[str] = []
        if user is not None:
            pw = pwd.getpwnam(user)
            pre = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups",
                   "--"]  # fmt: skip
        return subprocess.run([*pre, *args], capture_output=True, text=True, timeout=60,
                              env=env or self.env, cwd="/")  # fmt: skip

    def sbatch(self, user: str, script: str, *options: str, env: dict[str, str]) -> str:
        """Submit ``script`` as ``user``: the job id."""
        path = self.top / f"job-{os.urandom(4).hex()}.sh"
        path.write_text(script)
        path.chmod(0o755)
        done = self.cmd("sbatch", "--parsable", *options, str(path), user=user,
                        env={**self.env, **env})  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The job's state (RUNNING, COMPLETED, CANCELLED, TIMEOUT...)."""
        done = self.cmd("scontrol", "show", "job", job, "-o")
        for word in done.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return ""

    def wait_state(self, job: str, *states: str, timeout: float = 60.0) -> str:
        wait_until(lambda: self.state(job) in states, timeout=timeout, step=0.1)
        return self.state(job)

    def node(self) -> str:
        """The node's state (IDLE, MIXED, DRAIN...), with its reason."""
        done = self.cmd("scontrol", "show", "node", "localhost", "-o")
        words = dict(w.split("=", 1) for w in done.stdout.split() if "=" in w)
        return f"{words.get('State', '')} {words.get('Reason', '')}".strip()

    def epilog_done(self, job: str) -> bool:
        """The node ran the job's Epilog (our wrapper notes each one it ran)."""
        log = self.top / "epilogs"
        return log.exists() and job in log.read_text().split()


def _wrapper(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)


def _python() -> tuple[str, str] | None:
    """An interpreter that any user may run (a tree under /root is not), and the path
    that gives it vramlock and its dependencies; None when there is none."""
    site = str(Path(portalocker.__file__).resolve().parent.parent)
    path = f"{ROOT}{os.pathsep}{site}"
    for exe in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3"):
        # runuser, not setpriv: a process setpriv made may still reach root's files here.
        runuser = shutil.which("runuser") or "runuser"
        done = subprocess.run([runuser, "-u", "nobody", "--", exe, "-c",
                               "import vramlock, portalocker"], cwd="/", capture_output=True,
                              env={"PYTHONPATH": path, "PATH": os.defpath})  # fmt: skip
        if exe and done.returncode == 0:
            return exe, path
    return None


def _install(top: Path, group: str) -> dict[str, str]:
    """Build the plugin, write the wrappers and the configuration files into ``top``."""
    found = _python()
    if found is None:
        pytest.skip("no Python interpreter that another user may run")
    exe, path = found
    py = top / "python"
    _wrapper(py, f'PYTHONPATH=${{PYTHONPATH:+$PYTHONPATH:}}{path} exec {exe} "$@"\n')
    _wrapper(top / "vramlock", f'exec {py} -m vramlock "$@"\n')
    shutil.copy(CONTRIB / "slurm-task", top / "slurm-task")
    subprocess.run(["cc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                    "-o", str(top / "vramlock_spank.so"), str(CONTRIB / "vramlock_spank.c")],
                   check=True, timeout=120)  # fmt: skip
    conf = top / "vramlock.conf"
    conf.write_text(f"PYTHON={py}\nARENAS={top}/run/vramlock\nGROUP={group}\n"
                    f"TEXTFILES={top}/textfiles\n")  # fmt: skip
    for script in ("prolog", "epilog"):
        note = f'echo "$SLURM_JOB_ID" >> {top}/epilogs\n' if script == "epilog" else ""
        # The metrics see the fake NVML's GPU (its UUID), the jobs none.
        _wrapper(top / script, f"""\
            PYTHONPATH={NVML} VRAMLOCK_SLURM_CONF={conf} {CONTRIB / script}
            status=$?
            {note}exit $status
            """)  # fmt: skip
    (top / "plugstack.conf").write_text(
        f"required {top}/vramlock_spank.so launcher={top}/slurm-task arenas={top}/run/vramlock"
        f" vramlock={top}/vramlock\n"
    )
    os.mknod(top / "nvidia0", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a GPU's stand-in
    ctld, slurmd = free_ports(2)
    # Eight CPUs whatever the machine has (config_overrides): a job takes one, and the
    # tests run up to four at once.
    values = {"d": top, "ctld": ctld, "slurmd": slurmd, "host": socket.gethostname(),
              "cpus": 8}  # fmt: skip
    (top / "slurm.conf").write_text(SLURM_CONF.format(**values))
    (top / "gres.conf").write_text(GRES_CONF.format(**values))
    for sub in ("state", "spool", "textfiles"):
        (top / sub).mkdir()
    key = top / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return {**os.environ, "SLURM_CONF": str(top / "slurm.conf"), "PYTHONPATH": str(ROOT)}


def _start(cluster: Cluster) -> None:
    d = cluster.top
    munged = ["munged", "-F", "-f", f"--socket={d}/munge.sock", f"--key-file={d}/munge.key",
              f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid",
              f"--seed-file={d}/munged.seed"]  # fmt: skip
    daemons = [munged, ["slurmctld", "-D", "-i", "-f", f"{d}/slurm.conf"],
               ["slurmd", "-D", "-N", "localhost", "-f", f"{d}/slurm.conf"]]  # fmt: skip
    for args in daemons:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, env=cluster.env, cwd="/",
                                start_new_session=True, text=True)  # fmt: skip
        cluster.daemons.append(proc)
        if args[0] == "munged":
            wait_until(lambda: (d / "munge.sock").exists(), timeout=20)

    def idle() -> bool:
        assert all(p.poll() is None for p in cluster.daemons), _logs(d)
        return cluster.node().startswith("IDLE")

    wait_until(idle, timeout=60, step=0.2)


def _logs(d: Path) -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log", "munged.log"):
        with contextlib.suppress(OSError):
            out.append(f"--- {name}\n" + "\n".join((d / name).read_text().splitlines()[-20:]))
    return "\n".join(out)


def _stop(cluster: Cluster) -> None:
    for proc in reversed(cluster.daemons):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _add_user(name: str, group: str | None) -> None:
    extra = ["-G", group] if group else []
    subprocess.run(["useradd", "-M", "-N", "-s", "/bin/sh", *extra, name], check=True)


@contextlib.contextmanager
def running() -> Iterator[Cluster]:
    """A Slurm of one node with users ``users[0]`` and ``users[1]`` of the GPUs' group and
    ``users[2]`` outside it, in a directory of /tmp that they may enter."""
    tag = os.urandom(3).hex()
    group = f"vlgpu{tag}"
    top = Path(tempfile.mkdtemp(prefix="vramlock-slurm-", dir="/tmp"))
    top.chmod(0o755)
    # The arenas' directory ends in /vramlock: a job of several GPUs finds them as the
    # default arenas of their parent (contrib/slurm/slurm-task).
    cluster = Cluster(top, {}, top / "run" / "vramlock", top / "textfiles", group)
    subprocess.run(["groupadd", group], check=True)
    try:
        cluster.env = _install(top, group)  # may skip: the group goes all the same
        for who, member in (("a", True), ("b", True), ("m", False)):
            cluster.users.append(f"vls{who}{tag}")
            _add_user(cluster.users[-1], group if member else None)
        _start(cluster)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            queue = cluster.cmd("squeue", "-h", "-o", "%i") if cluster.daemons else None
            for job in queue.stdout.split() if queue else []:
                cluster.cmd("scancel", job)
        _stop(cluster)
        for user in cluster.users:
            subprocess.run(["userdel", user], check=False)
        subprocess.run(["groupdel", group], check=False)
        shutil.rmtree(top, ignore_errors=True)
