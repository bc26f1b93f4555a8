"""Preflight and uploads on test hosts that lack what some servers lack: the `ip` tool (iproute2), an SFTP subsystem.

The hosts are real (own sshd per network namespace); a host's sessions lose a tool through its sshd's
`SetEnv PATH` (tests/testhosts.py `hidden_tools`), and SFTP by leaving out `Subsystem sftp`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from orchestrator.errors import RemoteError
from orchestrator.preflight import render_report, run_preflight
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job
from orchestrator.transport.pool import HostPool

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


def test_uploads_reach_a_node_whose_sshd_has_no_sftp_subsystem(cluster):
    """Launch ships the job directory with mkdir + put: on a server without `Subsystem sftp` they go
    through exec channels, with the same guarantees (mode set before any byte, whole file by rename)."""
    hosts = cluster(1)
    host = hosts.hosts[0]
    hosts.reconfigure_sshd(host, sftp=False)
    no_sftp = subprocess.run(["sftp", "-F", str(hosts.ssh_config), "-b", "/dev/null", host.name], capture_output=True)
    assert no_sftp.returncode != 0 and b"subsystem request failed" in no_sftp.stderr  # really no SFTP
    base = f"/tmp/dzctl-nosftp-{uuid.uuid4().hex}"
    local = hosts.workdir / "payload.bin"
    local.write_bytes(os.urandom(3_000_000))
    try:
        with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
            conn = pool.connection(host.name)
            conn.mkdir(f"{base}/jobs/j1")
            conn.mkdir(f"{base}/jobs/j1")  # idempotent, like mkdir -p
            conn.put(b"HF_TOKEN=abc\n", f"{base}/jobs/j1/env", mode=0o600)
            conn.put(local, f"{base}/jobs/j1/payload.bin")
            stat = conn.run(["stat", "-c", "%a %s", f"{base}/jobs/j1/env", f"{base}/jobs/j1/payload.bin"], check=True)
            listing = conn.run(["ls", "-A", f"{base}/jobs/j1"], check=True).stdout.split()
            with pytest.raises(RemoteError, match=r"upload to .* failed"):
                conn.put(b"x", f"{base}/missing-dir/file")
        assert stat.stdout.split("\n")[:2] == ["600 13", "644 3000000"]
        assert (
            hashlib.sha256(Path(f"{base}/jobs/j1/payload.bin").read_bytes()).digest()
            == hashlib.sha256(local.read_bytes()).digest()
        )
        assert sorted(listing) == ["env", "payload.bin"]  # no temp files left
    finally:
        subprocess.run(["rm", "-rf", base], check=False)


def test_preflight_checks_each_node_can_receive_files_the_way_launch_sends_them(cluster, tmp_path):
    """Node 1's sshd has no SFTP: preflight's upload check passes there through exec channels and says so.
    A remote dir that cannot be made (its parent is a file) fails the check on every node, naming it."""
    hosts = cluster(2)
    hosts.reconfigure_sshd(hosts.hosts[1], sftp=False)
    report = _preflight(hosts, tmp_path, sys.executable, 29563)
    assert report.ok, render_report(report)
    first, second = (report.host(h.name).check("upload") for h in hosts.hosts)
    assert first.status == second.status == "ok"
    assert "over SFTP" in first.detail and "no SFTP subsystem" in second.detail

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
    job = load_job(CPU_JOB, [f"launch.python={sys.executable}", "launch.master_port=29564",
                             f"launch.remote_dir={blocker}/{{host}}"], "process")  # fmt: skip
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        blocked = run_preflight(job, nodes, pool)
    for host in hosts.hosts:
        upload = blocked.host(host.name).check("upload")
        assert upload.status == "fail" and f"{blocker}/{host.name}" in upload.detail, render_report(blocked)
        assert "launch.remote_dir" in upload.fix
