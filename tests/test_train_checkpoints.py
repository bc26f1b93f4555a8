"""Checkpoint completeness, resume choice, consolidated-weights check, progress events (no torch).

The layouts here are the ones DeepSpeed 0.19 + the HF Trainer write (checked
against the real run in tests/test_train.py, which also inspects its own output).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from orchestrator.train import checkpoints
from orchestrator.train.checkpoints import CheckpointError, IncompleteWeights
from orchestrator.train.progress import KEYS, ProgressLog, finite, make_event, read_events


def make_checkpoint(
    out: Path, step: int, world: int, *, marker: bool = True, drop: str | None = None, lineage: str = "run-a"
) -> Path:
    path = out / f"checkpoint-{step}"
    shards = path / f"global_step{step}"
    shards.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (path / "latest").write_text(f"global_step{step}")
    for rank in range(world):
        for name in (
            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
            f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        ):
            if name != drop:
                (shards / name).write_bytes(b"x")
    if marker:
        checkpoints.write_marker(path, world, step, lineage=lineage)
    return path


def test_complete_checkpoint(tmp_path):
    path = make_checkpoint(tmp_path, 10, 4)
    found = checkpoints.inspect(path)
    assert (found.complete, found.step, found.world_size) == (True, 10, 4)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"marker": False}, "dzctl-complete.json missing: the save did not finish on every rank"),
        ({"drop": "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"}, "optimizer shards for ranks [2] missing"),
        ({"drop": "zero_pp_rank_0_mp_rank_00_model_states.pt"}, "model-state shards for ranks [0] missing"),
    ],
)
def test_incomplete_checkpoints(tmp_path, kwargs, problem):
    found = checkpoints.inspect(make_checkpoint(tmp_path, 5, 3, **kwargs))
    assert not found.complete and found.problem == problem


def test_resume_auto_takes_newest_complete(tmp_path):
    make_checkpoint(tmp_path, 10, 2)
    make_checkpoint(tmp_path, 20, 2)
    make_checkpoint(tmp_path, 30, 2, marker=False)  # a save cut short by a crash
    chosen = checkpoints.choose_resume("auto", tmp_path, 2)
    assert chosen is not None and chosen.step == 20


def test_a_checkpoint_past_max_steps_is_refused(tmp_path):
    """A longer run's checkpoint in the same output dir: resuming it would train nothing and save
    that run's weights as this run's model (seen: "end step 32/30")."""
    make_checkpoint(tmp_path, 30, 2)
    assert checkpoints.choose_resume("auto", tmp_path, 2, max_steps=31).step == 30
    assert checkpoints.choose_resume("auto", tmp_path, 2, max_steps=0).step == 30  # epochs decide, not steps
    make_checkpoint(tmp_path, 32, 2)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.choose_resume("auto", tmp_path, 2, max_steps=30)
    assert "step 32, past this run's train.max_steps 30" in err.value.message
    assert "train.output_dir" in err.value.fix and "above 32" in err.value.fix


def test_resume_auto_with_nothing_starts_fresh(tmp_path):
    assert checkpoints.choose_resume("auto", tmp_path / "none-yet", 2) is None
    make_checkpoint(tmp_path, 10, 2, marker=False)  # cut short: nobody can resume it, a fresh run may replace it
    assert checkpoints.choose_resume("never", tmp_path, 2) is None


def test_resume_other_world_size_refused_with_conversion(tmp_path):
    path = make_checkpoint(tmp_path, 10, 4)
    with pytest.raises(CheckpointError) as err:
        checkpoints.choose_resume("auto", tmp_path, 2)
    assert "written by 4 data-parallel ranks; this run has 2" in err.value.message
    assert "deepspeed.checkpoint.ds_to_universal" in err.value.fix
    assert f"--input_folder {path / 'global_step10'}" in err.value.fix
    assert "load_universal: true" in err.value.fix
    assert err.value.exit_code == 2
    # Once converted (zero.overrides.checkpoint.load_universal), the same checkpoint is taken.
    assert checkpoints.choose_resume("auto", tmp_path, 2, load_universal=True).path == path


def test_resume_explicit_path(tmp_path):
    path = make_checkpoint(tmp_path, 7, 2)
    assert checkpoints.choose_resume(str(path), tmp_path, 2).step == 7
    broken = make_checkpoint(tmp_path, 8, 2, marker=False)
    with pytest.raises(CheckpointError, match="is incomplete"):
        checkpoints.choose_resume(str(broken), tmp_path, 2)
    with pytest.raises(CheckpointError, match="is not a folder"):
        checkpoints.choose_resume(str(tmp_path / "nope"), tmp_path, 2)


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A real safetensors file (header + float32 zeros), written by the format's spec."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def test_consolidated_complete(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": [4, 8], "b.bias": [8]})
    checkpoints.check_consolidated(tmp_path, {"a.weight": [4, 8], "b.bias": [8]})


def test_consolidated_reads_the_real_format(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3, 5), "e": torch.zeros(0)}, str(tmp_path / "model.safetensors"))
    assert checkpoints.safetensors_shapes(tmp_path) == {"w": [3, 5], "e": [0]}


def test_consolidated_empty_tensors_fail_loudly(tmp_path):
    # ZeRO-3's classic bug: each rank's empty placeholder saved instead of the gathered weight.
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a.weight": [0]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b.weight": [2, 2]})
    with pytest.raises(IncompleteWeights) as err:
        checkpoints.check_consolidated(tmp_path, {"a.weight": [4, 8], "b.weight": [2, 2], "c.weight": [1]})
    assert "1 empty tensors (e.g. a.weight)" in err.value.message
    assert "1 tensors missing (e.g. c.weight)" in err.value.message
    assert "stage3_gather_16bit_weights_on_model_save" in err.value.fix


def test_consolidated_wrong_shape_and_no_file(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": [4, 4]})
    with pytest.raises(IncompleteWeights, match=r"wrong shapes \(e.g. a.weight: \[4, 4\] != \[4, 8\]\)"):
        checkpoints.check_consolidated(tmp_path, {"a.weight": [4, 8]})
    with pytest.raises(IncompleteWeights, match=r"no \.safetensors file"):
        checkpoints.check_consolidated(tmp_path / "empty", {})


def test_progress_events_have_every_contract_key(tmp_path, capsys):
    log = ProgressLog(tmp_path / "out" / "progress.jsonl")
    log.write("start", step=0, max_steps=30)
    log.write("step", step=1, max_steps=30, loss=finite(float("nan")), learning_rate=1e-3)
    log.write("error", reason="DataError: x.jsonl:row 3: missing key 'output'", rank=1)
    events = read_events(tmp_path / "out" / "progress.jsonl")
    assert [e["event"] for e in events] == ["start", "step", "error"]
    for event in events:
        assert list(event)[: len(KEYS)] == list(KEYS)
    assert events[1]["loss"] is None  # JSON has no NaN
    assert events[2]["reason"].startswith("DataError") and events[2]["rank"] == 1
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[0].startswith("dzctl-progress {")


def test_unknown_event_refused():
    with pytest.raises(ValueError):
        make_event("finished")


def node_local_checkpoint(out: Path, step: int, node_ranks: list[int], world: int, *, latest: bool) -> Path:
    """What one node's own disk holds after a node-local save: only its ranks' shards."""
    path = out / f"checkpoint-{step}"
    shards = path / f"global_step{step}"
    shards.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if latest:  # DeepSpeed writes `latest` from global rank 0 only
        (path / "latest").write_text(f"global_step{step}")
    for rank in node_ranks:
        (shards / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"x")
        (shards / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x")
    return path


def test_node_local_checkpoint_is_complete_with_its_own_ranks(tmp_path):
    path = node_local_checkpoint(tmp_path, 8, [2, 3], 4, latest=False)
    assert not checkpoints.inspect(path).complete  # no `latest`, no marker yet
    checkpoints.write_latest_tag(path)
    checkpoints.write_marker(path, 4, 8, ranks=[2, 3], lineage="run-a")
    found = checkpoints.inspect(path)
    assert (found.complete, found.world_size) == (True, 4)
    assert (path / "latest").read_text() == "global_step8"
    # A marker that claims a rank whose shards are not here is not complete.
    checkpoints.write_marker(path, 4, 8, ranks=[1, 2, 3], lineage="run-a")
    assert "ranks [1] missing" in checkpoints.inspect(path).problem


def test_nodes_agree_on_the_newest_step_they_all_hold(tmp_path):
    for step in (4, 8):
        make_checkpoint(tmp_path, step, 2)
    mine = checkpoints.choose_resume("auto", tmp_path, 2)
    assert checkpoints.agree_on_resume(mine, [8, 8], tmp_path, "n0").step == 8
    # The other node's marker for step 8 was never written (a crash between the two).
    assert checkpoints.agree_on_resume(mine, [8, 4], tmp_path, "n0").step == 4
    with pytest.raises(CheckpointError, match="disagree"):
        checkpoints.agree_on_resume(mine, [8, None], tmp_path, "n0")
    assert checkpoints.agree_on_resume(None, [None, None], tmp_path, "n0") is None


# -- the manifest: sizes, not names alone (issue 13, item 6) ---------------------------------------
def test_marker_lists_every_file_with_its_size(tmp_path):
    path = make_checkpoint(tmp_path, 10, 2)
    marker = json.loads((path / checkpoints.MARKER).read_text())
    assert marker["files"] == {
        "global_step10/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": 1,
        "global_step10/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,
        "global_step10/zero_pp_rank_0_mp_rank_00_model_states.pt": 1,
        "global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt": 1,
        "latest": len("global_step10"),
        "trainer_state.json": len(json.dumps({"global_step": 10})),
    }


def test_a_truncated_shard_makes_the_checkpoint_incomplete(tmp_path):
    make_checkpoint(tmp_path, 10, 2)
    newest = make_checkpoint(tmp_path, 20, 2)
    shard = newest / "global_step20" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shard.write_bytes(b"")  # every name is still there: only the size tells
    found = checkpoints.inspect(newest)
    assert not found.complete
    assert found.problem == (
        "global_step20/zero_pp_rank_1_mp_rank_00_model_states.pt is 0 bytes, dzctl-complete.json says 1: "
        "cut short or changed after the save"
    )
    assert checkpoints.choose_resume("auto", tmp_path, 2).step == 10


def test_a_file_of_the_manifest_gone_makes_the_checkpoint_incomplete(tmp_path):
    path = make_checkpoint(tmp_path, 10, 2)
    (path / "trainer_state.json").unlink()
    (path / "trainer_state.json").write_text("{}")  # rewritten, other size
    assert "trainer_state.json is 2 bytes" in checkpoints.inspect(path).problem
    (path / "latest").rename(path / "latest.old")
    assert not checkpoints.inspect(path).complete


# -- rotation: after the successor is complete, never before --------------------------------------
def test_rotate_keeps_the_newest_complete_ones(tmp_path):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step, 2)
    removed = checkpoints.rotate(tmp_path, 1, "run-a")
    assert [p.name for p in removed] == ["checkpoint-10", "checkpoint-20"]
    assert [(c.step, c.complete) for c in checkpoints.list_checkpoints(tmp_path)] == [(30, True)]


def test_rotate_keeps_the_last_complete_while_the_newest_is_unmarked(tmp_path):
    make_checkpoint(tmp_path, 10, 2)
    make_checkpoint(tmp_path, 20, 2, marker=False)  # written, not yet marked: a save in progress or cut short
    assert checkpoints.rotate(tmp_path, 1, "run-a") == []
    assert [(c.step, c.complete) for c in checkpoints.list_checkpoints(tmp_path)] == [(10, True), (20, False)]


def test_rotate_clears_unmarked_ones_older_than_what_it_keeps(tmp_path):
    make_checkpoint(tmp_path, 10, 2, marker=False)  # a crash long ago
    make_checkpoint(tmp_path, 20, 2)
    make_checkpoint(tmp_path, 30, 2)
    removed = checkpoints.rotate(tmp_path, 2, "run-a")
    assert [p.name for p in removed] == ["checkpoint-10"]
    assert [c.step for c in checkpoints.list_checkpoints(tmp_path)] == [20, 30]


def test_marker_and_folder_are_synced(tmp_path, monkeypatch):
    import os

    path = make_checkpoint(tmp_path, 10, 2, marker=False)
    synced = []
    real_fsync = os.fsync

    def watching_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watching_fsync)
    checkpoints.write_marker(path, 2, 10, lineage="run-a")
    assert str(path / "global_step10" / "zero_pp_rank_0_mp_rank_00_model_states.pt") in synced  # the shards first
    assert synced[-2:] == [str(path / (checkpoints.MARKER + ".tmp")), str(path)]  # the marker, then its folder


# -- lineages: a run never deletes or resumes another run's checkpoints (issue 28, item 2) ---------
def test_the_marker_names_the_run_and_inspect_reads_it(tmp_path):
    path = make_checkpoint(tmp_path, 10, 2, lineage="run-b")
    assert json.loads((path / checkpoints.MARKER).read_text())["lineage"] == "run-b"
    assert checkpoints.inspect(path).lineage == "run-b"
    # A marker written before dzctl recorded lineages: one line of its own, resumable as before.
    marker = json.loads((path / checkpoints.MARKER).read_text())
    del marker["lineage"]
    (path / checkpoints.MARKER).write_text(json.dumps(marker))
    found = checkpoints.inspect(path)
    assert found.complete and found.lineage == checkpoints.UNRECORDED


def test_rotate_deletes_only_its_own_runs_checkpoints(tmp_path):
    """The reviewer's case: an earlier run's checkpoints 20..50 beside a new run's checkpoint-10."""
    for step in (20, 30, 40, 50):
        make_checkpoint(tmp_path, step, 2, lineage="old")
    make_checkpoint(tmp_path, 10, 2, lineage="new")
    assert checkpoints.rotate(tmp_path, 2, "new") == []  # was: checkpoint-10, -20 and -30 deleted
    for step in (60, 70):
        make_checkpoint(tmp_path, step, 2, lineage="new")
    assert [p.name for p in checkpoints.rotate(tmp_path, 2, "new")] == ["checkpoint-10"]
    found = [(c.step, c.lineage, c.complete) for c in checkpoints.list_checkpoints(tmp_path)]
    assert found == [(s, "old", True) for s in (20, 30, 40, 50)] + [(60, "new", True), (70, "new", True)]


