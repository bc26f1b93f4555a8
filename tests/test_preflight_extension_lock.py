"""A DeepSpeed op-build lock left by a killed build makes every rank wait forever: preflight names it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from orchestrator.preflight import render_report, run_preflight
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job
from orchestrator.transport.pool import HostPool

REPO = Path(__file__).resolve().parents[1]
CPU_JOB = REPO / "jobs" / "tiny-cpu.yaml"


@pytest.mark.integration
def test_a_stale_op_build_lock_fails_preflight_naming_it_and_a_fresh_one_does_not(cluster, tmp_path):
    hosts = cluster(1)
    nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
    extensions = tmp_path / "torch-extensions"
    (extensions / "async_io").mkdir(parents=True)
    (extensions / "cpu_adam").mkdir()
    stale = extensions / "async_io" / "lock"
    stale.touch()
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))  # what a build killed an hour ago leaves behind
    (extensions / "cpu_adam" / "lock").touch()  # a build running now: left alone
    job = load_job(
        CPU_JOB,
        [
            f"launch.python={sys.executable}",
            "launch.master_port=29591",
            f"launch.env.TORCH_EXTENSIONS_DIR={extensions}",
        ],
        "process",
    )
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        report = run_preflight(job, nodes, pool)
        check = report.hosts[0].check("torch-extensions")
        assert check is not None and check.status == "fail", render_report(report)
        assert str(stale) in check.detail and "60 min old" in check.detail and "forever" in check.detail
        assert f"rm {stale}" in check.fix and "cpu_adam" not in check.detail + check.fix
        assert not report.ok
        stale.unlink()
        again = run_preflight(job, nodes, pool)
    assert again.hosts[0].check("torch-extensions") is None, render_report(again)
