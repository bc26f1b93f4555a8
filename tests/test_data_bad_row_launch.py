"""A row the tokenizer cannot take, through the whole product (issue 41, item 4).

Row 251 of the data holds a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, not text UTF-8 can
encode), past the 5 rows ``dzctl launch`` reads before touching a host, so only the node's builder
meets it. Before: a ``TypeError`` from the tokenizer naming no row, the rank's exit 1, and the
supervisor restarting it ``restart.max`` times. The cheapest real launch: ``dzctl launch
jobs/tiny-cpu.yaml --hosts hostfiles/localhost.txt --runtime process --follow`` (real ZeRO-3 on CPU,
2 ranks, no SSH), one optimizer step.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from test_watch_run import ROOT, _dzctl, _env, _launch_argv

from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow
SAMPLE = ROOT / "jobs" / "data" / "tiny-alpaca-zh.jsonl"


def _data(tmp_path: Path) -> Path:
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = [json.dumps({**rows[i % len(rows)], "instruction": f"{i}: {rows[i % len(rows)]['instruction']}"})
             for i in range(260)]  # fmt: skip
    lines[250] = '{"instruction": "row 251", "output": "broken \\ud800 text"}'
    path = tmp_path / "surrogate.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _launch(tmp_path: Path, *sets: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    home, remote, name = tmp_path / "home", tmp_path / "remote", f"badrow-{uuid.uuid4().hex[:6]}"
    # The collective check (~13 s here) measures links this test has no use for.
    argv = [*_launch_argv(remote, name, 1, f"data.path={_data(tmp_path)}", *sets), "--skip-collective"]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(home), capture_output=True, text=True, timeout=900)
    return proc, home, remote / "output" / name


def test_on_error_skip_trains_and_counts_the_row_as_skipped(tmp_path):
    proc, _, output = _launch(tmp_path, "data.on_error=skip")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "surrogate.jsonl:row 251: 'output' holds a lone UTF-16 surrogate \\ud800" in text, text[-3000:]
    assert "259 examples, 1 rows skipped" in text, text[-3000:]
    assert [e["step"] for e in read_events(output / "progress.jsonl") if e["event"] == "step"] == [1]


def test_without_skip_the_rank_exits_2_naming_the_row_and_nothing_restarts(tmp_path):
    proc, home, _ = _launch(tmp_path, "restart.max=2", "restart.backoff_s=0")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]  # the rank refused the job's own input: bad input, as at the controller
    assert "surrogate.jsonl:row 251: 'output' holds a lone UTF-16 surrogate \\ud800" in text, text[-3000:]
    assert "TypeError" not in text, text[-3000:]
    assert "a restart cannot fix input-error" in text and "restarted as" not in text, text[-3000:]
    job_id = re.search(r"started (\S+) on", text).group(1)
    argv = [*_dzctl(), "status", job_id, "--json"]
    status = subprocess.run(argv, cwd=ROOT, env=_env(home), capture_output=True, text=True, timeout=120)
    found = json.loads(status.stdout)
    assert found["first_failure"]["exit_code"] == 2, found["first_failure"]
    assert found["restarts"]["count"] == 0 and len(found["restarts"]["attempts"]) == 1, found["restarts"]
