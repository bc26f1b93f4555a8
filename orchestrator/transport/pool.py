"""The SSH layer's entry point: one connection per host, reused; parallel fan-out; outcomes as data.

Everything dzctl does on a node goes through a ``Connection`` from a ``HostPool``:

    with HostPool(["node0", "node1"], ssh_config=path) as pool:
        outcomes = pool.run_all(["nvidia-smi", "-L"], timeout=30)   # {host: Result | RemoteError}
        conn = pool.connection("node0")
        conn.run(["docker", "load"], stdin=open("image.tar", "rb"), check=True)
        conn.put(b"KEY=v\\n", "/var/tmp/dzctl/env", mode=0o600)

Hosts resolve through the OpenSSH client config (``sshconfig``), keys in ssh-agent are offered
too, host keys are checked (``hostkeys``), and local names run without SSH (``local``). The
transport package is the only one that imports paramiko.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import paramiko

from ..errors import InputError, RemoteError
from .connection import Connection, SSHConnection
from .hostkeys import HostKeyPolicy
from .local import LOCAL_HOSTS, LocalConnection
from .results import GroupResult, Result
from .sshconfig import DEFAULT_CONNECT_TIMEOUT, HostConfig, load_ssh_config, parse_jump, resolve_host

log = logging.getLogger(__name__)


def unresolved(config: HostConfig, reason: str, ssh_config: str | os.PathLike | None) -> RemoteError:
    """A host whose name does not resolve: where the name came from (hostfile or HostName), and its fix."""
    where = ssh_config or os.environ.get("DZCTL_SSH_CONFIG") or "~/.ssh/config"
    if config.hostname != config.alias:
        return RemoteError(
            f"{config.alias}: the name {config.hostname} (HostName in the SSH config {where}) does not resolve: "
            f"{reason}",
            fix=f"correct HostName for {config.alias} in {where}, or add {config.hostname} to DNS or /etc/hosts",
        )
    return RemoteError(
        f"{config.alias}: the host name {config.alias} (from the hostfile) does not resolve: {reason}",
        fix=(
            f"correct the name on the hostfile's line, give it an address in {where} (Host {config.alias} with "
            f"HostName ADDRESS), or add {config.alias} to DNS or /etc/hosts"
        ),
    )


class HostPool:
    """Connections to a run's hosts: opened on first use, in parallel, one per host.

    A host that cannot be reached is remembered, so every later call for it
    fails at once with the same error instead of waiting out the timeout again.
    """

    def __init__(
        self,
        hosts: Iterable[str],
        ssh_config: str | os.PathLike | None = None,
        trust_new_hosts: bool = False,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        self.hosts = list(dict.fromkeys(hosts))
        self.ssh_config_path = ssh_config
        self._config = load_ssh_config(ssh_config)
        self.trust_new_hosts = trust_new_hosts
        self.connect_timeout = connect_timeout
        self._connections: dict[str, Connection] = {}
        self._failures: dict[str, RemoteError] = {}
        self.connect_seconds: dict[str, float] = {}  # how long each host's connect took (or failed after)
        self._locks = {host: threading.Lock() for host in self.hosts}
        self._closed = False

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resolve(self, host: str) -> HostConfig:
        return resolve_host(host, self._config)

    def connection(self, host: str) -> Connection:
        """The host's connection, opened now if this is its first use; RemoteError if unreachable."""
        lock = self._locks.setdefault(host, threading.Lock())
        with lock:
            if host in self._connections:
                return self._connections[host]
            if host in self._failures:
                raise self._failures[host]
            started = time.monotonic()
            try:
                conn = self._open(host)
            except RemoteError as exc:
                self._failures[host] = exc
                raise
            finally:
                self.connect_seconds[host] = time.monotonic() - started
            self._connections[host] = conn
            return conn

    def _open(self, host: str) -> Connection:
        if host in LOCAL_HOSTS:
            return LocalConnection(host)
        config = self.resolve(host)
        client, jumps = self._dial(config)
        return SSHConnection(config, client, jumps, dial=functools.partial(self._dial, config))

    def _dial(self, config: HostConfig) -> tuple[paramiko.SSHClient, list[paramiko.SSHClient]]:
        """An authenticated client for the host, and the jump hosts' clients its socket runs through."""
        host = config.alias
        jumps: list[paramiko.SSHClient] = []
        sock = None
        try:
            # ProxyJump a,b: connect to a, through a to b, through b to the target.
            for position, hop in enumerate(config.proxy_jump):
                client = self._connect(self._hop_config(hop), sock)
                jumps.append(client)
                following = config.proxy_jump[position + 1 :]
                if following:
                    nxt = self._hop_config(following[0])
                    next_target = (nxt.hostname, nxt.port)
                else:
                    next_target = (config.hostname, config.port)
                sock = client.get_transport().open_channel(
                    "direct-tcpip", next_target, ("127.0.0.1", 0), timeout=self._timeout(config)
                )
            client = self._connect(config, sock)
        except RemoteError:
            for jump in jumps:
                jump.close()
            raise
        except (paramiko.SSHException, OSError) as exc:
            for jump in jumps:
                jump.close()
            raise RemoteError(
                f"{host}: cannot reach it through ProxyJump {','.join(config.proxy_jump)}: {exc}",
                fix="check the jump host's ssh_config entry and that it may forward TCP (AllowTcpForwarding)",
            ) from None
        return client, jumps

    def jump_hosts(self, config: HostConfig) -> tuple[HostConfig, ...]:
        """``config``'s ProxyJump hops, in order, each resolved as ``_dial`` dials it."""
        return tuple(self._hop_config(hop) for hop in config.proxy_jump)

    def _hop_config(self, hop: str) -> HostConfig:
        """A ProxyJump hop (``[user@]host[:port]``), resolved through the same config, without its own jumps."""
        user, name, port = parse_jump(hop)
        resolved = self.resolve(name)
        return dataclasses.replace(resolved, user=user or resolved.user, port=port or resolved.port, proxy_jump=())

    def _timeout(self, config: HostConfig) -> float:
        return min(config.connect_timeout, self.connect_timeout) if config.connect_timeout else self.connect_timeout

    def _connect(self, config: HostConfig, sock) -> paramiko.SSHClient:
        timeout = self._timeout(config)
        client = paramiko.SSHClient()
        for path in config.known_hosts_files:
            if os.path.exists(path):
                try:
                    # Loaded as read-only "system" keys: we never rewrite the
                    # user's file, only append to it (see HostKeyPolicy).
                    client.load_system_host_keys(path)
                except (OSError, paramiko.SSHException) as exc:
                    raise InputError(f"{path}: cannot read known_hosts: {exc}") from None
        # OpenSSH's own rule for a user who chose it: `StrictHostKeyChecking accept-new` in the SSH config
        # records unknown keys as --trust-new-hosts does (`no`/`off` are not honoured: still refused).
        why = (
            "--trust-new-hosts"
            if self.trust_new_hosts
            else f"StrictHostKeyChecking accept-new in {config.alias}'s SSH config"
        )
        client.set_missing_host_key_policy(HostKeyPolicy(config, self.trust_new_hosts or config.accept_new, why))
        keys = [p for p in config.identity_files if os.path.exists(p)]
        started = time.monotonic()
        where = f"{config.user}@{config.hostname}:{config.port}"
        try:
            client.connect(
                config.hostname,
                port=config.port,
                username=config.user,
                key_filename=keys or None,
                # IdentitiesOnly: only the configured keys, as OpenSSH does;
                # otherwise agent keys and ~/.ssh/id_* are tried too.
                allow_agent=not config.identities_only,
                look_for_keys=not keys and not config.identities_only,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                sock=sock,
            )
        except RemoteError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise RemoteError(
                f"{config.alias}: HOST KEY CHANGED for {config.hostname}: known_hosts has "
                f"{exc.expected_key.get_name()} {exc.expected_key.fingerprint}, the host offered "
                f"{exc.key.get_name()} {exc.key.fingerprint}. Refusing to connect: this may be an attack, "
                "or the host was reinstalled",
                fix=(
                    "if the host was reinstalled, confirm the new fingerprint out of band, then remove the old key "
                    f"with `ssh-keygen -R {shlex.quote(config.known_hosts_name)} -f {config.known_hosts_files[0]}`"
                ),
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise RemoteError(
                f"{config.alias}: authentication as {config.user} at {where} failed: {exc}",
                fix="check User and IdentityFile in the SSH config, or load the key into ssh-agent (ssh-add)",
            ) from None
        except socket.gaierror as exc:
            # The name never became an address: no packet left this machine, so sshd and ports are not the question.
            client.close()
            raise unresolved(config, exc.strerror or str(exc), self.ssh_config_path) from None
        except TimeoutError:
            client.close()
            raise RemoteError(
                f"{config.alias}: unreachable: no answer from {where} within {timeout:g} s",
                fix=f"check that {config.hostname} is up and that port {config.port} is open from here",
            ) from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
                # paramiko folds "connection refused" per address into one message; unfold it.
                reason = "; ".join(sorted({e.strerror or str(e) for e in exc.errors.values()}))
            elif isinstance(exc, OSError) and exc.strerror:
                reason = exc.strerror
            else:
                reason = str(exc) or type(exc).__name__
            raise RemoteError(
                f"{config.alias}: unreachable: {where}: {reason} (after {time.monotonic() - started:.1f} s)",
                fix=f"check that sshd runs on {config.hostname} and listens on port {config.port}",
            ) from None
        transport = client.get_transport()
        # Keepalives: a long `logs --follow` or launch must notice a dead peer.
        transport.set_keepalive(30)
        return client

    def connect_all(self) -> GroupResult:
        """Open every host's connection in parallel: ``{host: Connection | RemoteError}``."""
        return self.map(lambda conn: conn)

    def map(self, fn: Callable[[Connection], Any], hosts: Iterable[str] | None = None) -> GroupResult:
        """Call ``fn(connection)`` for each host at once; every outcome is returned as data."""
        chosen = list(hosts) if hosts is not None else self.hosts
        if not chosen:
            return GroupResult()

        def one(host: str) -> Any:
            try:
                return fn(self.connection(host))
            except Exception as exc:  # a host's failure is data for the caller
                if not isinstance(exc, RemoteError | InputError):
                    exc = RemoteError(f"{host}: {type(exc).__name__}: {exc}")
                return exc

        # One thread per host: the work is waiting on the network, not CPU.
        with ThreadPoolExecutor(max_workers=len(chosen), thread_name_prefix="dzctl-ssh") as executor:
            outcomes = list(executor.map(one, chosen))
        return GroupResult(zip(chosen, outcomes, strict=True))

    def run_all(
        self,
        argv: list[str] | Callable[[str], list[str]],
        *,
        timeout: float | None = None,
        hosts: Iterable[str] | None = None,
        **kwargs,
    ) -> GroupResult:
        """Run one command on every host (``argv``, or ``argv(host)`` per host): ``{host: Result | RemoteError}``."""

        def run(conn: Connection) -> Result:
            command = argv(conn.host) if callable(argv) else argv
            return conn.run(command, timeout=timeout, **kwargs)

        return self.map(run, hosts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._connections.values():
            try:
                conn.close()
            except Exception as exc:  # closing must never mask the run's own outcome
                log.debug("closing %s: %s", conn.host, exc)
        self._connections.clear()
