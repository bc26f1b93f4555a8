"""`node` is a hostfile line (node rank), `rank` a training process (global rank): kept apart everywhere.

The logs test runs a real `runtime: process` rank on this machine (localhost, no SSH) that
prints a line, as launch starts one; a node of 2 slots runs ranks 0 and 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from orchestrator.commands.jobs import render_status
from orchestrator.commands.ranks import ranks_by_node, selected_node
from orchestrator.observe.status import JobStatus, NodeStatus
from orchestrator.observe.store import JobStore

ROOT = Path(__file__).resolve().parents[1]
TWO_BY_FOUR = [
    {"host": "gpu-node-1", "node_rank": 0, "slots": 4},
    {"host": "gpu-node-2", "node_rank": 1, "slots": 4},
]


def test_each_node_runs_the_global_ranks_its_slots_give():
    assert ranks_by_node(TWO_BY_FOUR) == {0: range(0, 4), 1: range(4, 8)}


def test_rank_selects_the_node_that_runs_it_and_node_selects_a_node():
    assert selected_node(TWO_BY_FOUR, "j", None, 5) == 1
    assert selected_node(TWO_BY_FOUR, "j", None, 3) == 0
    assert selected_node(TWO_BY_FOUR, "j", 1, None) == 1
    assert selected_node(TWO_BY_FOUR, "j", None, None) is None


def test_out_of_range_selections_name_what_the_job_has():
    with pytest.raises(click.BadParameter) as info:
        selected_node(TWO_BY_FOUR, "j", None, 8)
    assert info.value.message == "job j has ranks 0-7 (node 0: 0-3, node 1: 4-7)"
    with pytest.raises(click.BadParameter) as info:
        selected_node(TWO_BY_FOUR, "j", 2, None)
    assert info.value.message == "job j has nodes 0-1"
    with pytest.raises(click.UsageError):
        selected_node(TWO_BY_FOUR, "j", 0, 0)


def test_the_status_table_heads_its_node_column_node_and_shows_each_nodes_ranks():
    nodes = [
        NodeStatus("gpu-node-1", 0, "running", None, False, None),
        NodeStatus("gpu-node-2", 1, "exited", 1, False, None),
    ]
    failure = {"node_rank": 1, "host": "gpu-node-2", "exit_code": 1, "reason": "boom"}
    status = JobStatus("j", "j-1", "failed", nodes, None, None, failure)
    lines = render_status(status, ranks_by_node(TWO_BY_FOUR)).splitlines()
    header = next(line for line in lines if "HOST" in line)
    assert header.split() == ["NODE", "HOST", "RANKS", "STATE", "EXIT", "OOM"]
    assert lines[lines.index(header) + 2].split() == ["1", "gpu-node-2", "4-7", "exited", "1", "no"]
    assert "first failure: node 1 on gpu-node-2 (ranks 4-7, exit 1): boom" in lines


def _dzctl(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DZCTL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env, timeout=180
    )


@pytest.fixture
def local_two_slot_job(tmp_path):
    job_id = "nodejob-20261203-000000-cccc"
    job_dir = tmp_path / "remote" / "jobs" / job_id
    job_dir.mkdir(parents=True)
    node = {
        "host": "localhost", "node_rank": 0, "slots": 2, "container_name": f"dzctl-{job_id}-0",
        "job_dir": str(job_dir), "output_dir": str(tmp_path / "remote" / "output"),
    }  # fmt: skip
    home = tmp_path / "home"
    with JobStore(home / "jobs.sqlite") as store:
        store.add(
            job_id=job_id, name="nodejob", runtime="process", image=None, hosts=["localhost"],
            spec={"name": "nodejob", "launch": {"python": sys.executable}}, plan={"nodes": [node]}, ssh_config=None,
        )  # fmt: skip
        store.set_state(job_id, "running")
    argv = [sys.executable, "-m", "orchestrator.runtimes.process", "start", "--job-dir", str(job_dir),
            "--rank", "0", "--", "echo", "hello from node 0"]  # fmt: skip
    assert subprocess.run(argv, capture_output=True, text=True, timeout=60).returncode == 0
    deadline = time.monotonic() + 60
    while json.loads(_dzctl(home, "status", "nodejob", "--json").stdout)["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    return home


def test_logs_rank_shows_the_node_that_runs_that_global_rank(local_two_slot_job):
    home = local_two_slot_job
    shown = _dzctl(home, "logs", "nodejob", "--rank", "1")
    assert shown.returncode == 0, shown.stderr
    assert "hello from node 0" in shown.stdout
    assert "rank 1 runs on node 0 (localhost)" in shown.stderr
    by_node = _dzctl(home, "logs", "nodejob", "--node", "0")
    assert by_node.returncode == 0 and "hello from node 0" in by_node.stdout
    past = _dzctl(home, "logs", "nodejob", "--rank", "2")
    assert past.returncode == 2 and "has ranks 0-1 (node 0: 0-1)" in past.stderr


def test_status_json_gives_each_node_its_global_ranks(local_two_slot_job):
    status = json.loads(_dzctl(local_two_slot_job, "status", "nodejob", "--json").stdout)
    assert [(n["node_rank"], n["ranks"]) for n in status["nodes"]] == [(0, [0, 1])]
