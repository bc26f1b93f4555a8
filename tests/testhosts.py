"""Real test hosts on one machine: network namespaces with their own sshd (and dockerd).

Each host is a network namespace on a bridge private to its cluster, with its
own address, its own hostname (a UTS namespace around sshd, so ``hostname``
over SSH names the host), its own sshd and host key, and on request its own
dockerd with its own data root and socket. The controller (the test process,
in the root namespace) reaches them over the bridge exactly as it would reach
real nodes. All hosts share this machine's filesystem, like nodes sharing NFS.

    with TestCluster(4, workdir=tmp_path) as cluster:
        cluster.hosts[0].name        # "node0"; sshd answers as that name via cluster.ssh_config
        cluster.write_hostfile(tmp_path / "hostfile", slots=2)
        cluster.run_in(cluster.hosts[0], ["hostname"])

Names (netns, bridge, veths, subnet) carry a random cluster id, chosen under a
lock, so clusters built at the same time by parallel test runs never collide.
Needs root, ``ip`` (iproute2), ``nsenter``/``unshare`` (util-linux), ``sshd``
(openssh-server), ``ssh-keygen``; ``dockerd`` (docker.io) only with docker=True.

Each host sees an /etc/hosts naming the cluster's hosts and has no DNS server,
and this machine's ~/.bashrc is hidden from its SSH sessions (see start_sshd).

Cost: 4 hosts start in about a second. A dockerd per host adds a few seconds
each (it starts its own containerd); ask for docker=True only where a test
talks to Docker.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import ipaddress
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Short per-cluster state lives here: unix socket paths are limited to 108
# bytes, and dockerd's exec-root holds containerd's sockets, so these cannot
# sit under pytest's long tmp paths.
RUN_ROOT = Path("/run/dzctl-testhosts")
LOCK_PATH = RUN_ROOT / "alloc.lock"
# Candidate subnets: 10.213.X.0/24 with X chosen at random, skipped when any
# route or address here overlaps it.
SUBNET_BASE = ipaddress.ip_network("10.213.0.0/16")

# Interactive-shell setup of this machine that SSH sessions on test hosts do not see.
HIDDEN_DOTFILES = (".bashrc",)

REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "ssh-keygen")


# What OpenSSH's sshd gives sessions (Debian's build); SetEnv PATH replaces it.
SSHD_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TestHostError(RuntimeError):
    """The test hosts could not be built (missing tool, sshd not listening, ...)."""


def missing_requirements(docker: bool = False) -> list[str]:
    """What stops test hosts from being built here; empty when they can be."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces need CAP_SYS_ADMIN)")
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            missing.append(tool)
    if not Path("/usr/sbin/sshd").exists() and shutil.which("sshd") is None:
        missing.append("sshd (apt-get install openssh-server)")
    if docker and shutil.which("dockerd") is None:
        missing.append("dockerd (apt-get install docker.io)")
    return missing


@dataclass
class TestHost:
    """One test host. ``name`` is its ssh_config alias and its hostname."""

    __test__ = False  # not a pytest test class, despite the name

    name: str
    address: str
    netns: str
    dir: Path
    port: int = 22
    sshd_pid: int | None = None
    docker_socket: Path | None = None
    dockerd_pid: int | None = None
    host_key_line: str = ""  # "ssh-ed25519 AAAA..." as served by this host's sshd
    hidden_tools: tuple[str, ...] = ()  # commands this host's SSH sessions cannot find (e.g. "ip")
    sftp: bool = True  # False: an sshd without `Subsystem sftp`, as on some hardened servers

    @property
    def docker_host(self) -> str | None:
        """``unix://SOCK`` for ``docker -H``, or None without a dockerd."""
        return f"unix://{self.docker_socket}" if self.docker_socket else None

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"


