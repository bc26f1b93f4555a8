"""Host-key policy: an unknown host is refused unless trusted by flag or config; a changed key always is.

A changed key is the one case where going on could hand a secret to someone else, so no option
accepts it. An unknown one is recorded in the user's known_hosts (as OpenSSH's ``accept-new``
does) only under ``--trust-new-hosts`` or the host's own ``StrictHostKeyChecking accept-new``.
"""

from __future__ import annotations

import logging
import shlex
import threading
from pathlib import Path

import paramiko

from ..errors import RemoteError
from .sshconfig import HostConfig

log = logging.getLogger(__name__)


_known_hosts_lock = threading.Lock()


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for a host absent from known_hosts.

    (A known host whose key differs never reaches here: paramiko raises
    BadHostKeyException, which we always turn into a refusal.)
    """

    def __init__(self, host: HostConfig, trust_new: bool, why: str = "--trust-new-hosts") -> None:
        self.host = host
        self.trust_new = trust_new
        self.why = why  # what allowed it: the flag, or the user's own SSH config (accept-new)

    def missing_host_key(self, client, hostname, key) -> None:
        fingerprint = key.fingerprint  # "SHA256:..." like ssh-keygen -l
        target = self.host.known_hosts_files[0]
        if not self.trust_new:
            keyscan = ["ssh-keyscan"] + (["-p", str(self.host.port)] if self.host.port != 22 else [])
            raise RemoteError(
                f"{self.host.alias}: host key of {hostname} is not in known_hosts "
                f"({', '.join(self.host.known_hosts_files)}); its {key.get_name()} key is {fingerprint}",
                fix=(
                    f"if that fingerprint is right, rerun with --trust-new-hosts, or add it with "
                    f"`{shlex.join([*keyscan, self.host.hostname])} >> {target}`"
                ),
            )
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with path.open("a") as handle:
                handle.write(line)
        # Accepted keys are logged: trusting a key is a decision worth a trace.
        log.warning("trusted new host key for %s (%s): %s %s, recorded in %s (because of %s)", self.host.alias,
                    hostname, key.get_name(), fingerprint, target, self.why)  # fmt: skip
        client.get_host_keys().add(hostname, key.get_name(), key)
