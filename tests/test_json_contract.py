"""`--json` on failure: one JSON object on stdout, `{"error", "fix", "exit_code"}`, for every command
that takes --json (the real CLI, in a fresh DZCTL_HOME); and `status --watch --json` as JSON Lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.observe.store import JobStore

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "tiny-cpu.yaml")
MISSING = "/nonexistent/dzctl-hosts.txt"


def _dzctl(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "DZCTL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _one_object(stdout: str) -> dict:
    lines = stdout.splitlines()
    assert len(lines) == 1, f"expected one JSON object on one line, got {stdout!r}"
    return json.loads(lines[0])


# Every command that takes --json, each failing on input it cannot use (no host is reached).
CASES = {
    "build": (["build", "--ca-bundle", "/nonexistent/ca.pem", "--json"], 2, "--ca-bundle"),
    "distribute": (["distribute", "some/image:1", "--hosts", MISSING, "--json"], 2, MISSING),
    "preflight": (["preflight", JOB, "--hosts", MISSING, "--json"], 2, MISSING),
    "plan": (["plan", "/nonexistent/job.yaml", "--hosts", MISSING, "--json"], 2, "/nonexistent/job.yaml"),
    "launch": (["launch", JOB, "--hosts", MISSING, "--json"], 2, MISSING),
    "launch --dry-run": (["launch", JOB, "--hosts", MISSING, "--dry-run", "--json"], 2, MISSING),
    "status": (["status", "no-such-job", "--json"], 2, "no-such-job"),
    "stop": (["stop", "no-such-job", "--json"], 2, "no-such-job"),
    "tune": (["tune", JOB, "--hosts", MISSING, "--json"], 2, MISSING),
    "usage error": (["status", "--json", "--no-such-option"], 2, "--no-such-option"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failing_command_with_json_prints_one_error_object(tmp_path, case):
    args, code, named = CASES[case]
    result = _dzctl(tmp_path / "home", *args)
    assert result.returncode == code, result.stdout + result.stderr
    error = _one_object(result.stdout)
    assert set(error) == {"error", "fix", "exit_code"}
    assert error["exit_code"] == code and named in error["error"]
    assert error["fix"], error
    assert "Traceback" not in result.stderr and named in result.stderr  # people still read stderr


def test_a_command_that_printed_its_result_adds_no_second_object(tmp_path):
    """stop --json on a job whose host is down: its result names the host; exit 1; still one object."""
    home = tmp_path / "home"
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("Host deadnode\n  HostName 127.0.0.1\n  Port 1\n  ConnectTimeout 3\n")
    node = {"host": "deadnode", "node_rank": 0, "slots": 1, "container_name": "c", "job_dir": "/j", "output_dir": "/o"}
    with JobStore(home / "jobs.sqlite") as store:
        store.add(job_id="deadjob-1", name="deadjob", runtime="docker", image=None, hosts=["deadnode"],
                  spec={"name": "deadjob"}, plan={"nodes": [node]}, ssh_config=str(ssh_config))  # fmt: skip
    result = _dzctl(home, "stop", "deadjob", "--json")
    assert result.returncode == 1, result.stderr
    outcome = _one_object(result.stdout)
    assert outcome["job_id"] == "deadjob-1" and outcome["hosts"]["deadnode"].startswith("error: ")


# `launch --dry-run --json` on success: DESIGN §2's keys, the memory plan, and which of zero.config's "auto"
# values the plan filled (empty for a generated config; tests/test_user_zero_config_speed.py fills some).
DRY_RUN_KEYS = {"job", "job_id", "world_size", "master_addr", "master_port", "nodes", "memory", "ds_config_auto_filled"}


def test_a_dry_run_with_json_prints_its_contract_keys(tmp_path):
    job, hosts = str(ROOT / "jobs" / "qwen72b.yaml"), str(ROOT / "hostfiles" / "2x4.txt")
    result = _dzctl(tmp_path / "home", "launch", job, "--hosts", hosts, "--dry-run", "--json",
                    "--gpu-mem-gib", "140", "--host-mem-gib", "2048")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    shown = json.loads(result.stdout)
    assert set(shown) >= DRY_RUN_KEYS
    assert shown["ds_config_auto_filled"] == []
    # where the micro-batch and checkpointing come from: "model", or "calibration" (dzctl tune; tests/test_tune.py)
    assert shown["memory"]["choice_source"] == "model" and shown["memory"]["calibration"] is None


@pytest.mark.integration
def test_status_watch_json_prints_json_lines_until_the_job_ends(cluster, tmp_path):
    from test_stop import _record

    hosts = cluster(1)
    home = tmp_path / "home"
    job_id = "stopjob-20261130-000000-dddd"
    remote = f"/var/tmp/dzctl-watch-{hosts.cid}"
    _record(home, hosts, "process", job_id, sys.executable, remote)
    host = hosts.hosts[0]
    argv = [sys.executable, "-m", "orchestrator.runtimes.process", "start",
            "--job-dir", f"{remote}/{host.name}/jobs/{job_id}", "--rank", "0", "--", "sleep", "8"]  # fmt: skip
    started = subprocess.run(hosts.ssh_argv(host, argv), capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    result = _dzctl(home, "status", "stopjob", "--watch", "--interval", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    objects = [json.loads(line) for line in result.stdout.splitlines()]  # every line one whole object
    assert len(objects) >= 2, result.stdout
    assert objects[0]["state"] == "running" and objects[-1]["state"] == "succeeded"
    assert all(o["job_id"] == job_id for o in objects)
