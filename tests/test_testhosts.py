"""The test-host machinery itself: real namespaces, sshd and dockerd, torn down after."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _ssh(cluster, host, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(cluster.ssh_argv(host, [command]), capture_output=True, text=True, timeout=30)


def test_hosts_have_own_hostname_address_and_key(cluster):
    hosts = cluster(3)
    seen = set()
    for host in hosts.hosts:
        out = _ssh(hosts, host, "hostname; ip -4 -o addr show eth0")
        assert out.returncode == 0, out.stderr
        name, addr_line = out.stdout.splitlines()
        assert name == host.name
        assert f"inet {host.address}/24" in addr_line
        seen.add(host.host_key_line)
    assert len(seen) == 3  # a host key each, so a changed key can be tested per host


def test_two_clusters_side_by_side_do_not_collide(cluster):
    first, second = cluster(2), cluster(2)
    assert first.network != second.network and not first.network.overlaps(second.network)
    assert {h.netns for h in first.hosts}.isdisjoint(h.netns for h in second.hosts)
    # Same alias "node0" in both, but each ssh_config leads to its own host.
    a = _ssh(first, first.hosts[0], "ip -4 -o addr show eth0").stdout
    b = _ssh(second, second.hosts[0], "ip -4 -o addr show eth0").stdout
    assert first.hosts[0].address in a and second.hosts[0].address in b


def test_stop_and_start_sshd(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    hosts.stop_sshd(host)
    refused = _ssh(hosts, host, "true")
    assert "Connection refused" in refused.stderr, refused
    hosts.start_sshd(host)
    back = _ssh(hosts, host, "hostname")
    assert back.stdout.strip() == host.name, back


def test_teardown_removes_namespaces_links_and_processes(tmp_path):
    from conftest import require_test_hosts
    from testhosts import TestCluster

    require_test_hosts()
    with TestCluster(2, workdir=tmp_path) as hosts:
        pids = [h.sshd_pid for h in hosts.hosts]
        netns = [h.netns for h in hosts.hosts]
        bridge = hosts.bridge
        hosts.run_in(hosts.hosts[0], ["true"])
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in netns)
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_teardown_runs_when_the_body_fails(tmp_path):
    from conftest import require_test_hosts
    from testhosts import TestCluster

    require_test_hosts()
    with pytest.raises(RuntimeError), TestCluster(1, workdir=tmp_path) as hosts:
        netns = hosts.hosts[0].netns
        raise RuntimeError("test body failed")
    assert netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_docker_hosts_answer_from_root_namespace_and_over_ssh(cluster):
    hosts = cluster(2, docker=True)
    for host in hosts.hosts:
        local = subprocess.run(
            ["docker", "-H", host.docker_host, "info", "--format", "{{.Name}} {{.DockerRootDir}}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert local.returncode == 0, local.stderr
        assert local.stdout.split() == [host.name, str(host.dir / "docker-data")]
        remote = _ssh(hosts, host, "docker info --format '{{.Name}}'")
        assert remote.returncode == 0, remote.stderr
        assert remote.stdout.strip() == host.name


def test_clusters_of_killed_test_runs_are_swept(tmp_path):
    import signal
    import sys
    import time

    from conftest import require_test_hosts
    from testhosts import RUN_ROOT, TestCluster, sweep_stale_clusters

    require_test_hosts()
    # A test process that builds a cluster and is then SIGKILLed: its finalizers never run.
    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from testhosts import TestCluster; "
        "c = TestCluster(2, workdir=sys.argv[2]); c.start(); print(c.cid, c.hosts[0].sshd_pid, flush=True); "
        "time.sleep(120)"
    )
    victim = subprocess.Popen(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "victim")],
        stdout=subprocess.PIPE,
        text=True,
    )
    cid, sshd_pid = victim.stdout.readline().split()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert (RUN_ROOT / cid).exists() and f"dzt-{cid}-0" in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True
    ).stdout
    # A live cluster next to it must survive the sweep.
    with TestCluster(1, workdir=tmp_path / "live") as live:
        assert cid in sweep_stale_clusters() or not (RUN_ROOT / cid).exists()  # swept by start() or now
        assert (RUN_ROOT / live.cid).exists()
        assert live.run_in(live.hosts[0], ["true"]).returncode == 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dzt-{cid}-" not in listed
    assert subprocess.run(["ip", "link", "show", f"dzb{cid}"], capture_output=True).returncode != 0
    time.sleep(0.2)
    assert not Path(f"/proc/{sshd_pid}").exists() or "Z" in Path(f"/proc/{sshd_pid}/stat").read_text().split()[2]


def test_reset_removes_what_a_test_left_running_and_keeps_the_hosts_up(shared_docker_hosts, cpu_image_tag):
    """The shared hosts are reset after each test: a job left running by one test is gone before the next."""
    import time

    hosts = shared_docker_hosts
    node0, node1, node2 = hosts.hosts
    # What a test could leave behind: a detached process over SSH (as the process runtime's supervisor is),
    # a running container (as the docker runtime's rank is), and a firewall rule.
    started = _ssh(hosts, node0, "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!")
    assert started.returncode == 0, started.stderr
    left_pid = int(started.stdout.strip())
    hosts.run_in(node1, ["docker", "run", "--detach", "--network", "host", "--name", "left-behind",
                         cpu_image_tag, "sleep", "600"])  # fmt: skip
    hosts.run_in(node1, ["iptables", "-A", "INPUT", "-s", node0.address, "-j", "DROP"])
    hosts.stop_sshd(node2)  # a node lost for good, as test_recovery leaves its spare's neighbour
    assert _ssh(hosts, node2, "hostname").returncode != 0

    removed = hosts.reset()

    assert f"node0: pid {left_pid} (sleep)" in removed, removed
    assert any(line.startswith("node1: container ") for line in removed), removed
    deadline = time.monotonic() + 10
    while Path(f"/proc/{left_pid}").exists() and time.monotonic() < deadline:  # SIGKILLed: reaped by init
        time.sleep(0.1)
    assert not Path(f"/proc/{left_pid}").exists()
    assert hosts.run_in(node1, ["docker", "ps", "--all", "--quiet"]).stdout.strip() == ""
    assert "DROP" not in hosts.run_in(node1, ["iptables", "-S"]).stdout
    # The hosts themselves are as before: sshd answers, dockerd answers and still holds the image.
    assert _ssh(hosts, node1, "hostname").stdout.strip() == "node1"
    assert "node2: sshd was stopped (started again, same host key)" in removed, removed
    assert _ssh(hosts, node2, "hostname").stdout.strip() == "node2"  # known_hosts still holds its key
    inspect = hosts.run_in(node1, ["docker", "image", "inspect", cpu_image_tag], check=False)
    assert inspect.returncode == 0, inspect.stderr
    assert hosts.reset() == []  # nothing left: a second reset finds nothing to remove


def test_a_view_of_the_first_hosts_names_only_them_and_shares_the_rest(shared_docker_hosts, tmp_path):
    """docker_pair's two hosts: hostfiles and resets see two, on the same network, keys and daemons."""
    whole = shared_docker_hosts
    pair = whole.first(2)
    assert [h.name for h in pair.hosts] == ["node0", "node1"] and len(whole.hosts) == 3
    assert pair.write_hostfile(tmp_path / "h.txt").read_text() == "node0 slots=1\nnode1 slots=1\n"
    assert pair.ssh_config == whole.ssh_config and pair.keep is whole.keep and pair.hosts[0] is whole.hosts[0]
    assert _ssh(pair, pair.hosts[1], "hostname").stdout.strip() == "node1"
