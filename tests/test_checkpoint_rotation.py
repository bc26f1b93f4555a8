"""Rotation never leaves nothing to resume from (issue 13, item 6): real ZeRO-3 on 2 CPU ranks (gloo).

The HF Trainer deletes older checkpoints at the end of its own save, and dzctl's
completeness marker came afterwards, in ``on_save``. With ``save_total_limit: 1``
a failure between the two left no complete checkpoint. Here the failure is
injected exactly there: ``checkpoint-4``'s marker cannot be written (its temporary
file's name is taken by a folder, as a full or failing disk would refuse the write).
The run must fail, keep ``checkpoint-2`` complete, and a relaunch must resume from
it and, once ``checkpoint-4`` is marked, rotate ``checkpoint-2`` away.
"""

from __future__ import annotations

import pytest
from test_train import train

from orchestrator.train import checkpoints
from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow


def test_save_total_limit_1_keeps_the_last_complete_checkpoint_through_a_failed_marker(tmp_path):
    output = tmp_path / "out"
    blocker = output / "checkpoint-4" / (checkpoints.MARKER + ".tmp")
    blocker.mkdir(parents=True)  # the marker's write at step 4 fails, after the shards are written
    sets = ("train.max_steps=4", "train.save_steps=2", "train.save_total_limit=1")

    failed = train(output, *sets)

    assert failed.returncode != 0, failed.stdout[-3000:]
    assert "saving checkpoint" in failed.stderr and "checkpoint-4" in failed.stderr, failed.stderr[-3000:]
    found = [(c.step, c.complete) for c in checkpoints.list_checkpoints(output)]
    assert found == [(2, True)], f"nothing complete left to resume from: {found}"
    assert "resume: auto continues from checkpoint-2" in failed.stderr

    before = len(read_events(output / "progress.jsonl"))
    resumed = train(output, *sets, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert f"resume from {output / 'checkpoint-2'}" in resumed.stdout
    steps = [e["step"] for e in read_events(output / "progress.jsonl")[before:] if e["event"] == "step"]
    assert steps and min(steps) > 2, steps
    # The new one is marked, so the old one went: one complete checkpoint, as the limit says.
    assert [(c.step, c.complete) for c in checkpoints.list_checkpoints(output)] == [(4, True)]
