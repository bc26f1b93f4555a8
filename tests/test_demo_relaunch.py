"""The quick start three times in a row (issue 27, item 1): each run exits 0, and a relaunch says what it did.

What ``./dev demo`` runs (``dzctl launch jobs/tiny-cpu.yaml --hosts hostfiles/localhost.txt
--runtime process --follow``: real ZeRO-3, 2 ranks, no SSH), with ``train.max_steps=2``
(the smallest run that saves a checkpoint and a model), three times into one output
folder. Before: the second run resumed the final checkpoint and trained step 3/2 over
the first run's model; the third failed on that checkpoint-3 as "written by a longer run".
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid

import pytest
from test_watch_run import ROOT, _env, _launch_argv

from orchestrator.train import checkpoints
from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow
STEPS = 2


def _model_digest(model) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(model.glob("*.safetensors")))).hexdigest()


def test_the_demo_run_three_times_trains_once_and_then_says_it_is_complete(tmp_path):
    home, remote, name = tmp_path / "home", tmp_path / "remote", f"demo-{uuid.uuid4().hex[:6]}"
    output = remote / "output" / name
    runs = []
    for _ in range(3):
        # The first run is the demo's own launch; the relaunches skip the collective check (about 6 s each):
        # it measures the links before any rank starts, and no assertion here reads it.
        argv = _launch_argv(remote, name, STEPS) + (["--skip-collective"] if runs else [])
        proc = subprocess.run(argv, cwd=ROOT, env=_env(home), capture_output=True, text=True, timeout=900)
        runs.append(proc)
        assert proc.returncode == 0, f"run {len(runs)} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
        if len(runs) == 1:
            digest = _model_digest(output / "model")
    first, *relaunches = runs
    assert f"end  step {STEPS}/{STEPS}" in first.stdout
    for relaunch in relaunches:
        text = relaunch.stdout
        assert (
            f"dzctl-train: already complete: {STEPS} steps, model at {output / 'model'}; nothing to train "
            "(a larger train.max_steps continues this run, a new train.output_dir starts a fresh one)"
        ) in text, text[-3000:]
        assert f"end  step {STEPS}/{STEPS}" in text and f"model {output / 'model'}" in text
        assert f"step {STEPS + 1}/" not in text and "resuming at step" not in text
        assert text.splitlines()[-1].startswith("succeeded  ")
    # One run trained; its checkpoint and its model are as it left them.
    events = read_events(output / "progress.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, STEPS + 1))
    ends = [e for e in events if e["event"] == "end"]
    assert [e.get("already_complete", False) for e in ends] == [False, True, True]
    assert [(c.step, c.complete) for c in checkpoints.list_checkpoints(output)] == [(STEPS, True)]
    assert _model_digest(output / "model") == digest
    finished = json.loads((output / checkpoints.FINISHED).read_text())
    assert (finished["step"], finished["model"]) == (STEPS, str(output / "model"))
    # A larger max_steps continues that run from its final checkpoint.
    more = subprocess.run(
        [*_launch_argv(remote, name, STEPS + 1), "--skip-collective"],
        cwd=ROOT, env=_env(home), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert more.returncode == 0, (more.stdout + more.stderr)[-3000:]
    assert f"resuming at step {STEPS}" in more.stdout and f"step {STEPS + 1}/{STEPS + 1}" in more.stdout
