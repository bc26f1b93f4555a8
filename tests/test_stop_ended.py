"""`dzctl stop` on a job whose ranks have all ended: it says so and exits 0, with nothing to stop.

The ranks are real `runtime: process` ranks on this machine (localhost, no SSH), started as
launch starts them (`python -m orchestrator.runtimes.process start`); what is under test is
stop, so each rank runs `true` (ended) or `sleep` (running) instead of training.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.observe.store import JobStore

ROOT = Path(__file__).resolve().parents[1]


def _dzctl(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DZCTL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env, timeout=180
    )


def _start_local_job(tmp_path: Path, job_id: str, *rank_argv: str) -> Path:
    job_dir = tmp_path / "remote" / "jobs" / job_id
    job_dir.mkdir(parents=True)
    node = {
        "host": "localhost", "node_rank": 0, "slots": 1, "container_name": f"dzctl-{job_id}-0",
        "job_dir": str(job_dir), "output_dir": str(tmp_path / "remote" / "output"),
    }  # fmt: skip
    with JobStore(tmp_path / "home" / "jobs.sqlite") as store:
        store.add(
            job_id=job_id, name="endedjob", runtime="process", image=None, hosts=["localhost"],
            spec={"name": "endedjob", "launch": {"python": sys.executable}}, plan={"nodes": [node]},
            ssh_config=None,
        )  # fmt: skip
        store.set_state(job_id, "running")
    argv = [sys.executable, "-m", "orchestrator.runtimes.process", "start", "--job-dir", str(job_dir),
            "--rank", "0", "--", *rank_argv]  # fmt: skip
    started = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    return job_dir


def _wait_for_state(home: Path, wanted: str) -> dict:
    deadline = time.monotonic() + 60
    while True:
        shown = _dzctl(home, "status", "endedjob", "--json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        if status["state"] == wanted or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def test_stop_on_an_ended_job_says_it_had_ended_and_exits_0(tmp_path):
    job_id = "endedjob-20261203-000000-aaaa"
    _start_local_job(tmp_path, job_id, "true")
    home = tmp_path / "home"
    assert _wait_for_state(home, "succeeded")["state"] == "succeeded"
    stopped = _dzctl(home, "stop", "endedjob")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout.strip() == f"job {job_id} had already ended (succeeded): nothing to stop"
    as_json = json.loads(_dzctl(home, "stop", "endedjob", "--json").stdout)
    assert as_json["state"] == "succeeded" and as_json["hosts"] == {"localhost": "already ended (exit 0)"}
    assert _wait_for_state(home, "succeeded")["state"] == "succeeded", "stop leaves the record's result as it was"


def test_stop_on_a_running_job_still_stops_it(tmp_path):
    job_id = "endedjob-20261203-000000-bbbb"
    job_dir = _start_local_job(tmp_path, job_id, "sleep", "600")
    pid = json.loads((job_dir / "rank-0.json").read_text())["pid"]
    home = tmp_path / "home"
    try:
        assert _wait_for_state(home, "running")["state"] == "running"
        stopped = _dzctl(home, "stop", "endedjob")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert stopped.stdout.strip() == "localhost: stopped"
        assert _wait_for_state(home, "stopped")["state"] == "stopped"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_stop_on_an_ended_job_whose_ranks_are_gone_says_it_had_ended(tmp_path):
    """The record says succeeded and the node holds no rank any more (removed after the end)."""
    job_id = "endedjob-20261203-000000-dddd"
    job_dir = tmp_path / "remote" / "jobs" / job_id
    job_dir.mkdir(parents=True)
    node = {"host": "localhost", "node_rank": 0, "slots": 1, "container_name": f"dzctl-{job_id}-0",
            "job_dir": str(job_dir), "output_dir": str(tmp_path / "remote" / "output")}  # fmt: skip
    home = tmp_path / "home"
    with JobStore(home / "jobs.sqlite") as store:
        store.add(
            job_id=job_id, name="endedjob", runtime="process", image=None, hosts=["localhost"],
            spec={"name": "endedjob", "launch": {"python": sys.executable}}, plan={"nodes": [node]}, ssh_config=None,
        )  # fmt: skip
        store.set_state(job_id, "succeeded")
    stopped = _dzctl(home, "stop", "endedjob")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout.strip() == f"job {job_id} had already ended (succeeded): nothing to stop"
    as_json = json.loads(_dzctl(home, "stop", "endedjob", "--json").stdout)
    assert as_json["hosts"] == {"localhost": "already ended (no rank left on the node)"}
