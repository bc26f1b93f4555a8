"""Bulk streams through the system's OpenSSH client (``ssh``), where it reaches the node.

Why: paramiko frames, encrypts and MACs every 32 KB packet in Python, under the one GIL that all
of a distribution's streams share. On a 2-core controller, sending 600 MiB to each of 3 test hosts
at once took 12.3 s (12.6 s of CPU) through paramiko and 5.0 s (5.2 s of CPU) through the OpenSSH
client, whose processes run beside each other outside the GIL (medians of 2 rounds,
benchmarks/ssh_streams.py, benchmarks/results/ssh-streams-20261201.txt). An image is hundreds of
MB per node, so ``distribute`` sends it through ``ssh`` and keeps paramiko for everything else
(short commands, SFTP, the checks).

The OpenSSH client is pointed at exactly what the ``HostPool`` resolved for the host (HostName,
Port, User, IdentityFile, UserKnownHostsFile, and each ProxyJump hop as the pool resolved it) and
is never allowed to ask or to learn anything: ``BatchMode`` and ``StrictHostKeyChecking yes``, for
the host and for every hop. The pool's own connection has already
checked the host's key against those known_hosts files, or recorded it where the user allowed
that (``--trust-new-hosts``, ``accept-new``), so OpenSSH checks the same key. Each node is probed
with ``true`` first; a node the client cannot reach that way (no ``ssh`` binary, a key only
paramiko found, a jump host it resolves differently) keeps paramiko and the run says so.

``ssh`` exits 255 both when its connection fails and when the remote command itself exits 255.
To tell them apart, each command runs behind a small wrapper that, only when the command's status
is 255, prints a marker line (a token fresh for each run) as the last thing on stderr. A 255 with
the marker is the command's own result; one without it is the client's failure (a lost link).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
from collections.abc import Iterable

from ..errors import InputError
from .connection import command_line, decoded, deliver
from .local import LOCAL_HOSTS, LocalConnection
from .results import NO_EXIT_STATUS, Result
from .sshconfig import HostConfig

CLIENTS = ("auto", "openssh", "paramiko")
CLIENT_ENV = "DZCTL_SSH_CLIENT"  # what `dzctl distribute --ssh-client` reads too, and `dzctl launch` honours
PROBE_TIMEOUT = 30.0
LOST = 255  # what the ssh client exits with when the connection failed (or was lost)
# AES-GCM first: with the AES instructions of server CPUs it cost two thirds of the CPU of
# chacha20-poly1305, OpenSSH's own first choice (5.2 s against 7.9 s on a CPU with AES-NI,
# benchmarks/ssh_streams.py). "^" only moves these to the front of the client's list, so a
# server that refuses them still finds a common cipher.
CIPHERS = "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"


def client_from_env(environ=os.environ) -> str:
    """The stream client ``DZCTL_SSH_CLIENT`` names (``auto`` when unset); InputError for another value."""
    chosen = environ.get(CLIENT_ENV) or "auto"
    if chosen not in CLIENTS:
        raise InputError(
            f"{CLIENT_ENV}={chosen!r} is not an SSH client dzctl knows",
            fix=f"set {CLIENT_ENV} to one of {', '.join(CLIENTS)}, or unset it",
        )
    return chosen


def client_argv(config: HostConfig, ssh_config: str | None, jumps: tuple[HostConfig, ...] = ()) -> list[str]:
    """The ``ssh`` command line (before the remote command) that reaches ``config`` as the pool does.

    ``jumps``: ``config.proxy_jump``'s hops as the pool resolved them (``HostPool.jump_hosts``).
    """
    if len(jumps) != len(config.proxy_jump):
        raise ValueError(f"{config.alias}: ProxyJump names {len(config.proxy_jump)} hop(s), {len(jumps)} given")
    argv = ["ssh", *_config_file(ssh_config), *_options(config)]
    if jumps:
        # Not ProxyJump: for each hop OpenSSH starts `ssh -W` with only -F, -l, -p and -J, so
        # BatchMode, StrictHostKeyChecking and UserKnownHostsFile would hold for the last host
        # only. Each hop's ssh is spelled out here with the same options instead.
        argv += ["-o", f"ProxyCommand={_proxy_command(jumps, config, ssh_config)}"]
    return [*argv, "-T", "--", config.alias]


def _config_file(ssh_config: str | None) -> list[str]:
    return ["-F", str(ssh_config)] if ssh_config else []


def _options(config: HostConfig) -> list[str]:
    """The ``-o`` and ``-i`` arguments that make ``ssh`` reach ``config`` by dzctl's rules."""
    options = {
        "BatchMode": "yes",  # never a password or passphrase prompt in the middle of a transfer
        "StrictHostKeyChecking": "yes",  # the pool checked (or recorded) the key; never add one here
        "UserKnownHostsFile": " ".join(config.known_hosts_files),
        "HostName": config.hostname,
        "Port": str(config.port),
        "User": config.user,
        "IdentitiesOnly": "yes" if config.identities_only else "no",
        "Compression": "no",  # the stream is gzip or zstd already
        "ControlMaster": "no",  # a user's shared master would put every stream through one process
        "ControlPath": "none",
        "ServerAliveInterval": "30",  # as the pool's keepalive: notice a dead peer
        "LogLevel": "ERROR",
        "Ciphers": CIPHERS,
    }
    if config.connect_timeout:
        options["ConnectTimeout"] = str(int(config.connect_timeout))
    argv = []
    for name, value in options.items():
        argv += ["-o", f"{name}={value}"]
    for key in config.identity_files:
        argv += ["-i", key]
    return argv


