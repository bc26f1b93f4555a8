"""Secrets through a real launch, on this machine, with no test hosts.

``dzctl launch jobs/tiny-cpu.yaml --hosts hostfiles/localhost.txt --runtime process``
runs locally without SSH or Docker (the embedded default), so the whole path a
secret takes can be watched here: the 0600 env file in the job directory, every
process's command line while the job runs (what ``ps`` shows on a node), the
ranks' environment (the secret must arrive), ``dzctl status``/``logs`` output,
and the local SQLite job record. Real training (ZeRO-3 on CPU, two steps), so
this is marked slow.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOKEN = "Zx9-launch-token-$(id)-q7"  # hostile on purpose: it must stay inert as well as hidden
FROM_FILE = "Zx9-from-env-file-q7"
SECRETS = {"HF_TOKEN": TOKEN, "S3_CREDENTIALS": FROM_FILE}
RUN_LIMIT_S = 600  # a loaded 2-core box; the run itself takes well under a minute of CPU

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dzctl(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _cmdlines_mentioning(marker: str) -> dict[int, bytes]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # the process ended while we looked
        if marker.encode() in cmdline:
            found[int(entry.name)] = cmdline
    return found


def _environ(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return b""


def test_secrets_reach_the_ranks_and_nowhere_else(tmp_path):
    home, remote = tmp_path / "home", tmp_path / "remote"
    (tmp_path / "secrets.env").write_text(f"S3_CREDENTIALS={FROM_FILE}\n", encoding="utf-8")
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "jobs" / "tiny-cpu.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    env = {**os.environ, "DZCTL_HOME": str(home)}
    started = _dzctl(
        env,
        "launch", str(job), "--hosts", str(REPO / "hostfiles" / "localhost.txt"), "--runtime", "process",
        "--detach", "--json",
        "--set", f"data.path={REPO / 'jobs' / 'data' / 'tiny-alpaca-zh.jsonl'}",
        "--set", f"launch.remote_dir={remote}",
        "--set", f"launch.python={sys.executable}",
        "--set", f"launch.master_port={_free_port()}",
        "--set", "launch.env_file=secrets.env",
        "--set", f"launch.env.HF_TOKEN='{TOKEN}'",
        "--set", "train.max_steps=2",
        "--set", "train.save_steps=1000",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    job_id = json.loads(started.stdout)["job_id"]
    outputs = [started.stdout, started.stderr]

    # While it runs: every process of the job, as `ps` would list it, and the ranks' environment.
    cmdlines: dict[int, bytes] = {}
    environs: list[bytes] = []
    deadline = time.monotonic() + RUN_LIMIT_S
    state = "running"
    while time.monotonic() < deadline:
        seen = _cmdlines_mentioning(job_id)
        cmdlines.update(seen)
        environs += [_environ(pid) for pid, line in seen.items() if b"orchestrator.train" in line]
        status = _dzctl(env, "status", job_id, "--json")
        outputs += [status.stdout, status.stderr]
        if status.returncode == 0 and json.loads(status.stdout)["state"] not in ("pending", "running"):
            state = json.loads(status.stdout)["state"]
            break
        time.sleep(1)
    else:
        _dzctl(env, "stop", job_id)
        pytest.fail(f"job {job_id} did not finish within {RUN_LIMIT_S} s")
    logs = _dzctl(env, "logs", job_id)
    outputs += [logs.stdout, logs.stderr]
    assert state == "succeeded", f"the job {state}: {logs.stdout[-2000:]}"

    # The secrets arrived, byte for byte: a rank's environment holds them (so the checks
    # below are not vacuous, and the `$(id)` in the token reached it unexpanded, inert).
    assert cmdlines, "no process of the job was ever seen"
    assert any(f"HF_TOKEN={TOKEN}".encode() in e and f"S3_CREDENTIALS={FROM_FILE}".encode() in e for e in environs), (
        "no rank received the secrets in its environment"
    )
    # ... through the job directory's env file, readable by its owner only.
    job_dir = remote / "jobs" / job_id
    env_file = job_dir / "env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert env_file.read_text(encoding="utf-8") == f"HF_TOKEN={TOKEN}\nS3_CREDENTIALS={FROM_FILE}\n"

    # And nowhere else.
    places = {f"command line of pid {pid}": line for pid, line in cmdlines.items()}
    places.update({f"job file {p.name}": p.read_bytes() for p in job_dir.rglob("*") if p.is_file() and p != env_file})
    places.update({f"dzctl output {i}": text.encode() for i, text in enumerate(outputs)})
    places.update({f"job record {p.name}": p.read_bytes() for p in home.rglob("*") if p.is_file()})
    assert any(name.startswith("job record") for name in places), f"no job record under {home}"
    for where, content in places.items():
        for name, value in SECRETS.items():
            assert value.encode() not in content, f"secret {name} found in {where}"
