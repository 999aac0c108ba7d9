"""A real Slurm cluster on one machine: Debian's ``slurm-wlm`` (slurmctld + one slurmd per
node) with its own munged, on the network namespaces of ``netns_cluster.Cluster``.

- The controller namespace (the cluster's launcher namespace) is the login node ``ctl``:
  slurmctld runs there, and so do the clients (``salloc``, ``sbatch``, ``srun``,
  ``sinfo``), each with hostname ``ctl`` (``unshare --uts``).
- Every node (``node1``, ``node2``, ...) is a namespace with its own address and hostname;
  its slurmd finds its ``NodeName`` from that hostname (no ``-N``, which needs a
  multiple-slurmd build).
- Names resolve through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts
  over ``/etc/hosts`` for everything started in that namespace (slurmd, its job steps, the
  ranks), so ``MASTER_ADDR=node1`` works on every node.
- One munged in the root namespace, with its own key and socket in the temp dir
  (``AuthInfo=socket=...``): unix sockets on a path are reached from every namespace.
- No cgroups or systemd (a container): ``proctrack/linuxproc``, ``task/none``; all state,
  spool, pid and log files in the temp dir. Jobs run as root (``SlurmUser=root``).

``close()`` stops the daemons by PID, kills whatever is still inside the namespaces
(``Cluster.close``), removes the namespaces and their ``/etc/netns`` entries and stops
munged: nothing is left running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from netns_cluster import Cluster
from netns_cluster import unavailable as netns_unavailable

BINARIES = ("munged", "munge", "slurmctld", "slurmd", "slurmstepd", "salloc", "sbatch", "srun",
            "sinfo", "scontrol", "squeue", "sacct")
CONTROLLER = "ctl"
CPUS = 2  # per node, as configured (SlurmdParameters=config_overrides: not the real count)


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None)


def unavailable() -> str | None:
    """Why a Slurm cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd, munged and network namespaces)"
    missing = [b for b in BINARIES if b != "sacct" and not _which(b)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    return netns_unavailable()


def in_uts(hostname: str, argv: list[str]) -> list[str]:
    """``argv`` in a new UTS namespace whose hostname is ``hostname``."""
    return ["unshare", "--uts", "--", "/bin/sh", "-c", 'hostname "$0" && exec "$@"', hostname,
            *argv]


class SlurmCluster(Cluster):
    def __init__(self, tmp: Path, nnodes: int = 2) -> None:
        super().__init__(tmp, nnodes)
        # Cluster's names, with a prefix of our own (never the same namespaces as a
        # netns_cluster.Cluster of the same process)
        self.prefix = f"ddls{os.getpid() % 100000}"
        self.switch = f"{self.prefix}sw"
        self.launcher_ns = f"{self.prefix}L"
        self.host_ns = [f"{self.prefix}h{i}" for i in range(nnodes)]
        self.hostnames = [f"node{i + 1}" for i in range(nnodes)]
        self.ctl_addr = f"10.213.{self.subnet_octet}.1"  # Cluster's launcher address
        self.conf = tmp / "slurm.conf"
        self.munge_socket = tmp / "munge" / "munge.socket"
        self.munged: subprocess.Popen | None = None
        self.daemons: dict[str, subprocess.Popen] = {}  # "slurmctld", "slurmd-node1", ...
        self.netns_etc: list[Path] = []

    # ------------------------------------------------------------------ setup
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        try:
            self._network()
            self._hosts_files()
            self._munge()
            self._config()
            self._daemon("slurmctld", self.launcher_ns, CONTROLLER,
                         ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._wait_for(self._controller_up, timeout, "slurmctld does not answer")
            for ns, name in zip(self.host_ns, self.hostnames, strict=True):
                self._daemon(f"slurmd-{name}", ns, name, ["slurmd", "-D", "-f", str(self.conf)])
            self._wait_for(self._nodes_idle, timeout, "the nodes did not become idle")
        except BaseException:
            self.close()
            raise
        return self

    def _hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost", f"{self.ctl_addr} {CONTROLLER}"]
        lines += [f"{a} {n}" for a, n in zip(self.addrs, self.hostnames, strict=True)]
        for ns in [self.launcher_ns, *self.host_ns]:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=False)
            self.netns_etc.append(d)
            (d / "hosts").write_text("\n".join(lines) + "\n")

    def _munge(self) -> None:
        d = self.munge_socket.parent
        d.mkdir(mode=0o700)
        key = d / "munge.key"
        with open(key, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(os.urandom(1024))
        log = open(self.tmp / "munged.log", "w")  # noqa: SIM115
        self.munged = subprocess.Popen(
            [_which("munged"), "--foreground", "--force", f"--key-file={key}",
             f"--socket={self.munge_socket}", f"--pid-file={d}/munged.pid",
             f"--seed-file={d}/munged.seed", f"--log-file={self.tmp}/munged.file.log"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait_for(lambda: subprocess.run(
            ["munge", "-S", str(self.munge_socket), "-n"], capture_output=True).returncode == 0,
            10, "munged does not answer")

    def _config(self) -> None:
        t = self.tmp
        nodes_dirs = [f"{d}/{n}" for d in ("spool", "tmp") for n in self.hostnames]
        for sub in ("state", "spool", "tmp", "log", *nodes_dirs):
            (t / sub).mkdir()
        # slurmd 22.05 always loads a cgroup plugin (no "disabled" before 23.02); v1 loads
        # without a cgroup mount, and nothing uses it with proctrack/linuxproc + task/none
        (t / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={CPUS} RealMemory=1000 "
            "State=UNKNOWN" for n, a in zip(self.hostnames, self.addrs, strict=True))
        self.conf.write_text(f"""\
# written by tests/launcher/slurm_cluster.py
ClusterName=ddltest
SlurmctldHost={CONTROLLER}({self.ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool/%n
TmpFS={t}/tmp/%n
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd-%n.pid
SlurmctldLogFile={t}/log/slurmctld.log
SlurmdLogFile={t}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=3
MinJobAge=300
MessageTimeout=20
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, key: str, ns: str, hostname: str, argv: list[str]) -> None:
        log = open(self.tmp / "log" / f"{key}.out", "w")  # noqa: SIM115
        self.daemons[key] = subprocess.Popen(
            ["ip", "netns", "exec", ns, *in_uts(hostname, argv)], stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, env=self.env())
        log.close()

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [k for k, p in self.daemons.items() if p.poll() is not None]
            if self.munged is not None and self.munged.poll() is not None:
                dead.append("munged")
            if dead or time.monotonic() > deadline:
                why = f"exited: {', '.join(dead)}" if dead else f"after {timeout:g}s"
                raise RuntimeError(f"Slurm test cluster: {what} ({why})\n{self.logs()}")
            time.sleep(0.25)

    def _controller_up(self) -> bool:
        return self.client(["scontrol", "ping"], timeout=15).returncode == 0

    def node_states(self) -> dict[str, str]:
        res = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15)
        states = {}
        for line in res.stdout.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def _nodes_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n) == "idle" for n in self.hostnames)

    # ------------------------------------------------------------------ use
    def env(self, **extra: str) -> dict[str, str]:
        """The environment of Slurm's daemons and clients: ours, minus any Slurm job we may
        run inside, plus SLURM_CONF."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SALLOC_",
                                                                         "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def client_argv(self, argv: list[str]) -> list[str]:
        """``argv`` on the login node (the controller's namespace, hostname ``ctl``)."""
        return ["ip", "netns", "exec", self.launcher_ns, *in_uts(CONTROLLER, argv)]

    def client(self, argv: list[str], timeout: float = 120, env: dict | None = None,
               **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.client_argv(argv), capture_output=True, text=True,
                              timeout=timeout, env=env or self.env(), **kw)

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon's log, for failure messages."""
        out = []
        files = sorted((self.tmp / "log").glob("*")) if (self.tmp / "log").exists() else []
        files += [self.tmp / "munged.log", self.tmp / "munged.file.log"]
        for path in files:
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        for p in self.daemons.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.daemons.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        super().close()  # kills what is left in the namespaces (steps, ranks), removes them
        for d in self.netns_etc:
            shutil.rmtree(d, ignore_errors=True)
        self.netns_etc.clear()
        if self.munged is not None and self.munged.poll() is None:
            self.munged.send_signal(signal.SIGTERM)
            try:
                self.munged.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.munged.kill()
                self.munged.wait()
