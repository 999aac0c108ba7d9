"""A simulated cluster on one machine: network namespaces on a private bridge, each "host"
with its own hostname (``unshare --uts``) and its own sshd on port 2222. The launcher runs
inside its own namespace on the same bridge; nothing is reachable from the root namespace.

Everything is torn down by PID and by namespace name in ``close()``, which tests call from
a finalizer, so a failing test leaves no namespaces or daemons behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PORT = 2222
IFACE = "ddl0"


def unavailable() -> str | None:
    """Why multi-host tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} not installed (apt-get install iproute2 util-linux openssh-client)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not installed (apt-get install openssh-server)"
    probe = f"ddlprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create network namespaces: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Cluster:
    def __init__(self, tmp: Path, nhosts: int, fake_version_host: int | None = None) -> None:
        self.tmp = tmp
        tag = f"{os.getpid() % 100000}"
        self.prefix = f"ddlt{tag}"
        self.subnet_octet = 20 + os.getpid() % 200
        self.switch = f"{self.prefix}sw"
        self.launcher_ns = f"{self.prefix}L"
        self.host_ns = [f"{self.prefix}h{i}" for i in range(nhosts)]
        self.addrs = [f"10.213.{self.subnet_octet}.{10 + i}" for i in range(nhosts)]
        self.hostnames = [f"ddlh{i}" for i in range(nhosts)]
        self.namespaces: list[str] = []
        self.sshd: list[subprocess.Popen] = []
        self.fake_version_host = fake_version_host
        self.key = str(tmp / "id")
        self.config = str(tmp / "ssh_config")

    def addr_unused(self) -> str:
        return f"10.213.{self.subnet_octet}.99"

    # ------------------------------------------------------------------ setup
    def start(self) -> Cluster:
        try:
            self._keys()
            self._network()
            for i in range(len(self.host_ns)):
                self._sshd(i)
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _keys(self) -> None:
        for name in ("id", "hostkey"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            str(self.tmp / name)], check=True)
        shutil.copy(self.tmp / "id.pub", self.tmp / "authorized_keys")
        Path(self.config).write_text(
            "Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            f"  LogLevel ERROR\n  IdentityFile {self.key}\n  User root\n"
        )
        fake = self.tmp / "fake" / "powerddl-9.9.9.dist-info"
        fake.mkdir(parents=True)
        (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: powerddl\nVersion: 9.9.9\n")
        os.makedirs("/run/sshd", exist_ok=True)

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _network(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        members = [(self.launcher_ns, f"10.213.{self.subnet_octet}.1")]
        members += list(zip(self.host_ns, self.addrs, strict=True))
        for i, (ns, addr) in enumerate(members):
            self._add_ns(ns)
            _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name",
                IFACE, "netns", ns)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")

    def _sshd(self, i: int) -> None:
        argv = ["ip", "netns", "exec", self.host_ns[i], "unshare", "--uts", "--",
                "/bin/sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[i],
                SSHD, "-D", "-e", "-f", "/dev/null", "-p", str(PORT),
                "-h", str(self.tmp / "hostkey"),
                "-o", f"ListenAddress={self.addrs[i]}",
                "-o", f"PidFile={self.tmp}/sshd{i}.pid",
                "-o", f"AuthorizedKeysFile={self.tmp}/authorized_keys",
                "-o", "StrictModes=no", "-o", "UsePAM=no",
                "-o", "PermitRootLogin=prohibit-password",
                "-o", "PasswordAuthentication=no", "-o", "KbdInteractiveAuthentication=no"]
        if i == self.fake_version_host:
            argv += ["-o", f"SetEnv=PYTHONPATH={self.tmp / 'fake'}"]
        log = open(self.tmp / f"sshd{i}.log", "w")  # noqa: SIM115
        self.sshd.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        log.close()

    def _wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        for i, addr in enumerate(self.addrs):
            while True:
                res = subprocess.run(self.in_launcher(self.ssh(addr, "hostname")),
                                     capture_output=True, text=True, timeout=15)
                if res.returncode == 0 and res.stdout.strip() == self.hostnames[i]:
                    break
                if self.sshd[i].poll() is not None or time.monotonic() > deadline:
                    log = (self.tmp / f"sshd{i}.log").read_text()
                    raise RuntimeError(f"sshd on {addr} not ready: {res.stderr} {log}")
                time.sleep(0.2)

    # ------------------------------------------------------------------ use
    def ssh(self, addr: str, *cmd: str) -> list[str]:
        return ["ssh", "-F", self.config, "-p", str(PORT), "-o", "BatchMode=yes", addr, *cmd]

    def in_launcher(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.launcher_ns, *argv]

    def ddlrun_opts(self) -> list[str]:
        return ["--ssh-config", self.config, "--ssh-port", str(PORT),
                "--network-interface", IFACE]

    def hosts(self, n: int, slots: int = 2) -> str:
        return ",".join(f"{a}:{slots}" for a in self.addrs[:n])

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        for p in self.sshd:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.sshd:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # Anything still inside our namespaces was started by these tests: kill by PID.
        for ns in self.namespaces:
            res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in res.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
