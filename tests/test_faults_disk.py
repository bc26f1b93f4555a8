"""Disk full on the output folder at checkpoint time (issue 8): a clear failure, the previous checkpoint intact.

The real run: a 4 MiB tmpfs as the output folder of jobs/tiny-cpu.yaml on 2 CPU
ranks (real DeepSpeed ZeRO-3), saving every 2 steps. checkpoint-2 (~2.4 MiB)
fits; checkpoint-4 does not. The run must stop (no hang) with an ``error`` event
naming "No space left on device", the folder and the fix; the half-written
checkpoint-4 is gone, checkpoint-2 is complete and ``resume: auto`` picks it;
after the tmpfs is grown (remount), a relaunch continues from step 2 to the end.

The pure tests pin the cleanup's rules: a folder with the completeness marker is
never removed, and every rank of a launch reports the first rank's verdict.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_train import _steps, train

from orchestrator.train import checkpoints
from orchestrator.train.progress import read_events

SMALL = 4 * 2**20  # one checkpoint (~2.4 MiB) and the progress log fit; a second does not
BIG = 64 * 2**20


def _fake_checkpoint(output: Path, step: int, *, complete: bool) -> Path:
    """A checkpoint-N folder that inspect() calls complete (2 ranks) or not (no marker)."""
    path = output / f"checkpoint-{step}"
    shards = path / f"global_step{step}"
    shards.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}", encoding="utf-8")
    (path / "latest").write_text(f"global_step{step}", encoding="utf-8")
    for rank in range(2):
        (shards / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"m" * 1000)
        (shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 1000)
    if complete:
        checkpoints.write_marker(path, 2, step, lineage="run-a")
    return path


def test_remove_incomplete_never_touches_a_complete_checkpoint(tmp_path):
    done = _fake_checkpoint(tmp_path, 2, complete=True)
    half = _fake_checkpoint(tmp_path, 4, complete=False)
    other = tmp_path / "model"
    other.mkdir()
    assert checkpoints.remove_incomplete(done) is False and checkpoints.inspect(done).complete
    assert checkpoints.remove_incomplete(other) is False and other.is_dir()  # not a checkpoint-N folder
    assert checkpoints.remove_incomplete(half) is True and not half.exists()


def test_save_failed_names_the_full_disk_removes_the_half_and_keeps_the_whole(tmp_path):
    _fake_checkpoint(tmp_path, 2, complete=True)
    half = _fake_checkpoint(tmp_path, 4, complete=False)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    error = checkpoints.save_failed(half, full, run_id="run-a")
    assert isinstance(error, checkpoints.SaveFailed) and error.exit_code == 1
    assert f"saving checkpoint {half} failed: No space left on device on {tmp_path}" in error.message
    assert "the incomplete checkpoint-4 was removed; resume: auto continues from checkpoint-2" in error.message
    assert error.fix.startswith(f"free space on {tmp_path} (a checkpoint here takes 0.0 MiB)")
    assert "save_total_limit" in error.fix
    assert not half.exists()
    assert checkpoints.choose_resume("auto", tmp_path, 2).path == tmp_path / "checkpoint-2"
    # Another rank of the same launch, failing later because its peer left: it reports the same cause.
    peer = checkpoints.save_failed(half, RuntimeError("Connection closed by peer"), run_id="run-a")
    assert (peer.message, peer.fix) == (error.message, error.fix)
    # A later launch judges afresh (the note is not taken for a new failure).
    again = checkpoints.save_failed(half, RuntimeError("Input/output error"), run_id="run-b")
    assert "No space left" not in again.message and "RuntimeError: Input/output error" in again.message
    # A successful save clears the note.
    checkpoints.write_marker(tmp_path / "checkpoint-2", 2, 2, lineage="run-a")
    assert not (tmp_path / checkpoints.SAVE_FAILED_NOTE).exists()


def test_save_failed_keeps_a_checkpoint_whose_marker_was_written(tmp_path):
    done = _fake_checkpoint(tmp_path, 6, complete=True)
    # e.g. the "checkpoint" progress line failed after the marker: the checkpoint itself is whole.
    error = checkpoints.save_failed(done, OSError(errno.ENOSPC, "No space left on device"), run_id="r")
    assert "checkpoint-6 is complete and kept" in error.message
    assert checkpoints.inspect(done).complete


def test_disk_full_sees_enospc_in_the_cause_chain_but_not_other_errors(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file") from inner
    except RuntimeError as outer:
        assert checkpoints.disk_full(outer, tmp_path)
    assert not checkpoints.disk_full(RuntimeError("connection reset"), tmp_path)  # tmp_path has room


# -- the real trainer on a full tmpfs ------------------------------------------------------------


def _require_root() -> None:
    if os.geteuid() == 0 and shutil.which("mount"):
        return
    reason = "mounting a tmpfs needs root"
    if os.environ.get("DZCTL_REQUIRE_INTEGRATION") == "1":
        pytest.fail(reason + " (DZCTL_REQUIRE_INTEGRATION=1)")
    pytest.skip(reason)


@pytest.fixture
def small_disk(tmp_path):
    _require_root()
    mount = tmp_path / "out"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)  # a straggler still holds a file


@pytest.mark.integration
@pytest.mark.slow
def test_disk_full_at_checkpoint_fails_clearly_and_the_previous_checkpoint_resumes(small_disk):
    output = small_disk
    result = train(output, "train.max_steps=4", "train.save_steps=2")
    ended = time.time()
    assert result.returncode != 0, result.stdout[-3000:]
    events = read_events(output / "progress.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and "end" not in kinds, kinds
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2]
    errors = [e for e in events if e["event"] == "error"]
    assert errors, kinds
    last = errors[-1]
    half = output / "checkpoint-4"
    assert f"saving checkpoint {half} failed: No space left on device on {output}" in last["reason"], last
    assert "resume: auto continues from checkpoint-2" in last["reason"]
    assert f"(fix: free space on {output} (a checkpoint here takes " in last["reason"]
    assert "No space left on device" in result.stderr and "fix: free space on" in result.stderr
    # No hang: the launcher ended soon after the failure (not at gloo's 30-minute timeout).
    assert ended - last["time"] < 90, ended - last["time"]

    # The half-written checkpoint is gone; the previous one is complete and is what resume: auto takes.
    assert not half.exists()
    found = checkpoints.list_checkpoints(output)
    assert [(c.step, c.complete) for c in found] == [(2, True)], found
    chosen = checkpoints.choose_resume("auto", output, 2)
    assert chosen is not None and chosen.path == output / "checkpoint-2"
    marker = json.loads((chosen.path / checkpoints.MARKER).read_text(encoding="utf-8"))
    assert (marker["world_size"], marker["step"]) == (2, 2) and marker["files"] == checkpoints.manifest(chosen.path)
    # The scenario is the one meant: one checkpoint fits the disk, two do not.
    size = sum(p.stat().st_size for p in chosen.path.rglob("*") if p.is_file())
    assert size < SMALL < 2 * size, size

    # More room (the tmpfs grown in place), then a relaunch: it continues from step 2 to the end.
    subprocess.run(["mount", "-o", f"remount,size={BIG}", str(output)], check=True)
    again = train(output, "train.max_steps=4", "train.save_steps=2")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
    later = read_events(output / "progress.jsonl")[len(events) :]
    assert later[0]["event"] == "start" and later[0]["step"] == 2, later[:1]
    assert [e["step"] for e in _steps(later)] == [3, 4]
    assert later[-1]["event"] == "end" and later[-1]["path"] == str(output / "model")
    assert [(c.step, c.complete) for c in checkpoints.list_checkpoints(output)] == [(2, True), (4, True)]
    assert not (output / checkpoints.SAVE_FAILED_NOTE).exists()
