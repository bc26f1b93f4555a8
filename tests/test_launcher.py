"""The launch sequence called from Python, with no click in the way (issue 17).

Two real test hosts (own netns and sshd each), the process runtime, real DeepSpeed
ZeRO-3 on CPU over gloo, one rank per host: ``prepare`` checks and plans,
``execute`` starts through the SSH fleet backend, the hosts report success.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Recorder:
    """A progress sink that keeps what the sequence said."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.reports: list[tuple[bool, bool]] = []
        self.busy_steps: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)

    def preflight(self, report, *, final: bool) -> None:
        self.reports.append((report.ok, final))

    def busy(self, what: str):
        import contextlib

        self.busy_steps.append(what)
        return contextlib.nullcontext()


def test_the_tiny_job_launches_from_python_through_prepare_and_execute(cluster, tmp_path, capsys):
    from orchestrator.backends import launcher
    from orchestrator.backends.fleet import SshFleet
    from orchestrator.observe.hosts import gather_status
    from orchestrator.observe.store import JobStore
    from orchestrator.spec.hostfile import load_nodes
    from orchestrator.spec.job import load_job
    from orchestrator.transport.pool import HostPool

    hosts = cluster(2)
    remote = f"/var/tmp/dzctl-lib-{hosts.cid}"
    job = load_job(
        str(ROOT / "jobs/tiny-cpu.yaml"),
        (
            "name=lib-tiny",
            "runtime=process",
            f"launch.python={sys.executable}",
            f"launch.remote_dir={remote}/{{host}}",
            "launch.master_port=29631",
            "train.max_steps=3",
            "train.save_steps=100",
        ),
        None,
    )
    nodes = load_nodes(str(hosts.write_hostfile(tmp_path / "hosts.txt", slots=1)))
    progress = Recorder()
    with (
        HostPool([n.host for n in nodes], ssh_config=str(hosts.ssh_config)) as pool,
        JobStore(tmp_path / "jobs.sqlite") as store,
    ):
        prepared = launcher.prepare(job, nodes, pool, launcher.LaunchOptions(skip_collective=True), progress)
        # A plain value: the master preflight chose, one launcher per node, in rank order.
        assert [(n.host, n.node_rank, n.slots) for n in prepared.plan.nodes] == [("node0", 0, 1), ("node1", 1, 1)]
        assert prepared.plan.master_addr == hosts.hosts[0].address
        assert progress.reports == [(True, False)]
        started = launcher.execute(prepared, SshFleet(pool, store), progress)
        assert started.hosts == ["node0", "node1"]
        assert progress.notes[-1].startswith(f"started {started.job_id} on 2 node(s)")
        deadline = time.monotonic() + 600
        while True:
            status = gather_status(store.get(started.job_id), pool)
            if status.state not in ("running", "pending"):
                break
            assert time.monotonic() < deadline, f"not done in 600 s: {status}"
            time.sleep(2)
    assert status.state == "succeeded", status
    assert [(n.node_rank, n.exit_code) for n in status.nodes] == [(0, 0), (1, 0)]
    assert status.progress["step"] == 3
    # The library printed nothing: everything went through the sink.
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_a_failed_check_raises_before_anything_is_recorded(cluster, tmp_path):
    from orchestrator.backends import launcher
    from orchestrator.errors import RuntimeFailure
    from orchestrator.spec.hostfile import load_nodes
    from orchestrator.spec.job import load_job
    from orchestrator.transport.pool import HostPool

    hosts = cluster(2)
    job = load_job(
        str(ROOT / "jobs/tiny-cpu.yaml"),
        ("runtime=process", "launch.python=/nonexistent/python3", f"launch.remote_dir=/var/tmp/dzctl-lib-{hosts.cid}"),
        None,
    )
    nodes = load_nodes(str(hosts.write_hostfile(tmp_path / "hosts.txt", slots=1)))
    progress = Recorder()
    pool = HostPool([n.host for n in nodes], ssh_config=str(hosts.ssh_config))
    with pool, pytest.raises(RuntimeFailure, match="preflight failed on 2 of 2 node"):
        launcher.prepare(job, nodes, pool, launcher.LaunchOptions(skip_collective=True), progress)
    assert progress.reports == [(False, False)]
