"""The SSH layer against real sshd test hosts (and locally for localhost)."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.errors import InputError, RemoteError
from orchestrator.transport.connection import command_line
from orchestrator.transport.local import LocalConnection, run_concurrently
from orchestrator.transport.pool import HostPool
from orchestrator.transport.results import GroupResult, Result
from orchestrator.transport.sshconfig import load_ssh_config, parse_jump, resolve_host

NASTY = [
    "$(touch {marker})",
    "`touch {marker}`",
    "; touch {marker}",
    "a\ntouch {marker}",
    "'\"; touch {marker}; echo '",
    "&& touch {marker} || true",
    "> {marker}",
    "*",
    "",
    "-n",
]


# -- pure ---------------------------------------------------------------------
def test_command_line_quotes_every_word():
    assert command_line(["echo", "a b", "$(x)"]) == "echo 'a b' '$(x)'"
    assert command_line(["true"], env={"A": "x y"}) == "env 'A=x y' true"
    with pytest.raises(ValueError):
        command_line([])


def test_parse_jump():
    assert parse_jump("gw") == (None, "gw", None)
    assert parse_jump("ops@gw:2222") == ("ops", "gw", 2222)
    assert parse_jump("[fe80::1]:22") == (None, "fe80::1", 22)


def test_resolve_host_reads_openssh_config(tmp_path):
    config = tmp_path / "config"
    config.write_text(
        "Host gpu-*\n  User ops\n  Port 2222\n  IdentityFile ~/.ssh/gpu_key\n  IdentitiesOnly yes\n"
        "  UserKnownHostsFile /etc/a /etc/b\n  ProxyJump bastion,ops@gw:2200\n  ConnectTimeout 4\n"
        "Host gpu-1\n  HostName 10.0.0.11\n"
        "Host *\n  StrictHostKeyChecking accept-new\n"
    )
    host = resolve_host("gpu-1", load_ssh_config(config))
    assert host.hostname == "10.0.0.11" and host.user == "ops" and host.port == 2222
    assert host.identity_files == (os.path.expanduser("~/.ssh/gpu_key"),)
    assert host.identities_only and host.accept_new
    assert host.known_hosts_files == ("/etc/a", "/etc/b")
    assert host.proxy_jump == ("bastion", "ops@gw:2200")
    assert host.connect_timeout == 4.0
    assert host.known_hosts_name == "[10.0.0.11]:2222"
    plain = resolve_host("other", load_ssh_config(config))
    assert plain.hostname == "other" and plain.port == 22 and plain.proxy_jump == ()


def test_missing_explicit_config_and_proxycommand_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="SSH config not found"):
        HostPool(["x"], ssh_config=tmp_path / "nope")
    config = tmp_path / "config"
    config.write_text("Host x\n  ProxyCommand nc %h %p\n")
    with pytest.raises(InputError, match="ProxyCommand is not supported") as info:
        resolve_host("x", load_ssh_config(config))
    assert "ProxyJump" in info.value.fix


def test_group_result_keeps_successes_beside_failures():
    ok = Result("a", ("true",), 0, "", "", 0.1)
    bad = Result("b", ("false",), 1, "", "boom", 0.1)
    group = GroupResult(a=ok, b=bad, c=RemoteError("c: unreachable", fix="start sshd"))
    assert set(group.succeeded) == {"a", "b"} and set(group.failed) == {"c"}
    assert not group.ok
    with pytest.raises(RemoteError) as info:
        group.raise_on_failure()
    assert "b: `false` exited 1: boom" in str(info.value) and "c: unreachable" in str(info.value)
    assert info.value.fix == "start sshd"


# -- local --------------------------------------------------------------------
def test_localhost_runs_without_ssh(tmp_path):
    with HostPool(["localhost", "127.0.0.1"]) as pool:
        outcomes = pool.run_all(["sh", "-c", "echo $$; cat"], stdin=b"in")
        assert all(isinstance(pool.connection(h), LocalConnection) for h in pool.hosts)
    assert all(r.ok and r.stdout.endswith("in") for r in outcomes.values())
    conn = LocalConnection()
    conn.mkdir(str(tmp_path / "a" / "b"))
    conn.put(b"SECRET=1\n", str(tmp_path / "a" / "b" / "env"), mode=0o600)
    assert (tmp_path / "a/b/env").stat().st_mode & 0o777 == 0o600
    assert conn.run(["no-such-command-dz"]).exit_code == 127
    with pytest.raises(RemoteError, match="timed out"):
        conn.run(["sleep", "5"], timeout=0.3)


def test_a_local_command_that_exits_returns_while_its_stdin_pipe_is_still_open():
    # preflight's master-port listener reads a pipe the caller closes only after run() returns; with the
    # node's Python missing the command exits at once, and run() waited for that pipe (30 s in preflight).
    import os
    import threading

    read_end, write_end = os.pipe()
    returned: list = []
    with os.fdopen(read_end, "rb", buffering=0) as stdin:
        runner = threading.Thread(
            target=lambda: returned.append(LocalConnection().run(["sh", "-c", "exit 3"], stdin=stdin))
        )
        runner.start()
        runner.join(timeout=20)
        still_waiting = runner.is_alive()
        os.close(write_end)
        runner.join(timeout=20)
    assert not still_waiting, "run() waited for the caller's stdin after the command had exited"
    assert returned[0].exit_code == 3


# -- real hosts -----------------------------------------------------------------


@pytest.mark.integration
def test_fan_out_reuses_one_connection_per_host(cluster):
    hosts = cluster(3)
    with HostPool([h.name for h in hosts.hosts], ssh_config=hosts.ssh_config) as pool:
        first = pool.run_all(["sh", "-c", "hostname; echo $SSH_CONNECTION"], timeout=20)
        second = pool.run_all(["sh", "-c", "hostname; echo $SSH_CONNECTION"], timeout=20)
    for host in hosts.hosts:
        name, conn_a = first[host.name].stdout.splitlines()
        _, conn_b = second[host.name].stdout.splitlines()
        assert name == host.name
        # Same client port both times: the second command rode the first connection.
        assert conn_a == conn_b and conn_a.split()[2] == host.address


@pytest.mark.integration
def test_shell_metacharacters_stay_inert(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    marker = f"/tmp/dzctl-inert-{uuid.uuid4().hex}"
    values = [v.format(marker=marker) for v in NASTY]
    with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
        conn = pool.connection(host.name)
        for value in values:
            result = conn.run(["printf", "%s|", value], check=True)
            assert result.stdout == value + "|"
        # Through env too (the values reach the command's environment verbatim).
        result = conn.run(["sh", "-c", 'printf %s "$DZ"'], env={"DZ": values[0]}, check=True)
        assert result.stdout == values[0]
    assert not Path(marker).exists()


@pytest.mark.integration
def test_many_quick_commands_on_one_connection_never_drop_it(cluster):
    # paramiko can send a channel's EOF after its CLOSE when the command ends at once
    # (paramiko#1115); OpenSSH then drops the connection with every channel on it. Before
    # dzctl avoided that, 1,200 such commands (as preflight runs them: 8 channels at a time)
    # lost the connection in each of two tries here, once under CPU load; after, none in 7,200.
    hosts = cluster(1)
    host = hosts.hosts[0]
    with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
        conn = pool.connection(host.name)
        outcomes = [r for _ in range(150) for r in run_concurrently(conn, [["true"]] * 8, timeout=20)]
        assert conn.redials == 0
    assert all(isinstance(r, Result) and r.ok for r in outcomes), [r for r in outcomes if not getattr(r, "ok", False)]


@pytest.mark.integration
def test_a_link_dropped_just_before_each_command_is_dialled_again_every_time(cluster):
    """The race behind a flaky redial: the next command's channel request hits the closed socket
    (EOFError from paramiko's writer) while its reader thread still calls the transport active.
    No pause between the drop and the command, twenty times over, so the race is hit."""
    hosts = cluster(1)
    host = hosts.hosts[0]
    with HostPool([host.name], ssh_config=hosts.ssh_config, connect_timeout=5) as pool:
        conn = pool.connection(host.name)
        ports = {conn.run(["sh", "-c", "echo $SSH_CONNECTION"], check=True).stdout.split()[1]}
        for round_ in range(1, 21):
            assert hosts.drop_connections(host), "no sshd session process found"
            ports.add(conn.run(["sh", "-c", "echo $SSH_CONNECTION"], check=True).stdout.split()[1])
            assert conn.redials == round_
        assert len(ports) == 21  # every command ran on a new connection


@pytest.mark.integration
def test_a_connection_lost_between_commands_is_dialled_again(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    with HostPool([host.name], ssh_config=hosts.ssh_config, connect_timeout=5) as pool:
        conn = pool.connection(host.name)
        first = conn.run(["sh", "-c", "echo $SSH_CONNECTION"], check=True).stdout
        assert hosts.drop_connections(host), "no sshd session process found"
        # The next command had not started when the connection went: it runs on a new one.
        again = conn.run(["sh", "-c", "echo $SSH_CONNECTION"], check=True).stdout
        assert again.split()[2] == host.address and again.split()[1] != first.split()[1]  # a new client port
        assert conn.redials == 1
        marker = Path(f"/tmp/dzctl-redial-{uuid.uuid4().hex}")
        conn.put(b"x", str(marker))  # SFTP follows the new connection too
        assert marker.read_bytes() == b"x"
        marker.unlink()
        # A command whose connection dies while it runs is not repeated: it fails.
        cut = threading.Timer(1.0, hosts.drop_connections, args=(host,))
        cut.start()
        with pytest.raises(RemoteError):
            conn.run(["sh", "-c", f"echo run >> {marker}; sleep 10"], timeout=30, check=True)
        cut.join()
        assert marker.read_text() == "run\n"
        assert conn.redials == 1
        marker.unlink()
        # With sshd itself gone, the error says both what happened and what failed next.
        hosts.stop_sshd(host)
        hosts.drop_connections(host)
        with pytest.raises(RemoteError, match="the SSH connection closed, and connecting again failed") as info:
            conn.run(["true"])
        assert "Connection refused" in str(info.value)


@pytest.mark.integration
def test_stopped_sshd_is_reported_and_others_still_run(cluster):
    hosts = cluster(3)
    down = hosts.hosts[1]
    hosts.stop_sshd(down)
    with HostPool([h.name for h in hosts.hosts], ssh_config=hosts.ssh_config, connect_timeout=5) as pool:
        started = time.monotonic()
        outcomes = pool.run_all(["hostname"], timeout=20)
        elapsed = time.monotonic() - started
        assert elapsed < 5
        assert isinstance(outcomes[down.name], RemoteError)
        assert str(outcomes[down.name]).startswith(f"{down.name}: unreachable")
        assert "sshd" in outcomes[down.name].fix
        assert {h: r.stdout.strip() for h, r in outcomes.succeeded.items()} == {
            hosts.hosts[0].name: hosts.hosts[0].name,
            hosts.hosts[2].name: hosts.hosts[2].name,
        }
        # Remembered: a second call fails at once instead of retrying.
        with pytest.raises(RemoteError, match="unreachable"):
            pool.connection(down.name)


@pytest.mark.integration
def test_silent_host_times_out_within_connect_timeout(cluster, tmp_path):
    hosts = cluster(1)
    # An address on the bridge nobody answers for: the SYN gets no reply at all.
    silent = str(hosts.network.network_address + 200)
    config = tmp_path / "config"
    config.write_text(hosts.ssh_config.read_text() + f"\nHost ghost\n  HostName {silent}\n  User root\n")
    with HostPool(["ghost", hosts.hosts[0].name], ssh_config=config, connect_timeout=2) as pool:
        started = time.monotonic()
        outcomes = pool.run_all(["true"])
        elapsed = time.monotonic() - started
    assert isinstance(outcomes["ghost"], RemoteError) and "unreachable" in str(outcomes["ghost"])
    assert elapsed < 2.8
    assert outcomes[hosts.hosts[0].name].ok


@pytest.mark.integration
def test_unknown_host_key_is_refused_with_the_fix(cluster):
    hosts = cluster(2)
    hosts.write_known_hosts([hosts.hosts[0]])  # node1 unknown
    before = hosts.known_hosts.read_text()
    with HostPool([h.name for h in hosts.hosts], ssh_config=hosts.ssh_config) as pool:
        outcomes = pool.run_all(["true"])
    error = outcomes[hosts.hosts[1].name]
    assert isinstance(error, RemoteError)
    assert "not in known_hosts" in str(error) and "SHA256:" in str(error)
    assert "--trust-new-hosts" in error.fix and "ssh-keyscan" in error.fix
    assert outcomes[hosts.hosts[0].name].ok
    assert hosts.known_hosts.read_text() == before


@pytest.mark.integration
def test_trust_new_hosts_records_the_key(cluster):
    hosts = cluster(2)
    hosts.known_hosts.write_text("")
    names = [h.name for h in hosts.hosts]
    with HostPool(names, ssh_config=hosts.ssh_config, trust_new_hosts=True) as pool:
        assert pool.run_all(["true"]).ok
    recorded = sorted(hosts.known_hosts.read_text().splitlines())
    assert recorded == sorted(hosts.known_hosts_line(h) for h in hosts.hosts)
    # Recorded keys now verify without the flag, and OpenSSH agrees with them.
    with HostPool(names, ssh_config=hosts.ssh_config) as pool:
        assert pool.run_all(["true"]).ok
    assert subprocess.run(hosts.ssh_argv(hosts.hosts[0], ["true"]), capture_output=True).returncode == 0


@pytest.mark.integration
def test_changed_host_key_is_always_refused(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    before = hosts.known_hosts.read_text()
    hosts.rotate_host_key(host)
    for trust in (False, True):
        with HostPool([host.name], ssh_config=hosts.ssh_config, trust_new_hosts=trust) as pool:
            outcome = pool.run_all(["true"])[host.name]
        assert isinstance(outcome, RemoteError)
        assert "HOST KEY CHANGED" in str(outcome) and "ssh-keygen -R" in outcome.fix
    assert hosts.known_hosts.read_text() == before


@pytest.mark.integration
def test_upload_with_mode_and_mkdir(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    base = f"/tmp/dzctl-sftp-{uuid.uuid4().hex}"
    local = hosts.workdir / "payload.bin"
    local.write_bytes(os.urandom(300_000))
    try:
        with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
            conn = pool.connection(host.name)
            conn.mkdir(f"{base}/jobs/j1")
            conn.mkdir(f"{base}/jobs/j1")  # idempotent, like mkdir -p
            conn.put(b"HF_TOKEN=abc\n", f"{base}/jobs/j1/env", mode=0o600)
            conn.put(local, f"{base}/jobs/j1/payload.bin")
            stat = conn.run(["stat", "-c", "%a %s", f"{base}/jobs/j1/env", f"{base}/jobs/j1/payload.bin"], check=True)
            digest = conn.run(["sha256sum", f"{base}/jobs/j1/payload.bin"], check=True).stdout.split()[0]
            listing = conn.run(["ls", "-A", f"{base}/jobs/j1"], check=True).stdout.split()
        assert stat.stdout.split("\n")[:2] == ["600 13", "644 300000"]
        assert digest == hashlib.sha256(local.read_bytes()).hexdigest()
        assert sorted(listing) == ["env", "payload.bin"]  # no temp files left
        with pytest.raises(RemoteError, match="upload to"), HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
            pool.connection(host.name).put(b"x", f"{base}/missing-dir/file")
    finally:
        subprocess.run(["rm", "-rf", base], check=False)


@pytest.mark.integration
def test_stdin_streams_into_a_remote_command(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    payload = os.urandom(5 * 1024 * 1024 + 17)
    with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
        conn = pool.connection(host.name)
        from_bytes = conn.run(["sha256sum"], stdin=payload, timeout=60, check=True)
        from_file = conn.run(["wc", "-c"], stdin=io.BytesIO(payload), timeout=60, check=True)
        # A command that exits without reading must not hang the sender.
        early = conn.run(["sh", "-c", "exit 3"], stdin=io.BytesIO(payload), timeout=30)
    assert from_bytes.stdout.split()[0] == hashlib.sha256(payload).hexdigest()
    assert from_file.stdout.strip() == str(len(payload))
    assert early.exit_code == 3


@pytest.mark.integration
def test_stdout_streams_while_the_command_runs(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    arrivals: list[tuple[float, bytes]] = []
    with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
        conn = pool.connection(host.name)
        started = time.monotonic()
        result = conn.run(
            ["sh", "-c", "echo first; sleep 1.5; echo second"],
            on_stdout=lambda chunk: arrivals.append((time.monotonic() - started, chunk)),
            timeout=20,
        )
    assert result.ok and result.stdout == ""  # streamed output is handed on, not kept
    assert b"".join(c for _, c in arrivals) == b"first\nsecond\n"
    assert arrivals[0][1].startswith(b"first") and arrivals[0][0] < 1.0
    with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
        started = time.monotonic()
        with pytest.raises(RemoteError, match=r"timed out after 0\.5 s"):
            pool.connection(host.name).run(["sleep", "10"], timeout=0.5)
        assert time.monotonic() - started < 3


@pytest.mark.integration
def test_proxyjump_goes_through_the_jump_host(cluster, tmp_path):
    hosts = cluster(2)
    jump, target = hosts.hosts
    config = tmp_path / "config"
    text = hosts.ssh_config.read_text().replace(
        f"Host {target.name}\n", f"Host {target.name}\n  ProxyJump {jump.name}\n", 1
    )
    config.write_text(text)
    with HostPool([target.name], ssh_config=config) as pool:
        result = pool.connection(target.name).run(["sh", "-c", "echo $SSH_CONNECTION"], check=True)
    # The target saw the connection come from the jump host, not from the controller.
    assert result.stdout.split()[0] == jump.address


@pytest.mark.integration
def test_ssh_agent_keys_are_used(cluster, tmp_path, monkeypatch):
    hosts = cluster(1)
    host = hosts.hosts[0]
    socket_path = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(socket_path)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if socket_path.exists():
                break
            time.sleep(0.05)
        env = {**os.environ, "SSH_AUTH_SOCK": str(socket_path)}
        subprocess.run(["ssh-add", str(hosts.identity)], env=env, check=True, capture_output=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(socket_path))
        config = tmp_path / "config"
        # No IdentityFile: only the agent holds the key.
        config.write_text(
            f"Host {host.name}\n  HostName {host.address}\n  User root\n  UserKnownHostsFile {hosts.known_hosts}\n"
        )
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/id_* to fall back on
        with HostPool([host.name], ssh_config=config) as pool:
            assert pool.connection(host.name).run(["hostname"], check=True).stdout.strip() == host.name
    finally:
        os.kill(agent.pid, signal.SIGTERM)
        agent.wait(timeout=10)


@pytest.mark.integration
def test_commands_at_once_share_the_one_connection(cluster):
    hosts = cluster(1)
    host = hosts.hosts[0]
    argvs = [["sh", "-c", f"sleep 0.5; echo {i} $SSH_CONNECTION"] for i in range(5)] + [["false"]]
    with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
        conn = pool.connection(host.name)
        started = time.monotonic()
        results = run_concurrently(conn, argvs, timeout=20)
        elapsed = time.monotonic() - started
    assert [r.stdout.split()[0] for r in results[:5]] == ["0", "1", "2", "3", "4"]  # in argv order
    assert len({r.stdout.split(maxsplit=1)[1] for r in results[:5]}) == 1  # one client port: one connection
    assert results[5].exit_code == 1
    assert elapsed < 2.0  # five 0.5 s sleeps overlapped


@pytest.mark.integration
def test_download_returns_the_file_and_names_a_missing_one(cluster):
    # `dzctl logs --fetch` copies progress records and TensorBoard event files back this way.
    hosts = cluster(1)
    host = hosts.hosts[0]
    base = f"/tmp/dzctl-get-{uuid.uuid4().hex}"
    payload = os.urandom(200_000)
    try:
        with HostPool([host.name], ssh_config=hosts.ssh_config) as pool:
            conn = pool.connection(host.name)
            conn.mkdir(base)
            conn.put(payload, f"{base}/events.out.tfevents")
            assert conn.get(f"{base}/events.out.tfevents") == payload
            with pytest.raises(RemoteError, match=f"download of {base}/missing failed"):
                conn.get(f"{base}/missing")
    finally:
        subprocess.run(["rm", "-rf", base], check=False)
