"""A run never deletes or resumes another run's checkpoints (issue 28, item 2): real ZeRO-3 on 2 CPU ranks.

One real run of jobs/tiny-cpu.yaml leaves checkpoint-1 … checkpoint-4 (one line, its
lineage id in every marker) and its model. Then, each in a copy of that folder:

- ``resume: never`` there is refused before training (exit 2, the fix named): it would
  write checkpoint-1 … over the earlier run's and rotate the rest away (the reviewer saw
  rotation delete the new run's own checkpoint-10 instead, and ``auto`` then pick the
  old run's checkpoint-50);
- ``resume: PATH`` to the older checkpoint-2, beside the newer 3 and 4, is refused the same way;
  the same branch into an output dir of its own trains, continues that checkpoint's lineage,
  and leaves the original folder as it was;
- a checkpoint-N the trainer writes again (here checkpoint-4, damaged, after a resume from
  checkpoint-3) has lost its old marker before the Trainer writes a byte into it: a wrapper
  around the HF Trainer's own save records, on every rank, whether the marker was there.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
from test_train import ROOT, train

from orchestrator.train import checkpoints
from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow

FIRST = ("train.max_steps=4", "train.save_steps=1", "train.save_total_limit=4")

# The trainer, with the HF Trainer's checkpoint save wrapped to note whether a marker was
# already in the folder it is about to write (after dzctl's own preparation of that folder).
WATCH_SAVES = textwrap.dedent(
    """\
    import json, os, sys
    from pathlib import Path

    sys.path.insert(0, {root!r})
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as entry's early_defaults would, before torch imports
    from transformers import Trainer

    from orchestrator.train import entry

    real_save = Trainer._save_checkpoint

    def watched_save(self, model, trial):
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{{self.state.global_step}}"
        seen = {{"step": self.state.global_step, "marker": (folder / "dzctl-complete.json").exists()}}
        with open({record!r} + f".rank{{os.environ['RANK']}}", "a") as out:
            out.write(json.dumps(seen) + "\\n")
        return real_save(self, model, trial)

    Trainer._save_checkpoint = watched_save
    entry.exit_rank(entry.main(sys.argv[1:]))  # as the trainer's ranks end: see exit_rank
    """
)


def _markers(output: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in sorted(output.glob(f"checkpoint-*/{checkpoints.MARKER}"))}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("lineage") / "out"
    result = train(output, *FIRST)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    found = checkpoints.list_checkpoints(output)
    assert [(c.step, c.complete) for c in found] == [(step, True) for step in (1, 2, 3, 4)]
    return output


def _lineage(output: Path) -> str:
    """The one lineage every marker of the folder names."""
    names = {json.loads(text).get("lineage") for text in _markers(output).values()}
    assert len(names) == 1 and None not in names, names
    return names.pop()


def _copy(first_run, tmp_path: Path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(first_run, copy)
    return copy


def test_resume_never_over_an_earlier_runs_checkpoints_is_refused_and_deletes_nothing(first_run, tmp_path):
    copy = _copy(first_run, tmp_path)
    before = _markers(copy)
    events = len(read_events(copy / "progress.jsonl"))
    result = train(copy, "train.max_steps=4", "train.save_steps=1", "train.save_total_limit=2", "train.resume=never")
    # Bad input: each rank exits 2 (torchrun itself then exits 1).
    assert result.returncode != 0 and "(exitcode: 2)" in result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"error: train.resume: never, but {copy} holds complete checkpoints of an earlier run" in result.stderr
    assert "fix: give this run its own train.output_dir" in result.stderr
    assert (
        "[rank0]:Traceback" not in result.stderr and "[rank1]:Traceback" not in result.stderr
    )  # (torchrun's own aside)
    assert _markers(copy) == before  # every checkpoint as the first run left it
    new = read_events(copy / "progress.jsonl")[events:]
    assert {e["event"] for e in new} == {"error"}, new  # nothing trained


def test_resume_path_to_an_older_checkpoint_is_refused_beside_newer_ones(first_run, tmp_path):
    copy = _copy(first_run, tmp_path)
    before = _markers(copy)
    older = copy / "checkpoint-2"
    result = train(copy, "train.max_steps=6", "train.save_steps=1", "train.save_total_limit=2", f"train.resume={older}")
    # Bad input: each rank exits 2 (torchrun itself then exits 1).
    assert result.returncode != 0 and "(exitcode: 2)" in result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"error: train.resume: {older} is at step 2, but {copy} also holds newer checkpoints" in result.stderr
    assert "give this run its own train.output_dir (the branch from step 2 goes there)" in result.stderr
    assert _markers(copy) == before


def test_a_branch_into_its_own_output_dir_continues_the_line_and_leaves_the_original_whole(first_run, tmp_path):
    original = first_run
    lineage = _lineage(original)
    before = _markers(original)
    branch = tmp_path / "branch"
    result = train(
        branch,
        "train.max_steps=4",
        "train.save_steps=1",
        "train.save_total_limit=1",
        f"train.resume={original / 'checkpoint-2'}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"checkpoint line {lineage} (continued from step 2)" in result.stdout
    assert [e["step"] for e in read_events(branch / "progress.jsonl") if e["event"] == "step"] == [3, 4]
    found = checkpoints.list_checkpoints(branch)
    assert [(c.step, c.complete, c.lineage) for c in found] == [(4, True, lineage)]
    assert _markers(original) == before


def test_a_checkpoint_written_again_has_lost_its_old_marker_before_the_trainer_writes(first_run, tmp_path):
    copy = _copy(first_run, tmp_path)
    # checkpoint-4 damaged (a shard cut short): resume: auto takes checkpoint-3, and step 4 is saved
    # again into that folder, where the old marker still lies.
    shard = copy / "checkpoint-4" / "global_step4" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    assert not checkpoints.inspect(copy / "checkpoint-4").complete
    assert (copy / "checkpoint-4" / checkpoints.MARKER).exists()
    record = tmp_path / "saves"
    script = tmp_path / "watch_saves.py"
    script.write_text(WATCH_SAVES.format(root=str(ROOT), record=str(record)), encoding="utf-8")
    result = train(copy, *FIRST, "train.resume=auto", script=script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"resume from {copy / 'checkpoint-3'}" in result.stdout
    for rank in (0, 1):
        seen = [json.loads(line) for line in Path(f"{record}.rank{rank}").read_text().splitlines()]
        assert seen == [{"step": 4, "marker": False}], (rank, seen)
    rewritten = checkpoints.inspect(copy / "checkpoint-4")
    assert rewritten.complete and rewritten.lineage == _lineage(first_run)
