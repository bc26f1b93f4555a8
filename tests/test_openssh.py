"""Image streams through the system's OpenSSH client (orchestrator/transport/openssh.py), against real sshd."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.errors import InputError
from orchestrator.transport.openssh import OpenSSHLink, client_argv, stream_links
from orchestrator.transport.pool import HostPool
from orchestrator.transport.results import NO_EXIT_STATUS
from orchestrator.transport.sshconfig import HostConfig


def options(argv: list[str]) -> dict[str, str]:
    pairs = [argv[i + 1] for i, word in enumerate(argv) if word == "-o"]
    return dict(pair.split("=", 1) for pair in pairs)


def test_client_argv_points_ssh_at_what_the_pool_resolved():
    config = HostConfig(
        alias="gpu7",
        hostname="10.1.2.7",
        port=2222,
        user="trainer",
        identity_files=("/keys/a", "/keys/b"),
        identities_only=True,
        known_hosts_files=("/kh/one", "/kh/two"),
        proxy_jump=("bastion", "edge:2200"),
        connect_timeout=7.5,
    )
    argv = client_argv(config, "/etc/dz/ssh_config")
    assert argv[:3] == ["ssh", "-F", "/etc/dz/ssh_config"]
    assert argv[-3:] == ["-T", "--", "gpu7"]  # the alias, so the config's other Host lines still apply
    got = options(argv)
    assert got["HostName"] == "10.1.2.7" and got["Port"] == "2222" and got["User"] == "trainer"
    assert got["UserKnownHostsFile"] == "/kh/one /kh/two"
    assert got["BatchMode"] == "yes" and got["StrictHostKeyChecking"] == "yes"
    assert got["IdentitiesOnly"] == "yes" and got["ProxyJump"] == "bastion,edge:2200"
    assert got["ConnectTimeout"] == "7" and got["Compression"] == "no" and got["ControlMaster"] == "no"
    assert [argv[i + 1] for i, word in enumerate(argv) if word == "-i"] == ["/keys/a", "/keys/b"]
    plain = client_argv(HostConfig(alias="n", hostname="n"), None)
    assert "-F" not in plain and "ProxyJump" not in options(plain) and "ConnectTimeout" not in options(plain)


@pytest.mark.integration
def test_openssh_links_carry_stdin_and_the_exit_code(cluster):
    hosts = cluster(2)
    names = [h.name for h in hosts.hosts]
    data = bytes(range(256)) * 40_000  # 10 MB
    with HostPool(names, ssh_config=hosts.ssh_config) as pool:
        links, kinds, notes = stream_links(pool, names, "openssh")
        assert kinds == {"node0": "openssh", "node1": "openssh"} and notes == []
        counted = links["node1"].run(["sh", "-c", "wc -c; echo to-stderr >&2"], stdin=data)
        assert counted.ok and counted.stdout.strip() == str(len(data)) and counted.stderr.strip() == "to-stderr"
        assert links["node0"].run(["sh", "-c", "exit 3"]).exit_code == 3
        assert links["node0"].run(["hostname"]).stdout.strip() == "node0"


@pytest.mark.integration
def test_auto_keeps_paramiko_for_a_node_openssh_cannot_reach_and_openssh_refuses(cluster):
    hosts = cluster(2)
    names = [h.name for h in hosts.hosts]
    # An option only the OpenSSH client honours (paramiko's config reading ignores it): a key
    # exchange this sshd does not offer. What a site's client-only hardening looks like.
    with hosts.ssh_config.open("a") as config:
        config.write("\nHost node1\n  KexAlgorithms diffie-hellman-group1-sha1\n")
    with HostPool(names, ssh_config=hosts.ssh_config) as pool:
        links, kinds, notes = stream_links(pool, names, "auto")
        assert kinds == {"node0": "openssh", "node1": "paramiko"}
        assert list(links) == ["node0"]
        assert len(notes) == 1 and notes[0].startswith("node1: the OpenSSH client could not connect (")
        with pytest.raises(InputError, match=r"cannot reach 1 node\(s\):\nnode1: "):
            stream_links(pool, names, "openssh")
        assert stream_links(pool, names, "paramiko") == ({}, {"node0": "paramiko", "node1": "paramiko"}, [])


@pytest.mark.integration
def test_without_an_ssh_binary_auto_says_so_and_openssh_refuses(cluster, tmp_path, monkeypatch):
    hosts = cluster(1)
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        pool.connection("node0")
        monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no ssh here
        links, kinds, notes = stream_links(pool, ["node0", "localhost"], "auto")
        assert links == {} and kinds == {"node0": "paramiko", "localhost": "local"}
        assert notes == ["no OpenSSH client (`ssh`) here: the streams go through paramiko, which costs more CPU"]
        with pytest.raises(InputError, match="no OpenSSH client"):
            stream_links(pool, ["node0"], "openssh")


@pytest.mark.integration
def test_closing_a_link_ends_its_running_stream(cluster):
    hosts = cluster(1)
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        links, _, _ = stream_links(pool, ["node0"], "openssh")
    link: OpenSSHLink = links["node0"]
    ended: list = []
    runner = threading.Thread(target=lambda: ended.append(link.run(["sleep", "120"])))
    started = time.monotonic()
    runner.start()
    time.sleep(1.0)
    link.close()  # what distribute does to a node that stopped taking data
    runner.join(timeout=20)
    assert not runner.is_alive(), "close() did not end the running ssh"
    assert time.monotonic() - started < 20
    assert ended[0].exit_code == -9  # killed: the local ssh client's signal, not the remote command's


@pytest.mark.integration
def test_a_link_whose_connection_dies_reports_no_exit_status_and_is_not_connected(cluster):
    hosts = cluster(1)
    node = hosts.hosts[0]
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        links, _, _ = stream_links(pool, ["node0"], "openssh")
    link = links["node0"]
    ended: list = []
    running = threading.Event()
    command = ["sh", "-c", "echo running; sleep 120"]
    runner = threading.Thread(target=lambda: ended.append(link.run(command, on_stdout=lambda _: running.set())))
    runner.start()
    assert running.wait(15), "the command never started"
    assert hosts.drop_connections(node), "no sshd served the stream"
    runner.join(timeout=20)
    assert ended and ended[0].exit_code == NO_EXIT_STATUS
    assert not link.connected


def test_the_marker_filter_drops_only_a_marker_that_ends_the_output():
    from orchestrator.transport.openssh import _MarkerFilter

    marker = b"MARK-1234\n"
    streamed: list[bytes] = []
    ended = _MarkerFilter(marker, streamed.append)
    for chunk in (b"last words\nMA", b"RK-12", b"34\n"):  # the marker split across chunks
        ended(chunk)
    assert ended.finish() and b"".join(streamed) == b"last words\n"
    kept = _MarkerFilter(marker, None)
    for chunk in (b"MARK-1234\n", b"more after it\n", b"MARK"):  # not at the end: the command's own bytes
        kept(chunk)
    assert not kept.finish() and kept.text == "MARK-1234\nmore after it\nMARK"


@pytest.mark.integration
def test_a_command_that_exits_255_is_its_result_and_the_link_stays_usable(cluster):
    hosts = cluster(1)
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        links, _, _ = stream_links(pool, ["node0"], "openssh")
    link = links["node0"]
    result = link.run(["sh", "-c", "echo partial >&2; exit 255"])
    assert result.exit_code == 255 and result.stderr == "partial\n"  # the wrapper's marker is not shown
    assert link.connected
    streamed: list[bytes] = []
    assert link.run(["sh", "-c", "printf oops >&2; exit 255"], on_stderr=streamed.append).exit_code == 255
    assert b"".join(streamed) == b"oops"
    assert link.run(["sh", "-c", "exit 254"]).exit_code == 254
    assert link.run(["hostname"]).stdout.strip() == "node0" and link.connected


@pytest.mark.integration
def test_a_stopped_sshd_is_a_lost_link_not_a_command_result(cluster):
    hosts = cluster(1)
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        links, _, _ = stream_links(pool, ["node0"], "openssh")
    link = links["node0"]
    hosts.stop_sshd(hosts.hosts[0])  # the client itself fails: ssh exits 255 with no marker
    result = link.run(["sh", "-c", "exit 0"], timeout=30)
    assert result.exit_code == NO_EXIT_STATUS and not link.connected
