"""How a host name becomes what to dial: the OpenSSH client config, resolved as ``ssh`` would.

``HostName``, ``User``, ``Port``, ``IdentityFile``, ``IdentitiesOnly``, ``UserKnownHostsFile``,
``ProxyJump``, ``ConnectTimeout`` and ``StrictHostKeyChecking accept-new`` are read; the rest of
the file is left to the OpenSSH client, which dzctl points at the same resolved values.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from ..errors import InputError

# A node that does not answer the TCP handshake in 10 s is down or firewalled
# for our purposes; waiting longer only delays the report for all hosts.
DEFAULT_CONNECT_TIMEOUT = 10.0


DEFAULT_SSH_CONFIG = "~/.ssh/config"


DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


@dataclass(frozen=True)
class HostConfig:
    """A host as the OpenSSH client config resolves it."""

    alias: str
    hostname: str
    port: int = 22
    user: str = field(default_factory=getpass.getuser)
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[str, ...] = ()
    proxy_jump: tuple[str, ...] = ()
    connect_timeout: float | None = None
    accept_new: bool = False  # StrictHostKeyChecking accept-new

    @property
    def known_hosts_name(self) -> str:
        """The name known_hosts lists this host under (OpenSSH's convention)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def load_ssh_config(path: str | os.PathLike | None) -> paramiko.SSHConfig:
    """Parse an OpenSSH client config; None means ``~/.ssh/config`` if it exists."""
    explicit = path is not None
    target = Path(os.path.expanduser(str(path if explicit else DEFAULT_SSH_CONFIG)))
    if not target.exists():
        if explicit:
            raise InputError(
                f"SSH config not found: {target}",
                fix="pass an existing file to --ssh-config (or unset DZCTL_SSH_CONFIG)",
            )
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(target))
    except (paramiko.ConfigParseError, OSError, ValueError) as exc:
        raise InputError(f"{target}: cannot parse SSH config: {exc}", fix="fix the line named above") from None


def resolve_host(alias: str, config: paramiko.SSHConfig) -> HostConfig:
    """Apply the config's ``Host`` blocks to one name from the hostfile."""
    entry = config.lookup(alias)
    if "proxycommand" in entry and entry["proxycommand"].lower() != "none":
        raise InputError(
            f"SSH config for {alias}: ProxyCommand is not supported by dzctl",
            fix="use ProxyJump instead (dzctl follows ProxyJump chains itself)",
        )
    try:
        port = int(entry.get("port", 22))
    except ValueError:
        raise InputError(f"SSH config for {alias}: Port {entry.get('port')!r} is not a number") from None
    known = entry.get("userknownhostsfile")
    known_files = tuple(os.path.expanduser(p) for p in (known.split() if known else [DEFAULT_KNOWN_HOSTS]))
    jump = entry.get("proxyjump", "")
    jumps = () if not jump or jump.lower() == "none" else tuple(j.strip() for j in jump.split(",") if j.strip())
    timeout = entry.get("connecttimeout")
    return HostConfig(
        alias=alias,
        hostname=entry.get("hostname", alias),
        port=port,
        user=entry.get("user") or getpass.getuser(),
        identity_files=tuple(os.path.expanduser(p) for p in entry.get("identityfile", [])),
        identities_only=entry.get("identitiesonly", "no").lower() == "yes",
        known_hosts_files=known_files,
        proxy_jump=jumps,
        connect_timeout=float(timeout) if timeout else None,
        accept_new=entry.get("stricthostkeychecking", "").lower() == "accept-new",
    )


def parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (ProxyJump's syntax) → (user, host, port)."""
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):  # [ipv6]:port
        host, _, tail = rest[1:].partition("]")
        port = int(tail[1:]) if tail.startswith(":") else None
    elif rest.count(":") == 1:
        host, port_text = rest.split(":")
        port = int(port_text)
    return user or None, host, port
