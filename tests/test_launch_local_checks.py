"""`dzctl launch` checks what it can on this machine before it touches any host (issue 13, item 4).

Against real test hosts (sshd per network namespace, LogLevel VERBOSE): a launch
whose data file is missing exits 2 naming the spec line, no SSH connection reaches
any host (their sshd logs say so), and no job is recorded. And ``data.path:
synthetic:random`` (the trainer's throughput source) launches: nothing to ship,
real ZeRO-3 on CPU, one rank on each of two hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def _dzctl(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DZCTL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _launch(hosts, tmp_path: Path, data_path: str, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    job = tmp_path / "job.yaml"
    text = (ROOT / "jobs" / "tiny-cpu.yaml").read_text(encoding="utf-8")
    job.write_text(text.replace("path: data/tiny-alpaca-zh.jsonl", f"path: {data_path}"), encoding="utf-8")
    hostfile = hosts.write_hostfile(tmp_path / "hosts.txt", slots=1)
    remote = tmp_path / "remote"
    sets = [
        f"name=localcheck-{tmp_path.name[-10:]}".lower().replace("_", "-"),
        f"launch.remote_dir={remote}/{{host}}",  # the test hosts share one filesystem
        "launch.master_port=29623",
        "runtime=process",
        f"launch.python={sys.executable}",  # this venv: torch, DeepSpeed and this checkout, on every host
        "train.max_steps=2",
        "train.save_steps=100",
    ]
    args = [item for s in sets for item in ("--set", s)]
    return _dzctl(
        tmp_path / "home", "launch", str(job), "--hosts", str(hostfile), "--ssh-config", str(hosts.ssh_config),
        *args, *extra, timeout=timeout,
    )  # fmt: skip


def _line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), start=1) if text in line)


def _sshd_connections(hosts) -> dict[str, int]:
    """How many SSH logins each host's sshd has logged so far.

    Logins, not "Connection from" lines: the cluster's own start-up check opens a
    bare TCP connection to each port (logged a moment later, asynchronously); every
    dzctl connection logs in with its key.
    """
    counts = {}
    for host in hosts.hosts:
        log = (host.dir / "sshd.log").read_text(errors="replace")
        counts[host.name] = log.count("Accepted publickey for ")
    return counts


def _recorded_jobs(home: Path) -> list[dict]:
    listed = _dzctl(home, "status", "--json", timeout=60)
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)["jobs"]


def test_missing_data_file_touches_no_host_and_records_no_job(cluster, tmp_path):
    hosts = cluster(2)
    before = _sshd_connections(hosts)

    done = _launch(hosts, tmp_path, "no-such-data.jsonl", "--detach")

    assert done.returncode == 2, done.stderr
    line = _line_of(tmp_path / "job.yaml", "path: no-such-data.jsonl")
    assert f"{tmp_path / 'job.yaml'}:{line}: data.path: " in done.stderr, done.stderr
    assert "no-such-data.jsonl no such file" in done.stderr and "fix: " in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "preflight" not in done.stderr.lower(), "preflight ran before the data file was checked"
    assert _sshd_connections(hosts) == before, "an SSH connection reached a host for a launch that was refused"
    assert _recorded_jobs(tmp_path / "home") == [], "an input error left a job record"


def test_a_directory_as_data_is_refused_before_the_hosts(cluster, tmp_path):
    hosts = cluster(1)
    (tmp_path / "rows").mkdir()
    before = _sshd_connections(hosts)
    done = _launch(hosts, tmp_path, "rows", "--detach")
    assert done.returncode == 2 and "data.path: " in done.stderr and "rows is not a file" in done.stderr, done.stderr
    assert _sshd_connections(hosts) == before
    assert _recorded_jobs(tmp_path / "home") == []


@pytest.mark.slow
def test_synthetic_data_launches_with_nothing_to_ship(cluster, tmp_path):
    hosts = cluster(2)
    done = _launch(hosts, tmp_path, "synthetic:random", "--follow", "--json", timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    status = json.loads(done.stdout)
    assert status["state"] == "succeeded" and status["progress"]["step"] == 2, status
    remote = tmp_path / "remote"
    for host in hosts.hosts:
        job_dirs = list((remote / host.name / "jobs").iterdir())
        assert len(job_dirs) == 1, job_dirs
        assert not (job_dirs[0] / "data").exists(), "synthetic data ships no file"
        assert "path: synthetic:random" in (job_dirs[0] / "job.yaml").read_text()


def test_a_format_mismatch_is_refused_before_the_hosts(cluster, tmp_path):
    hosts = cluster(1)
    rows = [{"conversations": [{"from": "human", "value": "你好"}, {"from": "gpt", "value": "你好！"}]}] * 3
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    before = _sshd_connections(hosts)
    done = _launch(hosts, tmp_path, "chat.jsonl", "--detach")
    assert done.returncode == 2, done.stderr
    assert (
        "data.path: chat.jsonl:row 1: missing key 'instruction'; the row has 'conversations': set data.format: sharegpt"
        in done.stderr
    ), done.stderr
    assert _sshd_connections(hosts) == before
    assert _recorded_jobs(tmp_path / "home") == []