def test_rotate_keeps_a_damaged_checkpoint_of_another_run(tmp_path):
    damaged = make_checkpoint(tmp_path, 10, 2, lineage="old")
    (damaged / "global_step10" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    make_checkpoint(tmp_path, 15, 2, marker=False)  # nobody's: a save cut short before its marker
    for step in (20, 30):
        make_checkpoint(tmp_path, step, 2, lineage="new")
    assert [p.name for p in checkpoints.rotate(tmp_path, 1, "new")] == ["checkpoint-15", "checkpoint-20"]
    assert damaged.is_dir()


def test_resume_never_over_another_runs_checkpoints_is_refused(tmp_path):
    for step in (10, 20, 30, 40, 50):
        make_checkpoint(tmp_path, step, 2, lineage="old")
    with pytest.raises(CheckpointError) as err:
        checkpoints.choose_resume("never", tmp_path, 2)
    assert err.value.message == (
        f"train.resume: never, but {tmp_path} holds complete checkpoints of an earlier run "
        "(checkpoint-10 to checkpoint-50, 5 in all): a fresh run there would overwrite them by name "
        "and rotate them away"
    )
    assert "give this run its own train.output_dir" in err.value.fix
    assert "train.resume: auto" in err.value.fix
    assert err.value.exit_code == 2
    assert [c.complete for c in checkpoints.list_checkpoints(tmp_path)] == [True] * 5


def test_resume_path_to_an_older_checkpoint_beside_newer_ones_is_refused(tmp_path):
    out = tmp_path / "out"
    for step in (10, 20, 30):
        make_checkpoint(out, step, 2, lineage="old")
    with pytest.raises(CheckpointError) as err:
        checkpoints.choose_resume(str(out / "checkpoint-10"), out, 2)
    assert err.value.message == (
        f"train.resume: {out / 'checkpoint-10'} is at step 10, but {out} also holds newer checkpoints "
        "(checkpoint-20, checkpoint-30): continuing from step 10 there would overwrite them by name and "
        "rotate them away"
    )
    assert "give this run its own train.output_dir" in err.value.fix
    # The same branch in an output dir of its own: taken, and it continues that checkpoint's line.
    branch = tmp_path / "branch"
    chosen = checkpoints.choose_resume(str(out / "checkpoint-10"), branch, 2)
    assert (chosen.step, chosen.lineage) == (10, "old")
    # ... unless that dir holds another run's checkpoints.
    make_checkpoint(branch, 5, 2, lineage="other")
    with pytest.raises(CheckpointError, match=r"holds checkpoints of another run \(checkpoint-5\)"):
        checkpoints.choose_resume(str(out / "checkpoint-10"), branch, 2)


def test_resume_auto_continues_its_own_line(tmp_path):
    for step in (10, 20):
        make_checkpoint(tmp_path, step, 2, lineage="old")
    assert checkpoints.choose_resume("auto", tmp_path, 2).path == tmp_path / "checkpoint-20"
    assert checkpoints.choose_resume(str(tmp_path / "checkpoint-20"), tmp_path, 2).step == 20


def test_a_checkpoint_about_to_be_rewritten_loses_its_marker_first(tmp_path, monkeypatch):
    """A same-shape rewrite keeps every size: an old marker left there would vouch for mixed files."""
    path = make_checkpoint(tmp_path, 20, 2, lineage="run-a")
    seen = []
    real_rmtree = checkpoints.shutil.rmtree

    def watching_rmtree(target, **kwargs):
        seen.append((Path(target), (path / checkpoints.MARKER).exists()))
        return real_rmtree(target, **kwargs)

    monkeypatch.setattr(checkpoints.shutil, "rmtree", watching_rmtree)
    assert checkpoints.clear_for_rewrite(path, "run-a") is True
    assert seen == [(path, False)] and not path.exists()
    assert checkpoints.clear_for_rewrite(path, "run-a") is False  # nothing there: nothing to do
    # Another run's complete checkpoint is never cleared, whoever asks.
    other = make_checkpoint(tmp_path, 30, 2, lineage="run-b")
    with pytest.raises(CheckpointError, match="belongs to another run"):
        checkpoints.clear_for_rewrite(other, "run-a")
    assert checkpoints.inspect(other).complete


# -- a relaunch of a run that trained to its end (issue 27, item 1) --------------------------------
def _finish(out: Path, step: int, *, max_steps: int, epochs: float = 1.0, lineage: str = "run-a") -> Path:
    model = out / "model"
    model.mkdir()
    checkpoints.write_finished(out, lineage=lineage, step=step, max_steps=max_steps, epochs=epochs, model=model)
    return model


def test_a_relaunch_of_a_finished_run_finds_it_finished(tmp_path):
    make_checkpoint(tmp_path, 20, 2)
    make_checkpoint(tmp_path, 30, 2)
    model = _finish(tmp_path, 30, max_steps=30)
    start = checkpoints.resume_candidate("auto", tmp_path)
    done = checkpoints.finished_run(start, max_steps=30, epochs=1.0)
    assert done == checkpoints.Finished("run-a", 30, 30, 1.0, str(model))
    # The same, named by path; and from another output dir (a branch from it would train nothing either).
    final = tmp_path / "checkpoint-30"
    assert checkpoints.finished_run(checkpoints.resume_candidate(str(final), tmp_path / "other"), 30, 1.0) == done
    # More steps continue that run.
    assert checkpoints.finished_run(start, max_steps=40, epochs=1.0) is None
    assert checkpoints.choose_resume("auto", tmp_path, 2, max_steps=40).step == 30
    # The record names another checkpoint (an older finish, then more training): not finished here.
    assert (
        checkpoints.finished_run(checkpoints.resume_candidate(str(tmp_path / "checkpoint-20"), tmp_path), 20, 1.0)
        is None
    )
    assert checkpoints.finished_run(None, max_steps=30, epochs=1.0) is None


def test_a_finished_run_by_epochs_is_finished_for_as_many_epochs_and_continues_for_more(tmp_path):
    make_checkpoint(tmp_path, 27, 2)
    _finish(tmp_path, 27, max_steps=-1, epochs=3.0)
    start = checkpoints.resume_candidate("auto", tmp_path)
    assert checkpoints.finished_run(start, max_steps=-1, epochs=3.0).step == 27
    assert checkpoints.finished_run(start, max_steps=-1, epochs=4.0) is None


def test_a_record_of_another_lineage_does_not_finish_this_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 30, 2, lineage="run-b")
    _finish(tmp_path, 30, max_steps=30, lineage="run-a")
    assert checkpoints.finished_run(checkpoints.resume_candidate("auto", tmp_path), 30, 1.0) is None


def test_a_checkpoint_at_max_steps_without_its_model_is_refused(tmp_path):
    """Trained to the end, the model never written (killed while consolidating): resuming would train step N+1."""
    final = make_checkpoint(tmp_path, 30, 2)
    with pytest.raises(CheckpointError) as err:
        checkpoints.choose_resume("auto", tmp_path, 2, max_steps=30)
    assert err.value.message == (
        f"checkpoint {final} is at this run's train.max_steps 30: nothing is left to train, and no model of it "
        "is there: the run that trained it did not finish writing it, or it was removed"
    )
    assert f"python -m deepspeed.utils.zero_to_fp32 {final} " in err.value.fix
    assert "raise train.max_steps above 30" in err.value.fix
    # A model recorded but gone since: the same refusal, from the rank that would show it.
    model = _finish(tmp_path, 30, max_steps=30)
    model.rmdir()
    start = checkpoints.resume_candidate("auto", tmp_path)
    assert checkpoints.finished_run(start, 30, 1.0, model_here=True) is None
    assert checkpoints.finished_run(start, 30, 1.0, model_here=False).step == 30  # another node: not its disk