@dataclass
class TestCluster:
    """N test hosts on a private bridge; a context manager that always tears down."""

    __test__ = False

    n: int
    docker: bool = False
    workdir: Path | None = None
    name_prefix: str = "node"
    cid: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: list[TestHost] = field(default_factory=list, init=False)
    # Daemons a caller started in the hosts' namespaces that reset() must leave running (a Slurm cluster's slurmd).
    keep: set[int] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("a cluster needs at least one host")
        self.workdir = Path(self.workdir) if self.workdir else Path(f"/tmp/dzctl-testhosts-{self.cid}")
        self.bridge = f"dzb{self.cid}"  # interface names are limited to 15 characters
        self.rundir = RUN_ROOT / self.cid
        self.network: ipaddress.IPv4Network | None = None
        self._cleanups: list = []
        self._log_files: list = []
        self._deletions: list[threading.Thread] = []

    # -- public paths ---------------------------------------------------------
    @property
    def ssh_config(self) -> Path:
        return self.workdir / "ssh_config"

    @property
    def hosts_file(self) -> Path:
        """The /etc/hosts every test host sees: its cluster's names and addresses."""
        return self.workdir / "etc_hosts"

    @property
    def known_hosts(self) -> Path:
        return self.workdir / "known_hosts"

    @property
    def identity(self) -> Path:
        return self.workdir / "id_ed25519"

    @property
    def gateway(self) -> str:
        """The controller's address on the bridge (what the hosts see it as)."""
        return str(self.network.network_address + 1)

    def first(self, n: int) -> TestCluster:
        """The first ``n`` hosts as a cluster of their own: the same network, keys, ssh_config and daemons.

        Hostfiles, ``reset`` and loops over ``hosts`` see only those n; the others stay up, unseen. Never
        closed itself: the whole cluster's owner closes it.
        """
        view = copy.copy(self)
        view.hosts = self.hosts[:n]
        view.n = n
        return view

    def host(self, name: str) -> TestHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    # -- lifecycle ------------------------------------------------------------
    def __enter__(self) -> TestCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        missing = missing_requirements(self.docker)
        if missing:
            raise TestHostError("cannot build test hosts, missing: " + ", ".join(missing))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rundir.mkdir(parents=True, exist_ok=True)
        self._cleanups.append(lambda: shutil.rmtree(self.rundir, ignore_errors=True))
        # sshd refuses to start without its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for stale in (self.identity, Path(f"{self.identity}.pub")):
            stale.unlink(missing_ok=True)  # a reused workdir: ssh-keygen would ask before overwriting
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dzctl-test-{self.cid}", "-f", str(self.identity)])
        self._make_network()
        for index in range(self.n):
            self.hosts.append(self._make_host(index))
        self.hosts_file.write_text(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            + "".join(f"{h.address}\t{h.name}\n" for h in self.hosts)
        )
        for host in self.hosts:
            self.start_sshd(host)
        if self.docker:
            # dockerd start-up is the slow part; start all, then wait for all.
            procs = [self._spawn_dockerd(host) for host in self.hosts]
            for host, proc in zip(self.hosts, procs, strict=True):
                self._wait_dockerd(host, proc)
        self._write_client_files()

    def close(self) -> None:
        """Tear everything down, in reverse order; every step runs even if one fails."""
        while self._cleanups:
            step = self._cleanups.pop()
            with contextlib.suppress(Exception):
                step()
        while self._deletions:  # the dockerds' data, deleted side by side (_stop_dockerd)
            self._deletions.pop().join()
        for handle in self._log_files:
            with contextlib.suppress(Exception):
                handle.close()
        self._log_files.clear()

    def reset(self) -> list[str]:
        """Return the hosts to what ``start`` left, for the next test that shares them; returns what it removed.

        Every container is removed, and every process in a host's network namespace is killed except the
        host's own daemons (its sshd listener, its dockerd and the containerd dockerd runs, and the pids in
        ``keep``): so a job a test left running, a rank, a supervisor or a stray ``sleep``, is gone before
        the next test starts. iptables rules a test added in a host's namespace are flushed too.
        """
        removed = []
        for host in self.hosts:
            if host.docker_host:
                listed = _run(["docker", "-H", host.docker_host, "ps", "--all", "--quiet"], check=False).stdout.split()
                if listed:
                    _run(["docker", "-H", host.docker_host, "rm", "--force", *listed], check=False, timeout=120)
                    removed += [f"{host.name}: container {c}" for c in listed]
            daemons = {pid for pid in (host.sshd_pid, host.dockerd_pid) if pid is not None} | self.keep
            daemons |= {pid for pid, parent in _parents().items() if parent == host.dockerd_pid}  # containerd
            for pid in map(int, _run(["ip", "netns", "pids", host.netns], check=False).stdout.split()):
                if pid in daemons:
                    continue
                comm = _comm(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    removed.append(f"{host.name}: pid {pid} ({comm})")
            self.run_in(host, ["iptables", "-F"], check=False)
            if host.sshd_pid is None:  # a test stopped it (a node lost): the next test gets the host up
                self.start_sshd(host)
                removed.append(f"{host.name}: sshd was stopped (started again, same host key)")
        return removed

    # -- network --------------------------------------------------------------
    def _make_network(self) -> None:
        RUN_ROOT.mkdir(parents=True, exist_ok=True)
        # The lock makes "pick a free subnet" and "claim it" one step across
        # parallel test runs: the claimed subnet shows up as a route at once.
        with open(LOCK_PATH, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep_stale_clusters()
            (self.rundir / "owner.json").write_text(
                json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid()), "workdir": str(self.workdir)})
            )
            self.network = _free_subnet()
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._cleanups.append(lambda: _run(["ip", "link", "del", self.bridge], check=False))
            _run(["ip", "addr", "add", f"{self.gateway}/{self.network.prefixlen}", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])

    def _make_host(self, index: int) -> TestHost:
        name = f"{self.name_prefix}{index}"
        netns = f"dzt-{self.cid}-{index}"
        address = str(self.network.network_address + 2 + index)
        host_dir = self.workdir / name
        host_dir.mkdir(parents=True, exist_ok=True)
        host = TestHost(name=name, address=address, netns=netns, dir=host_dir)
        _run(["ip", "netns", "add", netns])
        self._cleanups.append(lambda: self._delete_netns(host))
        outer, inner = f"dzv{self.cid}{index}", f"dzi{self.cid}{index}"
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
        self._cleanups.append(lambda: _run(["ip", "link", "del", outer], check=False))
        _run(["ip", "link", "set", outer, "master", self.bridge, "up"])
        _run(["ip", "link", "set", inner, "netns", netns])
        # Inside, the interface is called eth0 like on a real node, so
        # interface detection has something realistic to find.
        ns = ["ip", "-n", netns]
        _run([*ns, "link", "set", inner, "name", "eth0"])
        _run([*ns, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0"])
        _run([*ns, "link", "set", "eth0", "up"])
        _run([*ns, "link", "set", "lo", "up"])
        _run([*ns, "route", "add", "default", "via", self.gateway])
        return host

    def _delete_netns(self, host: TestHost) -> None:
        # Anything still running in the namespace was started by this cluster
        # (sshd sessions, listeners a test left): kill those pids, then delete.
        out = _run(["ip", "netns", "pids", host.netns], check=False).stdout
        for pid in out.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "del", host.netns], check=False)

    # -- sshd -----------------------------------------------------------------
    def _write_sshd_config(self, host: TestHost) -> Path:
        key = host.dir / "ssh_host_ed25519_key"
        if not key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f", str(key)])
        host.host_key_line = " ".join(key.with_suffix(".pub").read_text().split()[:2])
        authorized = host.dir / "authorized_keys"
        authorized.write_text(Path(f"{self.identity}.pub").read_text())
        lines = [
            f"ListenAddress {host.address}",
            f"Port {host.port}",
            f"HostKey {key}",
            f"PidFile {host.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            # The key files live under the test's tmp dir, whose modes sshd
            # would otherwise reject.
            "StrictModes no",
            "UsePAM no",
            # Many tests open several sessions per connection at once.
            "MaxSessions 64",
            "MaxStartups 100:30:200",
            # VERBOSE: each connection's close and its reason, for a drop seen in CI.
            "LogLevel VERBOSE",
        ]
        if host.sftp:
            lines.append("Subsystem sftp internal-sftp")
        if host.hidden_tools:
            lines.append(f"SetEnv PATH={self._path_without(host)}")
        if host.docker_socket is not None:
            # Sessions on this host talk to its own dockerd, as on a real node.
            lines.append(f"SetEnv DOCKER_HOST=unix://{host.docker_socket}")
        config = host.dir / "sshd_config"
        config.write_text("\n".join(lines) + "\n")
        return config

    def _path_without(self, host: TestHost) -> Path:
        """A one-directory PATH holding links to sshd's default PATH, less the hidden tools: what a
        node without those packages finds (the hosts share this machine's filesystem)."""
        shadow = host.dir / "bin-shadow"
        shutil.rmtree(shadow, ignore_errors=True)
        shadow.mkdir()
        for folder in SSHD_DEFAULT_PATH.split(":"):
            for entry in sorted(Path(folder).glob("*")) if Path(folder).is_dir() else []:
                link = shadow / entry.name
                if entry.name not in host.hidden_tools and not link.exists() and os.access(entry, os.X_OK):
                    link.symlink_to(entry)
        return shadow

    def reconfigure_sshd(self, host: TestHost, *, hidden_tools: tuple[str, ...] | None = None,
                         sftp: bool | None = None) -> None:  # fmt: skip
        """Restart one host's sshd with tools hidden from its sessions, or without SFTP."""
        if hidden_tools is not None:
            host.hidden_tools = tuple(hidden_tools)
        if sftp is not None:
            host.sftp = sftp
        self.stop_sshd(host)
        # The old listener may outlive the signal for a moment: a new sshd would then fail to bind,
        # and the port check would be answered by the old one.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host.address, host.port), timeout=0.5).close()
            except OSError:
                break
            time.sleep(0.05)
        self.start_sshd(host)

    def start_sshd(self, host: TestHost, timeout: float = 10.0) -> None:
        """Start (or restart) the host's sshd and wait until it accepts TCP connections."""
        if host.sshd_pid is not None:
            return
        if self.docker and host.docker_socket is None:
            host.docker_socket = self.rundir / str(self.hosts.index(host)) / "docker.sock"
        config = self._write_sshd_config(host)
        log = open(host.dir / "sshd.log", "ab")  # noqa: SIM115 - closed in close()
        self._log_files.append(log)
        # nsenter and unshare exec (they do not fork here), and sh execs sshd,
        # so the pid we get is sshd's own. -D keeps it in the foreground.
        # A mount namespace (mounts from outside still propagate in) lets the
        # host hide this dev machine's ~/.bashrc, which bash sources for every
        # SSH command: a fresh node has none, and here it costs ~0.7 s a command.
        # Name resolution as on a real cluster: /etc/hosts lists every node of this cluster, and
        # there is no DNS server (from the namespace this machine's resolver is unreachable, and
        # each lookup would wait out its timeout); an empty resolv.conf fails fast instead.
        script = (
            'hostname "$1" && for f in $3; do [ ! -f "$f" ] || mount --bind /dev/null "$f"; done'
            ' && mount --bind "$4" /etc/hosts && mount --bind /dev/null /etc/resolv.conf'
            ' && exec /usr/sbin/sshd -D -e -f "$2"'
        )
        argv = [
            "nsenter",
            f"--net={host.netns_path}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            script,
            "sh",
            host.name,
            str(config),
            " ".join(str(Path(pwd.getpwnam("root").pw_dir) / name) for name in HIDDEN_DOTFILES),
            str(self.hosts_file),
        ]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        host.sshd_pid = proc.pid
        self._cleanups.append(lambda: self.stop_sshd(host))
        self._wait_port(host, proc, timeout)

    def stop_sshd(self, host: TestHost) -> None:
        """Kill the host's sshd listener (existing sessions end with it)."""
        pid, host.sshd_pid = host.sshd_pid, None
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def drop_connections(self, host: TestHost) -> list[int]:
        """SIGKILL the sshd processes serving connections to ``host``, not its listener.

        What a client sees when a firewall or NAT drops the flow, or the server side
        of a session dies: its connections close, and new ones are still accepted.
        Returns the pids killed.
        """
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
        killed = []
        for pid in map(int, out):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("sshd") and pid != host.sshd_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        return killed

    def _wait_port(self, host: TestHost, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = (host.dir / "sshd.log").read_text(errors="replace")
                raise TestHostError(f"sshd on {host.name} exited ({proc.returncode}): {log[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection((host.address, host.port), timeout=0.5):
                return
            time.sleep(0.05)
        raise TestHostError(f"sshd on {host.name} ({host.address}:{host.port}) not listening after {timeout}s")

    # -- dockerd --------------------------------------------------------------
    def _spawn_dockerd(self, host: TestHost) -> subprocess.Popen:
        index = self.hosts.index(host)
        run = self.rundir / str(index)
        run.mkdir(parents=True, exist_ok=True)
        host.docker_socket = run / "docker.sock"
        data_root = host.dir / "docker-data"
        data_root.mkdir(parents=True, exist_ok=True)
        log = open(host.dir / "dockerd.log", "ab")  # noqa: SIM115 - closed in close()
        self._log_files.append(log)
        # nsenter --net, not `ip netns exec`: the latter remounts /sys and
        # dockerd then dies with "Devices cgroup isn't mounted" (DESIGN.md §4).
        # No bridge or iptables: containers run with --network host, which puts
        # them in this host's namespace.
        # Name resolution as sshd's sessions have it (start_sshd): a --network host container gets
        # dockerd's /etc/hosts and /etc/resolv.conf. This machine's resolver is unreachable from the
        # namespace, so with the real resolv.conf every lookup a rank makes (gloo resolves its peers
        # and their names) waited out its timeout: 40 s of a docker launch's collective check and
        # about 30 s of each training start. The cluster's hosts file and an empty resolv.conf fail fast.
        argv = [
            "nsenter",
            f"--net={host.netns_path}",
            # Its own hostname too, so `docker info` names the host.
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind /dev/null /etc/resolv.conf'
            ' && shift 2 && exec dockerd "$@"',
            "sh",
            host.name,
            str(self.hosts_file),
            "--data-root",
            str(data_root),
            "--exec-root",
            str(run / "exec"),
            "--pidfile",
            str(run / "dockerd.pid"),
            "-H",
            f"unix://{host.docker_socket}",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
            "--bridge=none",
        ]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        host.dockerd_pid = proc.pid
        self._cleanups.append(lambda: self._stop_dockerd(host, proc, data_root))
        return proc

    def _wait_dockerd(self, host: TestHost, proc: subprocess.Popen, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = (host.dir / "dockerd.log").read_text(errors="replace")
                raise TestHostError(f"dockerd on {host.name} exited ({proc.returncode}): {log[-2000:]}")
            probe = _run(["docker", "-H", host.docker_host, "version", "--format", "{{.Server.Version}}"], check=False)
            if probe.returncode == 0:
                return
            time.sleep(0.2)
        raise TestHostError(f"dockerd on {host.name} did not answer on {host.docker_socket} within {timeout}s")

    def _terminate_other_dockerds(self) -> None:
        # Teardown stops hosts one by one; asking every dockerd to stop at once lets their
        # shutdowns (~1 s each) overlap instead of adding up.
        for other in self.hosts:
            if other.dockerd_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other.dockerd_pid, signal.SIGTERM)

    def _stop_dockerd(self, host: TestHost, proc: subprocess.Popen, data_root: Path) -> None:
        # SIGTERM lets dockerd stop its containers, its containerd and unmount
        # its overlays; SIGKILL only if it hangs.
        if proc.poll() is None:
            proc.terminate()
            self._terminate_other_dockerds()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        host.dockerd_pid = None
        for root in (data_root, self.rundir):
            _unmount_under(root)
        # Deleting a host's images (the CPU image unpacked: 10-13 s a host on this 2-core machine) overlaps the
        # other hosts' deletions and the rest of the teardown; close() waits for every one. The run's three
        # shared docker hosts closed in 30-34 s one after another, in 26 s side by side.
        deleting = threading.Thread(target=shutil.rmtree, args=(data_root,), kwargs={"ignore_errors": True})
        deleting.start()
        self._deletions.append(deleting)

    # -- client side ----------------------------------------------------------
    def _write_client_files(self) -> None:
        blocks = []
        for host in self.hosts:
            blocks.append(
                "\n".join(
                    [
                        f"Host {host.name}",
                        f"  HostName {host.address}",
                        "  User root",
                        f"  Port {host.port}",
                        f"  IdentityFile {self.identity}",
                        "  IdentitiesOnly yes",
                        f"  UserKnownHostsFile {self.known_hosts}",
                        "  StrictHostKeyChecking yes",
                        "  ConnectTimeout 10",
                    ]
                )
            )
        self.ssh_config.write_text("\n\n".join(blocks) + "\n")
        self.write_known_hosts()

    def known_hosts_line(self, host: TestHost) -> str:
        target = host.address if host.port == 22 else f"[{host.address}]:{host.port}"
        return f"{target} {host.host_key_line}"

    def write_known_hosts(self, hosts: list[TestHost] | None = None) -> None:
        """(Re)write known_hosts with the given hosts' keys (default: all)."""
        chosen = self.hosts if hosts is None else hosts
        self.known_hosts.write_text("".join(self.known_hosts_line(h) + "\n" for h in chosen))

    def rotate_host_key(self, host: TestHost) -> None:
        """Give the host a new key (restarting its sshd): known_hosts now holds a changed key."""
        self.stop_sshd(host)
        key = host.dir / "ssh_host_ed25519_key"
        key.unlink()
        key.with_suffix(".pub").unlink()
        self.start_sshd(host)

    def write_hostfile(self, path: Path | str, slots: int = 1, names: list[str] | None = None) -> Path:
        """A DeepSpeed hostfile naming these hosts (all, or ``names`` in that order)."""
        path = Path(path)
        chosen = names if names is not None else [h.name for h in self.hosts]
        path.write_text("".join(f"{name} slots={slots}\n" for name in chosen))
        return path

    def run_in(
        self, host: TestHost, argv: list[str], *, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run a command in the host's network namespace directly (no SSH), for assertions."""
        env = dict(os.environ)
        if host.docker_host:
            env["DOCKER_HOST"] = host.docker_host
        return _run(["nsenter", f"--net={host.netns_path}", *argv], check=check, timeout=timeout, env=env)

    def ssh_argv(self, host: TestHost, argv: list[str] | None = None) -> list[str]:
        """The OpenSSH client command that reaches this host (for tests comparing with ``ssh``)."""
        return ["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", host.name, *(argv or [])]


def _run(argv: list[str], *, check: bool = True, timeout: float = 60, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise TestHostError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _used_networks() -> list[ipaddress.IPv4Network]:
    used = []
    out = _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    out += _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    for word in out.split():
        with contextlib.suppress(ValueError):
            if "/" in word or word.count(".") == 3:
                used.append(ipaddress.ip_network(word, strict=False))
    return used


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = list(SUBNET_BASE.subnets(new_prefix=24))
    for _ in range(200):
        candidate = candidates[secrets.randbelow(len(candidates))]
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return candidate
    raise TestHostError(f"no free /24 left in {SUBNET_BASE} for test hosts")


def _unmount_under(root: Path) -> None:
    # Mounts dockerd left behind (killed mid-way) would make rmtree fail.
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return
    # root itself or below it: a bare prefix test would also hit a sibling like ".../hosts10" for ".../hosts1".
    targets = [t for t in (line.split()[1] for line in mounts) if t == str(root) or t.startswith(f"{root}/")]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def _parents() -> dict[int, int]:
    """Every process's parent pid, from /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            found[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): with the pid, names one process for good."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def sweep_stale_clusters() -> list[str]:
    """Tear down clusters whose test process died without its finalizers (SIGKILL, a timeout).

    A cluster is stale when the process recorded in its owner.json (pid + start time) is
    gone; live clusters of other test runs are left alone. Returns the swept cluster ids.
    """
    swept = []
    if not RUN_ROOT.exists():
        return swept
    for rundir in RUN_ROOT.iterdir():
        owner_file = rundir / "owner.json"
        if not rundir.is_dir() or not owner_file.exists():
            continue
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            continue
        if _start_time(owner["pid"]) == owner["start"]:
            continue  # its test process still runs
        cid = rundir.name
        # dockerd first, politely: it unmounts its overlays on SIGTERM.
        for pidfile in rundir.glob("*/dockerd.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().strip())
                # pids wrap (pid_max is 32768 here): kill only if it still is that cluster's dockerd.
                if str(rundir) in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_pid_alive(f) for f in rundir.glob("*/dockerd.pid")):
            time.sleep(0.2)
        listed = _run(["ip", "netns", "list"], check=False).stdout.split()
        for netns in (n for n in listed if n.startswith(f"dzt-{cid}-")):
            for pid in _run(["ip", "netns", "pids", netns], check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", netns], check=False)
        _run(["ip", "link", "del", f"dzb{cid}"], check=False)
        _unmount_under(rundir)
        if owner.get("workdir"):
            _unmount_under(Path(owner["workdir"]))
        shutil.rmtree(rundir, ignore_errors=True)
        swept.append(cid)
    return swept


def _pid_alive(pidfile: Path) -> bool:
    try:
        pid = int(pidfile.read_text().strip())
        return str(pidfile.parent.parent) in Path(f"/proc/{pid}/cmdline").read_text()
    except (OSError, ValueError):
        return False
