"""A rank that fails with its own error and fix, in a real run of the tiny job (process runtime, 2 ranks).

The data file sits at an absolute path (shared storage: read on the node), its first rows good and a
later one missing its ``output``: the controller's check of the first rows passes, and rank 0's data
builder fails on the bad row (exit 2, with the fix), its peer after it. Checked: what ``launch``
prints (plain lines), what ``status --watch`` replays, and the live view drawn from the node's real
log, each showing the rank's message once, its fix, exit 2, and none of torchrun's traceback.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.observe.view import render
from orchestrator.observe.watchstate import JobWatch, NodeView

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
BAD_ROW = 7
MESSAGE = re.compile(rf"bad\.jsonl:row {BAD_ROW}: missing key 'output'")
FIX = "fix the row, set data.format (and data.columns) to what the file holds, or set data.on_error: skip"
TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "torch.distributed.elastic", "Root Cause", "exitcode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dzctl(env: dict, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failure-view")
    rows = (ROOT / "jobs" / "data" / "tiny-alpaca-zh.jsonl").read_text(encoding="utf-8").splitlines()
    data = tmp / "bad.jsonl"
    data.write_text("\n".join([*rows[: BAD_ROW - 1], '{"instruction": "no answer here"}', *rows[BAD_ROW:]]) + "\n")
    remote, name = tmp / "remote", f"fail-{uuid.uuid4().hex[:6]}"
    sets = [f"name={name}", f"launch.remote_dir={remote}", f"launch.master_port={_free_port()}",
            f"launch.python={sys.executable}", f"data.path={data}"]  # fmt: skip
    env = {**os.environ, "DZCTL_HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT)}
    # --skip-collective: the failure is the ranks' own, and no test here reads the check (about 6 s a launch).
    argv = ["launch", "jobs/tiny-cpu.yaml", "--hosts", "hostfiles/localhost.txt", "--runtime", "process",
            "--follow", "--skip-collective", *(x for s in sets for x in ("--set", s))]  # fmt: skip
    launch = _dzctl(env, *argv, timeout=900)  # stdout is a pipe: the plain lines
    job_id = re.search(r"started (\S+) on", launch.stdout + launch.stderr).group(1)
    status = _dzctl(env, "status", job_id, "--json")
    return {"env": env, "job_id": job_id, "launch": launch, "status": status, "job_dir": remote / "jobs" / job_id}


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(word in line for word in TORCHRUN_NOISE)]


def test_launch_says_the_ranks_message_once_with_its_fix_and_exit_code(failed_run):
    launch = failed_run["launch"]
    out = launch.stdout + launch.stderr
    # The rank refused the job's own data (exit 2): the launch is bad input too (issue 41 item 4).
    assert launch.returncode == 2, out[-4000:]
    assert len(MESSAGE.findall(out)) == 1, out[-4000:]
    lines = out.splitlines()
    error = next(line for line in lines if MESSAGE.search(line))
    assert error.startswith(f"error: job {failed_run['job_id']} failed: node 0 (localhost), rank ")
    assert ", exit 2: " in error, error
    # The last line is the rank's own fix, not "read the logs".
    assert lines[-1] == f"fix: {FIX}", lines[-6:]
    assert out.count(FIX) == 1, out[-4000:]
    assert not _noise(out), _noise(out)


def test_status_reports_the_ranks_exit_code_and_fix(failed_run):
    status = json.loads(failed_run["status"].stdout)
    failure = status["first_failure"]
    assert status["state"] == "failed" and failure["node_rank"] == 0, failure
    assert failure["exit_code"] == 2 and failure["node_exit_code"] == 1, failure  # the rank's; torchrun's
    assert MESSAGE.search(failure["message"]) and failure["fix"] == FIX, failure
    assert failure["rank"] in (0, 1)


def test_status_watch_replays_the_failure_once_at_the_end(failed_run):
    proc = _dzctl(failed_run["env"], "status", failed_run["job_id"], "--watch")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(MESSAGE.findall(proc.stdout)) == 1, lines
    assert lines[-3].startswith(f"failed  {failed_run['job_id']} after "), lines[-4:]
    assert lines[-2].startswith("first failure: node 0 (localhost), rank ") and ", exit 2: " in lines[-2]
    assert lines[-1] == f"fix: {FIX}"
    assert not _noise(proc.stdout), _noise(proc.stdout)


def test_the_live_view_of_the_real_log_has_the_failure_once_at_the_top(failed_run):
    log = (failed_run["job_dir"] / "rank-0.log").read_text(encoding="utf-8", errors="replace")
    assert "ChildFailedError" in log and "Traceback" in log  # what there was to fold: torchrun's report
    watch = JobWatch("tiny-cpu", failed_run["job_id"], [NodeView(0, "localhost", 2)], started_at=0.0,
                     accelerator="cpu")  # fmt: skip
    for line in log.splitlines():
        watch.feed(0, line, 1.0)
    status = json.loads(failed_run["status"].stdout)
    watch.first_failure, watch.ended_at = status["first_failure"], 5.0
    watch.set_nodes({0: ("exited", 1)}, "failed")
    console = Console(file=io.StringIO(), width=400, color_system=None)
    console.print(render(watch, now=5.0))
    lines = [line.rstrip() for line in console.file.getvalue().splitlines()]
    assert lines[0].startswith(f"{failed_run['job_id']}  FAILED")
    assert lines[1].startswith("first failure: node 0 (localhost), rank ") and MESSAGE.search(lines[1]), lines
    assert lines[2] == f"fix: {FIX}", lines
    assert sum(bool(MESSAGE.search(line)) for line in lines) == 1, lines
    assert not _noise("\n".join(lines)), lines
