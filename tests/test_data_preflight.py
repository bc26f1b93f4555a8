"""Preflight's data check on real test hosts: node-side paths and a hub ID, looked for on every node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_cache import HUB_SCRIPT

from orchestrator.preflight import run_preflight
from orchestrator.preflight.datacheck import host_path
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job
from orchestrator.transport.pool import HostPool

REPO = Path(__file__).resolve().parents[1]
CPU_JOB = REPO / "jobs" / "tiny-cpu.yaml"
SAMPLE = REPO / "jobs" / "data" / "tiny-alpaca-zh.jsonl"


def _job(tmp_path: Path, sources: list[dict], *sets: str):
    job = tmp_path / "job.yaml"
    text = CPU_JOB.read_text(encoding="utf-8").replace(
        "  path: data/tiny-alpaca-zh.jsonl\n  format: alpaca\n", f"  sources: {json.dumps(sources)}\n"
    )
    job.write_text(text, encoding="utf-8")
    # The system python3 (no torch): python-env fails, but only the data check matters here.
    return load_job(job, ["launch.python=python3", "launch.master_port=29871", *sets], "process")


@pytest.mark.integration
def test_missing_node_side_path_fails_naming_node_and_path_and_cached_hub_id_passes(cluster, tmp_path):
    home = tmp_path / "hf"
    home.mkdir()
    env = dict(os.environ, HF_HOME=str(home), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    made = subprocess.run([sys.executable, "-c", HUB_SCRIPT.format(root=str(REPO))], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    missing = tmp_path / "nowhere" / "train.jsonl"
    hub_env = [f"launch.env.HF_HOME={home}", "launch.env.HF_DATASETS_OFFLINE=1"]
    hosts = cluster(2)
    nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
    sources = [{"path": str(SAMPLE)}, {"path": str(missing)}, {"path": "hf:acme/tiny-sft"}]
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        report = run_preflight(_job(tmp_path, sources, *hub_env), nodes, pool)
        for host in report.hosts:
            check = host.check("data")
            assert check.status == "fail", check
            assert check.detail == f"data.sources[1].path {missing} does not exist on {host.host}"
            assert check.fix.startswith(f"put the data at {missing} on {host.host}")
        fine = run_preflight(_job(tmp_path, [sources[0], sources[2]], *hub_env), nodes, pool)
        absent = run_preflight(_job(tmp_path, [{"path": "hf:acme/absent"}], *hub_env), nodes, pool)
    for host in fine.hosts:
        check = host.check("data")
        assert check.status == "ok", check
        assert f"{SAMPLE}: {SAMPLE.stat().st_size} bytes" in check.detail
        assert f"hf:acme/tiny-sft: in the cache ({home}/datasets/acme___tiny-sft)" in check.detail
    for host in absent.hosts:
        check = host.check("data")
        assert (
            check.status == "fail" and "hf:acme/absent is not in" in check.detail and "(offline mode)" in check.detail
        )


def test_container_paths_are_looked_for_through_the_mounts(tmp_path):
    job = _job(tmp_path, [{"path": "/data/a.jsonl"}], "launch.mounts=[/srv/sets:/data:ro, /srv:/srv]")
    docker = job.spec.model_copy(update={"runtime": "docker"})
    assert host_path(docker, "/data/a.jsonl") == "/srv/sets/a.jsonl"
    assert host_path(docker, "/srv/x/b.parquet") == "/srv/x/b.parquet"
    assert host_path(docker, "/elsewhere/c.json") is None  # the container would not see it
    assert host_path(job.spec, "/elsewhere/c.json") == "/elsewhere/c.json"  # runtime: process reads the node's path