def _proxy_command(jumps: tuple[HostConfig, ...], target: HostConfig, ssh_config: str | None) -> str:
    """``ProxyCommand``'s value: an ``ssh -W`` to the last hop, which reaches it through the hops before.

    The pool dials hops the same way: the first directly (its own config's ProxyJump is not
    followed), each next one through the one before, and the target through the last.
    """
    *before, last = jumps
    proxy = _proxy_command(tuple(before), last, ssh_config) if before else "none"
    host = f"[{target.hostname}]" if ":" in target.hostname else target.hostname
    argv = ["ssh", *_config_file(ssh_config), *_options(last), "-o", f"ProxyCommand={proxy}"]
    argv += ["-W", f"{host}:{target.port}"]
    # ssh expands %-tokens in ProxyCommand (once per level): every literal % is doubled.
    return shlex.join([*argv, "--", last.alias]).replace("%", "%%")


class OpenSSHLink(LocalConnection):
    """A ``Connection`` whose every command is one ``ssh`` process (a fresh session each time).

    Made for a few long streams, not for many short commands: each ``run`` pays a full SSH
    handshake. ``close`` kills what runs, which is how a stalled node's transfer is stopped.
    """

    def __init__(self, host: str, prefix: list[str]) -> None:
        super().__init__(host)
        self.prefix = prefix
        self._lost = False

    @property
    def connected(self) -> bool:
        return not self._lost

    def run(self, argv, *, timeout=None, stdin=None, check=False, env=None, on_stdout=None, on_stderr=None) -> Result:
        marker = f"dzctl-openssh-exit-255-{secrets.token_hex(8)}"
        stderr = _MarkerFilter(f"{marker}\n".encode(), on_stderr)
        ran = super().run(
            [*self.prefix, wrapped_command(command_line(argv, env), marker)],
            timeout=timeout,
            stdin=stdin,
            on_stdout=on_stdout,
            on_stderr=stderr,
        )
        said_255 = stderr.finish()
        code = ran.exit_code
        if code == LOST and not said_255:
            # The client's own failure, not the command's: reported as paramiko reports a dropped
            # session, so callers tell a lost link from a failed command the same way for both.
            self._lost, code = True, NO_EXIT_STATUS
        result = Result(self.host, tuple(argv), code, ran.stdout, stderr.text, ran.elapsed_s)
        return result.check() if check else result

    def close(self) -> None:
        self.kill_running()


def wrapped_command(line: str, marker: str) -> str:
    """``line`` for the remote login shell, printing ``marker`` on stderr only if it exits 255.

    The wrapper exits with the command's own status, so every other status reads as before.
    """
    return f'{line}; s=$?; [ "$s" -ne {LOST} ] || printf "%s\\n" {marker} >&2; exit "$s"'


