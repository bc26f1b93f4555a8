"""`dzctl stop` on real test hosts when one node's stop fails: exit 1, that node named, and no
`status` that reads `stopped` while a rank still runs.

Each test records a two-node job in a fresh DZCTL_HOME and starts its ranks on the hosts the way
launch does (a labelled container by its planned name, or `nodeexec start`), with a long `sleep`
as the rank: what is under test is stop and status, not training.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.observe.store import JobStore

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration]


def _record(home: Path, cluster, runtime: str, job_id: str, python: str, remote: str) -> None:
    nodes = []
    for rank, host in enumerate(cluster.hosts):
        job_dir = f"{remote}/{host.name}/jobs/{job_id}"
        Path(job_dir).mkdir(parents=True, exist_ok=True)
        nodes.append({
            "host": host.name, "node_rank": rank, "slots": 1, "container_name": f"dzctl-{job_id}-{rank}",
            "job_dir": job_dir, "output_dir": f"{remote}/{host.name}/output",
        })  # fmt: skip
    with JobStore(home / "jobs.sqlite") as store:
        store.add(
            job_id=job_id, name="stopjob", runtime=runtime, image=None, hosts=[h.name for h in cluster.hosts],
            spec={"name": "stopjob", "launch": {"python": python}}, plan={"nodes": nodes},
            ssh_config=str(cluster.ssh_config),
        )  # fmt: skip
        store.set_state(job_id, "running")


def _dzctl(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DZCTL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env, timeout=180
    )


def _status(home: Path) -> dict:
    result = _dzctl(home, "status", "stopjob", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox (apt-get install busybox-static)")
def test_stop_with_one_dockerd_down_exits_1_names_that_node_and_status_never_reads_stopped(cluster, tmp_path):
    from test_preflight import _busybox_image

    hosts = cluster(2, docker=True)
    tag = "dzctl-test/busybox:stop"
    job_id = "stopjob-20261130-000000-aaaa"
    for rank, host in enumerate(hosts.hosts):
        _busybox_image(host.docker_host, tmp_path / host.name, tag)
        run = [
            "docker",
            "run",
            "-d",
            "--network",
            "host",
            "--name",
            f"dzctl-{job_id}-{rank}",
            tag,
            "tail",
            "-f",
            "/dev/null",
        ]
        hosts.run_in(host, run)
    _record(tmp_path / "home", hosts, "docker", job_id, "python3", f"/var/tmp/dzctl-stop-{hosts.cid}")
    assert _status(tmp_path / "home")["state"] == "running"

    victim = hosts.hosts[1]
    inspect = hosts.run_in(victim, ["docker", "inspect", "--format", "{{.State.Pid}}", f"dzctl-{job_id}-1"])
    rank_pid = int(inspect.stdout)
    shim_pid = int(Path(f"/proc/{rank_pid}/stat").read_text().rpartition(")")[2].split()[1])
    # Its daemon dies hard (OOM killer, crash): the container's shim and the rank live on.
    os.kill(victim.dockerd_pid, signal.SIGKILL)
    try:
        deadline = time.monotonic() + 10
        while hosts.run_in(victim, ["docker", "version"], check=False).returncode == 0:
            assert time.monotonic() < deadline, "dockerd still answers after SIGKILL"
            time.sleep(0.2)
        assert _alive(rank_pid), "the rank died with its daemon: this test needs it alive"

        stopped = _dzctl(tmp_path / "home", "stop", "stopjob", "--json")
        assert stopped.returncode == 1, stopped.stdout + stopped.stderr
        outcome = json.loads(stopped.stdout.splitlines()[0])["hosts"]
        assert outcome[hosts.hosts[0].name] == "stopped"
        assert outcome[victim.name].startswith("error: ") and "not stopped" in outcome[victim.name]
        assert f"could not stop job {job_id} on {victim.name}" in stopped.stderr
        assert "Docker daemon" in stopped.stderr  # the fix names the likely cause
        status = _status(tmp_path / "home")
        assert status["state"] != "stopped", status
        assert _alive(rank_pid)  # what stop reported is true: the rank still runs
    finally:
        for pid in (rank_pid, shim_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_stop_that_leaves_a_rank_running_exits_1_and_status_says_running(cluster, tmp_path):
    """Process runtime: node 1's `nodeexec stop` does nothing and says 0 (as today's did whatever
    survived). Stop must ask the node again, see the rank, and say so; status follows the node."""
    hosts = cluster(2)
    job_id = "stopjob-20261130-000000-bbbb"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$(hostname)" = node1 ] && [ "$3" = stop ]; then exit 0; fi\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    remote = f"/var/tmp/dzctl-stop-{hosts.cid}"
    _record(tmp_path / "home", hosts, "process", job_id, str(wrapper), remote)
    for rank, host in enumerate(hosts.hosts):
        job_dir = f"{remote}/{host.name}/jobs/{job_id}"
        argv = [sys.executable, "-m", "orchestrator.runtimes.process", "start", "--job-dir", job_dir,
                "--rank", str(rank), "--", "sleep", "600"]  # fmt: skip
        started = subprocess.run(hosts.ssh_argv(host, argv), capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
    pid = json.loads(Path(f"{remote}/{hosts.hosts[1].name}/jobs/{job_id}/rank-1.json").read_text())["pid"]
    try:
        assert _status(tmp_path / "home")["state"] == "running"
        stopped = _dzctl(tmp_path / "home", "stop", "stopjob")
        assert stopped.returncode == 1, stopped.stdout + stopped.stderr
        assert f"{hosts.hosts[0].name}: stopped" in stopped.stdout
        assert "rank 1 is still running" in stopped.stdout
        assert f"could not stop job {job_id} on {hosts.hosts[1].name}" in stopped.stderr
        status = _status(tmp_path / "home")
        assert status["state"] != "stopped", status
        assert [n["state"] for n in status["nodes"]] == ["exited", "running"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
