"""`StrictHostKeyChecking` in the user's SSH config, against a real sshd: `accept-new` records an
unknown host's key without --trust-new-hosts (OpenSSH's rule for a user who chose it), and says why;
`no` is not honoured; a changed key is refused whatever the config says."""

from __future__ import annotations

import logging

import pytest

from orchestrator.errors import RemoteError
from orchestrator.transport.pool import HostPool

pytestmark = pytest.mark.integration


def _config_with(hosts, tmp_path, value: str):
    text = hosts.ssh_config.read_text().replace("StrictHostKeyChecking yes", f"StrictHostKeyChecking {value}")
    assert f"StrictHostKeyChecking {value}" in text
    path = tmp_path / f"ssh_config_{value}"
    path.write_text(text)
    return path


def test_accept_new_in_the_ssh_config_trusts_unknown_keys_and_says_why(cluster, tmp_path, caplog):
    hosts = cluster(1)
    host = hosts.hosts[0]
    hosts.known_hosts.write_text("")
    config = _config_with(hosts, tmp_path, "accept-new")
    # No trust_new_hosts:
    with caplog.at_level(logging.WARNING, logger="orchestrator.ssh"), HostPool([host.name], ssh_config=config) as pool:
        assert pool.run_all(["true"]).ok
    assert hosts.known_hosts.read_text().splitlines() == [hosts.known_hosts_line(host)]
    trusted = [r.getMessage() for r in caplog.records if "trusted new host key" in r.getMessage()]
    assert len(trusted) == 1 and f"StrictHostKeyChecking accept-new in {host.name}'s SSH config" in trusted[0]
    # accept-new is for new hosts only: a changed key is still refused.
    hosts.rotate_host_key(host)
    with HostPool([host.name], ssh_config=config) as pool:
        outcome = pool.run_all(["true"])[host.name]
    assert isinstance(outcome, RemoteError) and "HOST KEY CHANGED" in str(outcome)


def test_strict_host_key_checking_no_is_not_honoured(cluster, tmp_path):
    hosts = cluster(1)
    hosts.known_hosts.write_text("")
    with HostPool([hosts.hosts[0].name], ssh_config=_config_with(hosts, tmp_path, "no")) as pool:
        outcome = pool.run_all(["true"])[hosts.hosts[0].name]
    assert isinstance(outcome, RemoteError) and "not in known_hosts" in str(outcome)
    assert hosts.known_hosts.read_text() == ""
