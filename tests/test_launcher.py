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


# The functions that decide something about a job from its files or its nodes. One `dzctl launch`
# must run each once: everything later reads the ResolvedJob they built (issue 32).
RESOLUTION = (
    ("orchestrator.planning.inputs", "read_inputs"),
    ("orchestrator.spec.job", "read_env_file"),
    ("orchestrator.planning.dsconfig", "load_user_config"),
    ("orchestrator.planning.shape", "shape_for_job"),
    ("orchestrator.planning.packing", "resolve_packing"),
    ("orchestrator.planning.fusedloss", "resolve"),
    ("orchestrator.planning.memory.fromjob", "plan_for_job"),
    ("orchestrator.planning.dsconfig", "ds_config_for"),
    ("orchestrator.planning.resolve", "resolve_job"),
)


def test_one_dzctl_launch_resolves_the_job_once(cluster, tmp_path, monkeypatch):
    """Counts, with a profiler hook in every thread, the calls of each resolution function during one launch."""
    import collections
    import importlib
    import json
    import threading

    from click.testing import CliRunner

    from orchestrator.cli import main
    from orchestrator.planning import launchplan

    hosts = cluster(2)
    monkeypatch.setenv("DZCTL_HOME", str(tmp_path / "home"))
    secrets = tmp_path / "secrets.env"
    secrets.write_text("HF_TOKEN=hf_resolve_once\n", encoding="utf-8")
    remote = f"/var/tmp/dzctl-once-{hosts.cid}"
    codes = {getattr(importlib.import_module(m), f).__code__: f"{m}.{f}" for m, f in RESOLUTION}
    counts: collections.Counter[str] = collections.Counter()
    plan_ids: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code in codes:
            counts[codes[frame.f_code]] += 1
        elif frame.f_code is launchplan.make_plan.__code__:
            plan_ids.append(frame.f_locals["job_id"])

    argv = [
        "launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--hosts", str(hosts.write_hostfile(tmp_path / "hosts.txt")),
        "--ssh-config", str(hosts.ssh_config), "--detach", "--json",
        "--set", "name=resolve-once", "--set", "runtime=process", "--set", f"launch.python={sys.executable}",
        "--set", f"launch.remote_dir={remote}/{{host}}", "--set", "launch.master_port=29633",
        "--set", f"launch.env_file={secrets}", "--set", "train.max_steps=200", "--set", "train.save_steps=1000",
    ]  # fmt: skip
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        result = CliRunner().invoke(main, argv)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert result.exit_code == 0, result.output
    job_id = json.loads(result.stdout)["job_id"]
    try:
        assert dict(counts) == {name: 1 for name in codes.values()}
        # The job's own launch plan is made once; preflight's and the collective check's carry their own ids.
        assert plan_ids.count(job_id) == 1, plan_ids
        assert all(i == job_id or i == "preflight" or i.endswith("-nccl") for i in plan_ids), plan_ids
        # What the nodes got was made from that one resolution: the secret reached the env file only.
        job_dir = Path(f"{remote}/node1/jobs/{job_id}")
        assert (job_dir / "env").read_text() == "HF_TOKEN=hf_resolve_once\n"
        assert "hf_resolve_once" not in (job_dir / "job.yaml").read_text()
    finally:
        stopped = CliRunner().invoke(main, ["stop", job_id])
        assert stopped.exit_code == 0, stopped.output
