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

With ``accounting=True`` (the default) a MariaDB server (its own data dir, a
random port on 127.0.0.1, no grant tables: a test database) and a slurmdbd keep
the job accounting ``sacct`` reads, as on a production cluster (dzctl asks sacct
about a job squeue no longer shows).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from testhosts import RUN_ROOT, TestCluster, TestHostError, _start_time

DAEMONS = RUN_ROOT / "slurm-daemons.jsonl"  # every Slurm test daemon started here, with its owner


def sweep_stale_daemons() -> None:
    """Kill the Slurm test daemons (process groups) of test processes that died without their finalizers."""
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    with open(RUN_ROOT / "slurm-daemons.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = [json.loads(line) for line in DAEMONS.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            entries = []
        kept = []
        for entry in entries:
            alive = _start_time(entry["pid"]) == entry["start"]
            owner_alive = _start_time(entry["owner"]["pid"]) == entry["owner"]["start"]
            if alive and not owner_alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(entry["pid"], signal.SIGKILL)
            elif alive:
                kept.append(entry)
        DAEMONS.write_text("".join(json.dumps(e) + "\n" for e in kept))


REQUIRED = ("slurmctld", "slurmd", "sbatch", "munged", "mungekey", "slurmdbd", "mariadbd", "mariadb-install-db")


def missing_slurm() -> list[str]:
    found = {tool: shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/bin") for tool in REQUIRED}
    return [f"{tool} (apt-get install slurm-wlm slurmdbd munge mariadb-server)" for tool, at in found.items() if not at]


def _port_open(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are picked. One at a time, a port
    closed before the next bind can come back: a CI run had slurmdbd on slurmctld's port ("Address already
    in use", and slurmdbd failing to unpack scontrol's ping)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


class SlurmCluster:
    __test__ = False

    def __init__(
        self,
        n: int = 2,
        *,
        docker: bool = False,
        workdir: Path | None = None,
        cpus: int | None = None,
        accounting: bool = True,
        hosts: TestCluster | None = None,
    ) -> None:
        # ``hosts``: running test hosts to put Slurm on (a run's shared pair); left running at close, reset.
        self.owns_hosts = hosts is None
        self.hosts = hosts if hosts is not None else TestCluster(n, docker=docker, workdir=workdir)
        self.accounting = accounting
        self.cpus = cpus or os.cpu_count() or 1
        self.name = f"dz{secrets.token_hex(3)}"
        self._procs: list[subprocess.Popen] = []
        self.owner = {"pid": os.getpid(), "start": _start_time(os.getpid())}
        self._logs: list = []
        self._made_socket_mountpoint = False

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
        sweep_stale_daemons()
        if self.owns_hosts:
            self.hosts.start()
        shutil.rmtree(self.run, ignore_errors=True)  # shared hosts: no state of an earlier Slurm on them
        self.run.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run, 0o755)
        self.conf.parent.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        if self.accounting:
            self._start_accounting()
        self._start_slurmctld()
        if self.hosts.docker:
            self._ensure_docker_socket_mountpoint()
        for host in self.hosts.hosts:
            self._start_slurmd(host)
        self.wait_idle()

    def _ensure_docker_socket_mountpoint(self) -> None:
        # A bind mount needs its target to exist: on a machine with no system dockerd there is no
        # /run/docker.sock to mount each node's socket over (slurmd then exits 32 at start). An empty
        # file stands in, removed again at close if this cluster made it.
        target = Path("/run/docker.sock")
        if not target.exists():
            target.touch()
            self._made_socket_mountpoint = True

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
        self.hosts.keep -= {proc.pid for proc in self._procs}
        self._procs.clear()
        for handle in self._logs:
            with contextlib.suppress(Exception):
                handle.close()
        if self.owns_hosts:
            self.hosts.close()  # kills whatever is left in the hosts' namespaces (job steps too)
        else:
            self.hosts.reset()  # the same for hosts that stay up: job steps, their containers
        target = Path("/run/docker.sock")
        if self._made_socket_mountpoint and target.is_file() and target.stat().st_size == 0:
            target.unlink()
        self._made_socket_mountpoint = False

    # -- daemons -----------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.run / log_name, "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self._procs.append(proc)
        self.hosts.keep.add(proc.pid)  # a daemon of this cluster's, not a test's leftover: reset() spares it
        # For sweep_stale_daemons: the daemons on the root namespace outlive a killed test process.
        with open(DAEMONS, "a") as record:
            record.write(json.dumps({"pid": proc.pid, "start": _start_time(proc.pid), "owner": self.owner}) + "\n")
        return proc

    def _start_munge(self) -> None:
        key = self.run / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        (self.run / "munge").mkdir(exist_ok=True)
        Path("/run/munge").mkdir(exist_ok=True)  # munge's default socket dir: each namespace mounts its own here
        self.munge_socket = self.run / "munge" / "munge.socket.2"
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
        self.ctld_port, self.slurmd_port, self.dbd_port, self.db_port = free_ports(4)
        nodes = [h.name for h in self.hosts.hosts]
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={self.controller_name}({self.hosts.gateway})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
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
            *(
                [
                    "AccountingStorageType=accounting_storage/slurmdbd",
                    f"AccountingStorageHost={self.hosts.gateway}",
                    f"AccountingStoragePort={self.dbd_port}",
                ]
                if self.accounting
                else ["AccountingStorageType=accounting_storage/none"]
            ),
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            # Without accounting, ended jobs stay known to scontrol for an hour.
            f"MinJobAge={300 if self.accounting else 3600}",
            # Slurm's default KillWait (30 s between SIGTERM and SIGKILL): what the ranks' wrappers get to stop
            # their containers and record their end.
            "KillWait=30",
            "SlurmdTimeout=60",
            # A client command that finds slurmctld down retries for about 2 x (MessageTimeout - 1) s: 18 s
            # each at the default 10 (measured here with squeue; scancel about half), which the tests that
            # stop Slurm on purpose waited out several times over. Every answer here is local and quick.
            "MessageTimeout=5",
            "InactiveLimit=0",
            # Each node's address: slurmctld reaches the slurmds over the bridge.
            *(f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus} State=UNKNOWN" for h in self.hosts.hosts),
            f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        for host in self.hosts.hosts:
            (self.run / f"{host.name}-spool").mkdir(exist_ok=True)

    def _start_accounting(self) -> None:
        data = self.run / "mariadb"
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root", "--skip-test-db",
             "--auth-root-authentication-method=normal"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        # No grant tables: any local client is root. A test database on 127.0.0.1 and a random port only.
        self._spawn(
            ["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={self.run / 'mariadb.sock'}",
             f"--port={self.db_port}", "--bind-address=127.0.0.1", "--user=root", "--skip-grant-tables",
             f"--pid-file={self.run / 'mariadb.pid'}"],
            "mariadb.out",
        )  # fmt: skip
        self._wait(lambda: _port_open("127.0.0.1", self.db_port), 60, "MariaDB")
        conf = self.conf.parent / "slurmdbd.conf"  # slurmdbd reads it beside SLURM_CONF
        conf.write_text(
            "\n".join(
                [
                    "AuthType=auth/munge",
                    f"DbdHost={self.controller_name}",
                    f"DbdAddr={self.hosts.gateway}",
                    f"DbdPort={self.dbd_port}",
                    "SlurmUser=root",
                    "StorageType=accounting_storage/mysql",
                    "StorageHost=127.0.0.1",
                    f"StoragePort={self.db_port}",
                    "StorageUser=root",
                    f"StorageLoc=slurm_acct_{self.hosts.cid}",
                    f"PidFile={self.run / 'slurmdbd.pid'}",
                    f"LogFile={self.run / 'slurmdbd.log'}",
                ]
            )
            + "\n"
        )
        os.chmod(conf, 0o600)
        self._start_slurmdbd()
        added = self.client(["sacctmgr", "--immediate", "add", "cluster", self.name], check=False, timeout=60)
        if added.returncode != 0:
            raise TestHostError(f"sacctmgr add cluster: {added.stdout}{added.stderr}" + self.daemon_logs()[-3000:])

    def _start_slurmdbd(self) -> None:
        self._spawn(
            self.in_namespace(["env", f"SLURM_CONF={self.conf}", "slurmdbd", "-D"], hostname=self.controller_name),
            "slurmdbd.out",
        )  # fmt: skip
        self._wait(lambda: _port_open(self.hosts.gateway, self.dbd_port), 60, "slurmdbd")

    def _start_slurmctld(self) -> None:
        (self.run / "ctld-state").mkdir(exist_ok=True)
        # Its own hostname (a UTS namespace): slurmctld runs only where SlurmctldHost names the host.
        self._spawn(
            self.in_namespace(["slurmctld", "-D", "-i", "-f", str(self.conf)], hostname=self.controller_name),
            "slurmctld.out",
        )  # fmt: skip
        self._wait(lambda: self._answers(["scontrol", "ping"], "UP"), 30, "slurmctld")

    @contextlib.contextmanager
    def unreachable(self):
        """Slurm stopped while the block runs: slurmctld and slurmdbd (so squeue, scontrol, scancel and
        sacct all fail), then started again on their saved state. The slurmds and their job steps run on."""
        stopped = [p for p in self._procs if {"slurmctld", "slurmdbd"} & set(p.args) and p.poll() is None]
        for proc in stopped:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            self._procs.remove(proc)  # ended on purpose: _wait would read it as a daemon that died
            self.hosts.keep.discard(proc.pid)
        try:
            yield
        finally:
            if self.accounting:
                self._start_slurmdbd()
            self._start_slurmctld()
            back = {"idle", "allocated", "mixed"}
            self._wait(lambda: bool(states := self.node_states()) and states <= back, 120, "the nodes back")

    def _start_slurmd(self, host) -> None:
        # With docker hosts, the node's own dockerd is its /run/docker.sock in slurmd's mount namespace
        # (and so in its job steps'), as on a real node: jobs get the submitter's environment, not the node's.
        script = (
            'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind /dev/null /etc/resolv.conf'
            ' && { [ -z "$3" ] || mount --bind "$3" /run/docker.sock; } && mount --bind "$4" /run/munge'
            ' && shift 4 && exec "$@"'
        )
        socket_path = str(host.docker_socket) if host.docker_socket else ""
        self._spawn(
            ["nsenter", f"--net={host.netns_path}", "unshare", "--uts", "--mount", "--propagation", "slave",
             "sh", "-c", script, "sh", host.name, str(self.hosts.hosts_file), socket_path,
             str(self.munge_socket.parent),
             "slurmd", "-D", "-N", host.name, "-f", str(self.conf)],
            f"{host.name}-slurmd.out",
        )  # fmt: skip

    def wait_idle(self, timeout: float = 60) -> None:
        self._wait(lambda: self.node_states() == {"idle"}, timeout, "every node idle")

    def node_states(self) -> set[str]:
        out = self.client(["sinfo", "--noheader", "--Node", "--format", "%T"], check=False).stdout
        return {line.strip().rstrip("*~#") for line in out.splitlines() if line.strip()}

    # -- helpers -----------------------------------------------------------------------------
    def in_namespace(self, argv: list[str], hostname: str | None = None) -> list[str]:
        """``argv`` with this cluster's munged at munge's default socket (a mount namespace) and ``hostname``.

        Slurm's accounting connections (slurmctld and the clients to slurmdbd) use munge's default
        socket whatever AuthInfo says; a private /run/munge keeps each cluster's munged its own.
        """
        script = 'mount --bind "$1" /run/munge && { [ -z "$2" ] || hostname "$2"; } && shift 2 && exec "$@"'
        return ["unshare", "--mount", "--propagation", "slave", "--uts", "sh", "-c", script, "sh",
                str(self.munge_socket.parent), hostname or "", *argv]  # fmt: skip

    def client(self, argv: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        argv = self.in_namespace(argv)
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
