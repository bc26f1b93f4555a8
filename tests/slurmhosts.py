"""A real Slurm cluster on the test hosts: slurmctld on the controller, one slurmd per host.

Debian's ``slurm-wlm`` (slurmctld, slurmd, the client commands) and ``munge``.
Built on a ``TestCluster``: each slurmd runs in its host's network namespace
with the host's name (a UTS namespace) and the cluster's /etc/hosts (a mount
namespace), as ``start_sshd`` does for sshd. slurmctld runs on this machine's
root namespace (the controller, where dzctl and sbatch run) and listens on the
bridge. One munged serves everyone: its socket is a path, which network
namespaces do not separate. Every path and port is the cluster's own, so
parallel test runs never share a daemon.

    with SlurmCluster(2, workdir=tmp_path) as slurm:
        slurm.env              # SLURM_CONF for sbatch/squeue/scancel run here
        slurm.hosts.hosts[0]   # the TestHost "node0"

No accounting database (slurmdbd needs MariaDB): ``sacct`` answers
"accounting storage is disabled" here, so ended jobs are kept in slurmctld's
memory for ``MinJobAge`` (long) and dzctl falls back to ``scontrol``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from testhosts import TestCluster, TestHostError

REQUIRED = ("slurmctld", "slurmd", "sbatch", "munged", "mungekey")


def missing_slurm() -> list[str]:
    return [f"{tool} (apt-get install slurm-wlm munge)" for tool in REQUIRED if shutil.which(tool) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SlurmCluster:
    __test__ = False

    def __init__(self, n: int = 2, *, docker: bool = False, workdir: Path, cpus: int | None = None) -> None:
        self.hosts = TestCluster(n, docker=docker, workdir=workdir)
        self.cpus = cpus or os.cpu_count() or 1
        self.name = f"dz{secrets.token_hex(3)}"
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []

    # -- paths -------------------------------------------------------------------------------
    @property
    def run(self) -> Path:
        return self.hosts.rundir / "slurm"  # short: munge's socket path must fit in 108 bytes

    @property
    def conf(self) -> Path:
        return self.hosts.workdir / "slurm" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands here (sbatch, squeue, dzctl launch --slurm)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def controller_name(self) -> str:
        return f"ctl-{self.hosts.cid}"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        missing = missing_slurm()
        if missing:
            raise TestHostError("cannot build Slurm test hosts, missing: " + ", ".join(missing))
        self.hosts.start()
        self.run.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run, 0o755)
        self.conf.parent.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        self._start_slurmctld()
        for host in self.hosts.hosts:
            self._start_slurmd(host)
        self.wait_idle()

    def close(self) -> None:
        for proc in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        for handle in self._logs:
            with contextlib.suppress(Exception):
                handle.close()
        self.hosts.close()  # kills whatever is left in the hosts' namespaces (job steps too)

    # -- daemons -----------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.run / log_name, "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self._procs.append(proc)
        return proc

    def _start_munge(self) -> None:
        key = self.run / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.munge_socket = self.run / "munge.sock"
        self._spawn(
            [
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={self.run / 'munged.pid'}", f"--seed-file={self.run / 'munged.seed'}",
                f"--log-file={self.run / 'munged.log'}",
            ],
            "munged.out",
        )  # fmt: skip
        self._wait(lambda: self.munge_socket.exists(), 10, "munged's socket")

    def _write_conf(self) -> None:
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        nodes = [h.name for h in self.hosts.hosts]
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={self.controller_name}({self.hosts.gateway})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"AuthInfo=socket={self.munge_socket}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={self.run / 'ctld-state'}",
            f"SlurmdSpoolDir={self.run}/%n-spool",
            f"SlurmctldPidFile={self.run / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.run}/%n-slurmd.pid",
            f"SlurmctldLogFile={self.run / 'slurmctld.log'}",
            f"SlurmdLogFile={self.run}/%n-slurmd.log",
            # No cgroups on these hosts: processes are tracked by parentage, tasks are not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            # Ended jobs stay known to scontrol for an hour (no accounting database here).
            "MinJobAge=3600",
            "KillWait=10",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            # Each node's address: slurmctld reaches the slurmds over the bridge.
            *(f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus} State=UNKNOWN" for h in self.hosts.hosts),
            f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        for host in self.hosts.hosts:
            (self.run / f"{host.name}-spool").mkdir(exist_ok=True)

    def _start_slurmctld(self) -> None:
        (self.run / "ctld-state").mkdir(exist_ok=True)
        # Its own hostname (a UTS namespace): slurmctld runs only where SlurmctldHost names the host.
        self._spawn(
            ["unshare", "--uts", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", self.controller_name,
             "slurmctld", "-D", "-i", "-f", str(self.conf)],
            "slurmctld.out",
        )  # fmt: skip
        self._wait(lambda: self._answers(["scontrol", "ping"], "UP"), 30, "slurmctld")

    def _start_slurmd(self, host) -> None:
        # With docker hosts, the node's own dockerd is its /run/docker.sock in slurmd's mount namespace
        # (and so in its job steps'), as on a real node: jobs get the submitter's environment, not the node's.
        script = (
            'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind /dev/null /etc/resolv.conf'
            ' && { [ -z "$3" ] || mount --bind "$3" /run/docker.sock; } && shift 3 && exec "$@"'
        )
        socket_path = str(host.docker_socket) if host.docker_socket else ""
        self._spawn(
            ["nsenter", f"--net={host.netns_path}", "unshare", "--uts", "--mount", "--propagation", "slave",
             "sh", "-c", script, "sh", host.name, str(self.hosts.hosts_file), socket_path,
             "slurmd", "-D", "-N", host.name, "-f", str(self.conf)],
            f"{host.name}-slurmd.out",
        )  # fmt: skip

    def wait_idle(self, timeout: float = 60) -> None:
        self._wait(lambda: self.node_states() == {"idle"}, timeout, "every node idle")

    def node_states(self) -> set[str]:
        out = self.client(["sinfo", "--noheader", "--Node", "--format", "%T"], check=False).stdout
        return {line.strip().rstrip("*~#") for line in out.splitlines() if line.strip()}

    # -- helpers -----------------------------------------------------------------------------
    def client(self, argv: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, check=check, timeout=timeout)

    def _answers(self, argv: list[str], word: str) -> bool:
        try:
            return word in self.client(argv, check=False, timeout=5).stdout
        except subprocess.TimeoutExpired:
            return False

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise TestHostError(f"{proc.args[:3]} exited ({proc.returncode}) while waiting for {what}: "
                                        + self.daemon_logs()[-3000:])  # fmt: skip
            if predicate():
                return
            time.sleep(0.2)
        raise TestHostError(f"timed out after {timeout:g} s waiting for {what}: " + self.daemon_logs()[-3000:])

    def daemon_logs(self) -> str:
        parts = []
        for path in sorted(self.run.glob("*.log")) + sorted(self.run.glob("*.out")):
            with contextlib.suppress(OSError):
                parts.append(f"== {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)
