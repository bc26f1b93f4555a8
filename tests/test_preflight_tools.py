"""Preflight on test hosts that lack what some servers lack: the `ip` tool (iproute2), an SFTP subsystem.

The hosts are real (own sshd per network namespace); a host's sessions lose a tool through its sshd's
`SetEnv PATH` (tests/testhosts.py `hidden_tools`), and SFTP by leaving out `Subsystem sftp`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.hostfile import load_nodes
from orchestrator.preflight import render_report, run_preflight
from orchestrator.spec import load_job
from orchestrator.ssh import HostPool

pytestmark = pytest.mark.integration
CPU_JOB = Path(__file__).resolve().parents[1] / "jobs" / "tiny-cpu.yaml"


def _preflight(hosts, tmp_path, python: str, port: int):
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=1)
    nodes = load_nodes(hostfile)
    job = load_job(CPU_JOB, [f"launch.python={python}", f"launch.master_port={port}"], "process")
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        return run_preflight(job, nodes, pool)


def test_nodes_without_ip_still_get_master_address_routes_and_interfaces(cluster, tmp_path):
    """As on the H200 node without iproute2: the node's Python finds addresses and routes instead."""
    hosts = cluster(2)
    for host in hosts.hosts:
        hosts.reconfigure_sshd(host, hidden_tools=("ip",))
    report = _preflight(hosts, tmp_path, sys.executable, 29561)
    assert report.ok, render_report(report)
    assert report.master_addr == hosts.hosts[0].address
    assert report.interfaces == {h.name: "eth0" for h in hosts.hosts}
    worker = report.host(hosts.hosts[1].name).check("route")
    assert worker.detail.startswith(f"reaches master {hosts.hosts[0].address} via eth0 (src {hosts.hosts[1].address})")


def test_a_node_without_ip_or_python_names_the_tools_and_their_packages(cluster, tmp_path):
    hosts = cluster(2)
    hosts.reconfigure_sshd(hosts.hosts[1], hidden_tools=("ip", "python3"))
    report = _preflight(hosts, tmp_path, "python3", 29562)
    route = report.host(hosts.hosts[1].name).check("route")
    assert route.status == "fail", render_report(report)
    assert "no `ip`" in route.detail
    assert "iproute2" in route.fix and "apt-get install iproute2" in route.fix and "dnf install iproute" in route.fix
    assert report.host(hosts.hosts[0].name).check("route").status == "ok"
