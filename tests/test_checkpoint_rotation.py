"""Rotation never leaves nothing to resume from (issue 13, item 6): real ZeRO-3 on 2 CPU ranks (gloo).

The HF Trainer deletes older checkpoints at the end of its own save, and dzctl's
completeness marker came afterwards, in ``on_save``. With ``save_total_limit: 1``
a failure between the two left no complete checkpoint. Here the failure is
injected exactly there, in every rank: writing ``checkpoint-4``'s marker raises
EIO, as a failing disk would (a ``sitecustomize`` on the ranks' PYTHONPATH wraps
``checkpoints.write_marker``; the rest is the real trainer). The run must fail,
keep ``checkpoint-2`` complete, and a relaunch must resume from it and, once
``checkpoint-4`` is marked, rotate ``checkpoint-2`` away.
"""

from __future__ import annotations

import os
import textwrap

import pytest
from test_train import train

from orchestrator.train import checkpoints
from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow

FAIL_MARKER_AT_STEP_4 = textwrap.dedent(
    """\
    import errno
    from orchestrator.train import checkpoints

    real_write_marker = checkpoints.write_marker

    def failing_write_marker(checkpoint_dir, world_size, step, *args, **kwargs):
        if step == 4:
            raise OSError(errno.EIO, "Input/output error (injected by the test)", str(checkpoint_dir))
        return real_write_marker(checkpoint_dir, world_size, step, *args, **kwargs)

    checkpoints.write_marker = failing_write_marker
    """
)


def test_save_total_limit_1_keeps_the_last_complete_checkpoint_through_a_failed_marker(tmp_path, monkeypatch):
    output = tmp_path / "out"
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAIL_MARKER_AT_STEP_4, encoding="utf-8")
    sets = ("train.max_steps=4", "train.save_steps=2", "train.save_total_limit=1")

    with monkeypatch.context() as patched:
        patched.setenv("PYTHONPATH", os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]))
        failed = train(output, *sets)

    assert failed.returncode != 0, failed.stdout[-3000:]
    assert "injected by the test" in failed.stderr, failed.stderr[-3000:]  # the failure was the one meant
    assert f"saving checkpoint {output / 'checkpoint-4'} failed" in failed.stderr, failed.stderr[-3000:]
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
