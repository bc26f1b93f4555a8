"""`dzctl launch` streams the image through the client `DZCTL_SSH_CLIENT` names (issue 28, item 6).

Real parts: the image comes from a dockerd on this machine's root namespace, the nodes are test
hosts with their own sshd and dockerd (tests/testhosts.py), and which client carried the stream is
read from what each node's sshd logged, not only from what dzctl says.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_image(local_docker_url):
    """A one-file image on the local daemon (``docker import``): cheap to send, and not one a rank can run."""
    tag = f"dzctl-test/ssh-client:{os.urandom(4).hex()}"
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        data = os.urandom(200_000)
        entry = tarfile.TarInfo("payload.bin")
        entry.size = len(data)
        tar.addfile(entry, io.BytesIO(data))
    done = subprocess.run(["docker", "-H", local_docker_url, "import", "-", tag], input=payload.getvalue(),
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    yield tag
    subprocess.run(["docker", "-H", local_docker_url, "rmi", "--force", tag], capture_output=True, timeout=120)


@pytest.mark.integration
@pytest.mark.parametrize("ssh_client", ["paramiko", "openssh"])
def test_launch_streams_the_image_through_the_client_dzctl_ssh_client_names(
    cluster, local_docker_url, tiny_image, tmp_path, ssh_client
):
    hosts = cluster(2, docker=True)
    hostfile = hosts.write_hostfile(tmp_path / "hosts.txt", slots=1)
    sets = [f"name=sshclient-{ssh_client}", f"image={tiny_image}", "runtime=docker",
            f"launch.remote_dir={tmp_path / 'remote'}/{{host}}"]  # fmt: skip
    env = {**os.environ, "DOCKER_HOST": local_docker_url, "DZCTL_LAYER_STORE": "off", "DZCTL_SSH_CLIENT": ssh_client,
           "DZCTL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}  # fmt: skip
    argv = [sys.executable, "-m", "orchestrator", "launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--hosts", str(hostfile),
            "--ssh-config", str(hosts.ssh_config), "--skip-collective", "--detach",
            *(item for s in sets for item in ("--set", s))]  # fmt: skip
    before = {host.name: _logins(host) for host in hosts.hosts}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    # The launch ships the image the nodes lack, then checks again; this image holds no Python, so
    # the second preflight stops it (exit 1, nothing started). The stream before that is the test.
    assert done.returncode == 1 and "nothing was started" in done.stderr, done.stderr[-3000:]
    # What the nodes' sshd saw, whatever dzctl says: paramiko carries everything on the pool's one
    # connection per node; the OpenSSH client adds its own logins (its probe, then the stream).
    logins = {host.name: _logins(host) - before[host.name] for host in hosts.hosts}
    if ssh_client == "paramiko":
        assert logins == {"node0": 1, "node1": 1}, logins
    else:
        assert all(count >= 3 for count in logins.values()), logins

    for host in hosts.hosts:
        assert f"{host.name}: image loaded through {ssh_client} (" in done.stderr, done.stderr[-3000:]
        loaded = hosts.run_in(host, ["docker", "image", "inspect", "--format", "{{.Id}}", tiny_image], check=False)
        assert loaded.returncode == 0 and loaded.stdout.startswith("sha256:"), host.name
    other = {"paramiko": "openssh", "openssh": "paramiko"}[ssh_client]
    assert f"through {other}" not in done.stderr


def _logins(host) -> int:
    """SSH logins the host's sshd has logged so far (LogLevel VERBOSE: one line a login)."""
    return (host.dir / "sshd.log").read_text(errors="replace").count("Accepted publickey for ")


def test_dzctl_ssh_client_is_read_strictly():
    from orchestrator.errors import InputError
    from orchestrator.transport.openssh import client_from_env

    assert client_from_env({}) == "auto" and client_from_env({"DZCTL_SSH_CLIENT": "paramiko"}) == "paramiko"
    with pytest.raises(InputError, match="DZCTL_SSH_CLIENT='ssh' is not an SSH client dzctl knows") as raised:
        client_from_env({"DZCTL_SSH_CLIENT": "ssh"})
    assert "auto, openssh, paramiko" in raised.value.fix


@pytest.mark.integration
def test_an_unknown_dzctl_ssh_client_stops_launch_before_any_host(cluster, tmp_path):
    hosts = cluster(1)
    hostfile = hosts.write_hostfile(tmp_path / "hosts.txt", slots=1)
    env = {**os.environ, "DZCTL_SSH_CLIENT": "putty", "DZCTL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    before = _logins(hosts.hosts[0])
    argv = [sys.executable, "-m", "orchestrator", "launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--hosts", str(hostfile),
            "--ssh-config", str(hosts.ssh_config), "--detach"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "DZCTL_SSH_CLIENT='putty' is not an SSH client dzctl knows" in done.stderr and "Traceback" not in done.stderr
    assert _logins(hosts.hosts[0]) == before, "a host was reached for a launch refused on its input"
