"""Image streams through the system's OpenSSH client (orchestrator/transport/openssh.py), against real sshd."""

from __future__ import annotations

import shlex
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
        connect_timeout=7.5,
    )
    argv = client_argv(config, "/etc/dz/ssh_config")
    assert argv[:3] == ["ssh", "-F", "/etc/dz/ssh_config"]
    assert argv[-3:] == ["-T", "--", "gpu7"]  # the alias, so the config's other Host lines still apply
    got = options(argv)
    assert got["HostName"] == "10.1.2.7" and got["Port"] == "2222" and got["User"] == "trainer"
    assert got["UserKnownHostsFile"] == "/kh/one /kh/two"
    assert got["BatchMode"] == "yes" and got["StrictHostKeyChecking"] == "yes"
    assert got["IdentitiesOnly"] == "yes" and "ProxyJump" not in got and "ProxyCommand" not in got
    assert got["ConnectTimeout"] == "7" and got["Compression"] == "no" and got["ControlMaster"] == "no"
    assert [argv[i + 1] for i, word in enumerate(argv) if word == "-i"] == ["/keys/a", "/keys/b"]
    plain = client_argv(HostConfig(alias="n", hostname="n"), None)
    assert "-F" not in plain and "ConnectTimeout" not in options(plain)


def test_every_jump_host_gets_the_same_safety_options():
    bastion = HostConfig(alias="bastion", hostname="192.0.2.1", user="ops", known_hosts_files=("/kh/100%",))
    edge = HostConfig(alias="edge", hostname="fd00::5", port=2200, known_hosts_files=("/kh/edge",))
    target = HostConfig(alias="gpu7", hostname="10.1.2.7", port=2222, proxy_jump=("bastion", "ops@edge:2200"))
    argv = client_argv(target, "/etc/dz/ssh_config", (bastion, edge))
    assert "ProxyJump" not in options(argv)
    # ssh expands %-tokens once per level: undo that as ssh would, then read the command as a shell would.
    via_edge = shlex.split(options(argv)["ProxyCommand"].replace("%%", "%"))
    assert via_edge[:3] == ["ssh", "-F", "/etc/dz/ssh_config"]
    assert via_edge[-4:] == ["-W", "10.1.2.7:2222", "--", "edge"]
    edge_options = options(via_edge)
    assert edge_options["BatchMode"] == "yes" and edge_options["StrictHostKeyChecking"] == "yes"
    assert edge_options["UserKnownHostsFile"] == "/kh/edge" and edge_options["HostName"] == "fd00::5"
    via_bastion = shlex.split(edge_options["ProxyCommand"].replace("%%", "%"))
    assert via_bastion[-4:] == ["-W", "[fd00::5]:2200", "--", "bastion"]
    bastion_options = options(via_bastion)
    assert bastion_options["BatchMode"] == "yes" and bastion_options["StrictHostKeyChecking"] == "yes"
    assert bastion_options["UserKnownHostsFile"] == "/kh/100%" and bastion_options["User"] == "ops"
    assert bastion_options["ProxyCommand"] == "none"  # the first hop is dialled directly, as the pool does
    with pytest.raises(ValueError, match="2 hop"):
        client_argv(target, None)


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


@pytest.mark.integration
def test_jump_hosts_are_held_to_the_same_host_key_rules(cluster):
    hosts = cluster(3)
    jump, near, far = hosts.hosts  # node1 is reached through node0, node2 through node0 then node1
    blocks = hosts.ssh_config.read_text().split("\n\n")
    # The jump host's own block would let OpenSSH learn any key (a user's laxer setting): dzctl's
    # hops must not. The first block is node0's.
    blocks[0] = blocks[0].replace("StrictHostKeyChecking yes", "StrictHostKeyChecking no")
    blocks[1] += f"\n  ProxyJump {jump.name}"
    blocks[2] += f"\n  ProxyJump {jump.name},{near.name}"
    hosts.ssh_config.write_text("\n\n".join(blocks))
    hosts.write_known_hosts([near, far])  # the jump host's key is unknown
    before = hosts.known_hosts.read_text()
    with HostPool([near.name, far.name], ssh_config=hosts.ssh_config) as pool:
        # Built here rather than by stream_links, whose paramiko connection would refuse the hop first:
        # what is tested is OpenSSH's own hop.
        links = {}
        for host in (near, far):
            config = pool.resolve(host.name)
            links[host.name] = OpenSSHLink(host.name, client_argv(config, hosts.ssh_config, pool.jump_hosts(config)))
        for name, link in links.items():
            refused = link.run(["true"], timeout=60)
            assert refused.exit_code == NO_EXIT_STATUS, (name, refused)
            assert "Host key verification failed" in refused.stderr, (name, refused.stderr)
        assert hosts.known_hosts.read_text() == before, "a jump host's key was recorded"

        hosts.write_known_hosts()  # now every key is known
        came_from = {name: link.run(["sh", "-c", "echo $SSH_CONNECTION"], check=True).stdout.split()[0]
                     for name, link in links.items()}  # fmt: skip
        assert came_from == {near.name: jump.address, far.name: near.address}
        _, kinds, notes = stream_links(pool, [near.name, far.name], "openssh")
        assert kinds == {near.name: "openssh", far.name: "openssh"} and notes == []