class _MarkerFilter:
    """The command's stderr as it arrives, less the wrapper's marker when it ends the output.

    Bytes that may be the start of the marker are held back until the next chunk shows they are
    not (or the output ends); the rest goes to ``forward`` (streamed) or is kept as ``text``.
    """

    def __init__(self, marker: bytes, forward) -> None:
        self.marker = marker
        self.forward = forward
        self._kept: list[bytes] = []
        self._held = b""

    def __call__(self, chunk: bytes) -> None:
        data = self._held + chunk
        keep = _marker_prefix_at_end(data, self.marker)
        self._held = data[len(data) - keep :]
        self._emit(data[: len(data) - keep])

    def finish(self) -> bool:
        """Whether the output ended with the marker (which is then dropped)."""
        held, self._held = self._held, b""
        if held == self.marker:
            return True
        self._emit(held)
        return False

    @property
    def text(self) -> str:
        return decoded(self._kept)

    def _emit(self, data: bytes) -> None:
        if data:
            deliver(data, self._kept, self.forward)


def _marker_prefix_at_end(data: bytes, marker: bytes) -> int:
    """The length of the longest end of ``data`` that is a start of ``marker`` (0: none)."""
    for length in range(min(len(data), len(marker)), 0, -1):
        if data.endswith(marker[:length]):
            return length
    return 0


def stream_links(pool, hosts: Iterable[str], client: str = "auto") -> tuple[dict, dict[str, str], list[str]]:
    """What carries each host's bulk stream: ``({host: Connection}, {host: "openssh" | "paramiko" |
    "local"}, notes)``.

    ``client``: ``auto`` (OpenSSH where its probe succeeds, else the pool's paramiko connection),
    ``openssh`` (every remote host must pass the probe: InputError naming each that does not,
    before anything is sent), ``paramiko`` (the pool's connections only).
    """
    if client not in CLIENTS:
        raise InputError(f"unknown SSH client '{client}'", fix=f"use one of: {', '.join(CLIENTS)}")
    hosts = list(hosts)
    remote = [host for host in hosts if host not in LOCAL_HOSTS]
    links: dict = {}
    kinds = {host: "local" if host in LOCAL_HOSTS else "paramiko" for host in hosts}
    notes: list[str] = []
    if client == "paramiko" or not remote:
        return links, kinds, notes
    if shutil.which("ssh") is None:
        if client == "openssh":
            raise InputError(
                "no OpenSSH client (`ssh`) on PATH here", fix="install openssh-client, or use --ssh-client auto"
            )
        notes.append("no OpenSSH client (`ssh`) here: the streams go through paramiko, which costs more CPU")
        return links, kinds, notes
    candidates = {host: OpenSSHLink(host, _argv_for(pool, host)) for host in remote}
    # Through the pool's fan-out, so each node's own connection is opened first: it checks the host
    # key by dzctl's rules and records it where the user allowed that, so OpenSSH, which may only
    # check, finds it. A node paramiko cannot reach either comes back as its error.
    outcomes = pool.map(lambda conn: _probe(candidates[conn.host]), remote)
    probes = {
        host: str(outcome).splitlines()[0] if isinstance(outcome, BaseException) else outcome
        for host, outcome in outcomes.items()
    }
    refused = {host: why for host, why in probes.items() if why}
    if refused and client == "openssh":
        lines = "\n".join(f"{host}: {why}" for host, why in refused.items())
        raise InputError(
            f"the OpenSSH client cannot reach {len(refused)} node(s):\n{lines}",
            fix="run `ssh` to each node named once by hand to see why, or use --ssh-client auto",
        )
    for host, why in probes.items():
        if why:
            notes.append(f"{host}: the OpenSSH client could not connect ({why}): paramiko carries its stream")
        else:
            links[host], kinds[host] = candidates[host], "openssh"
    return links, kinds, notes


def _argv_for(pool, host: str) -> list[str]:
    config = pool.resolve(host)
    return client_argv(config, pool.ssh_config_path, pool.jump_hosts(config))


def _probe(link: OpenSSHLink) -> str:
    """'' if the client ran ``true`` on the node, else why not (its last stderr line)."""
    try:
        result = link.run(["true"], timeout=PROBE_TIMEOUT)
    except Exception as exc:  # a timeout: the node is not reachable this way
        return str(exc)
    if result.ok:
        return ""
    with contextlib.suppress(IndexError):
        return result.stderr.strip().splitlines()[-1]
    return result.how_it_ended
