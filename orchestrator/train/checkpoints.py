"""Checkpoints on disk: which are complete, which to resume, whether saved weights are whole (no torch).

A Trainer checkpoint under ZeRO-3 is ``<output_dir>/checkpoint-<step>/`` holding
``trainer_state.json``, ``latest`` (the DeepSpeed tag) and
``global_step<step>/`` with, per data-parallel rank R,
``zero_pp_rank_R_mp_rank_00_model_states.pt`` and
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``. After every rank has
written its part the trainer writes ``dzctl-complete.json`` (world size, step,
and a manifest: every file of the folder with its size), after syncing those
files, then the marker and the folder, to disk. A checkpoint cut short by a
crash lacks the marker, or a file of its manifest, or has one of another size
(a truncated shard), and is never resumed.

Rotation (``train.save_total_limit``) is dzctl's, not the HF Trainer's: the
Trainer deletes older checkpoints at the end of its own save, before dzctl's
marker exists, so a failure in between would leave nothing complete. ``rotate``
runs only once every node has marked the new checkpoint complete.

One output directory holds one line of checkpoints (a *lineage*). A run that
starts fresh draws a new lineage id; one that resumes continues the lineage of
the checkpoint it resumes; every marker names it. Step numbers alone cannot tell
runs apart: a fresh run's ``checkpoint-10`` has the name of an earlier run's, and
rotation by step would delete the new run's own. So a run refuses to start where
complete checkpoints it does not continue lie (``resume: never`` over an earlier
run's, ``resume: PATH`` to one with newer ones beside it): it would overwrite them
by name. Rotation deletes only its own lineage's checkpoints, and a folder about to
be written again loses its marker before any file of it changes.

A run that trained to its end and wrote its model records that in
``dzctl-finished.json`` beside its checkpoints. A relaunch whose resume is that
final checkpoint, asking for no more steps (or epochs), has nothing to train: it
says so and ends well (``finished_run``), where the HF Trainer would train one step
past ``max_steps`` and save it as ``checkpoint-<max_steps + 1>``. A run that early
stopping ended is finished as well, for as long as no more steps or epochs are asked.

``train.save_best``: ``dzctl-best.json`` beside the checkpoints names the one with the
best eval loss (``{"checkpoint": "checkpoint-N", "step": N, "eval_loss": x}``, and its
lineage). It is written once that checkpoint is marked complete on every node, and
rotation never deletes the checkpoint it names (it does not count towards
``save_total_limit``); a newer best replaces it, and the old one rotates as any other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, RuntimeFailure

MARKER = "dzctl-complete.json"
FINISHED = "dzctl-finished.json"
BEST = "dzctl-best.json"
# The lineage of a marker written before dzctl recorded one: those checkpoints form one line.
UNRECORDED = "unrecorded"
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
OPTIM_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
MODEL_SHARD = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$")


class CheckpointError(InputError):
    """A checkpoint cannot be resumed as asked (wrong world size, incomplete, missing)."""


class SaveFailed(RuntimeFailure):
    """A checkpoint could not be written (the disk full, above all); its incomplete folder was removed."""


class IncompleteWeights(RuntimeFailure):
    """Saved model weights are missing or empty (ZeRO-3 partitions not gathered)."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    world_size: int | None  # data-parallel ranks that wrote it; None when incomplete
    problem: str | None  # why it is incomplete, None when complete
    lineage: str | None = None  # the run line its marker names; None without a readable marker

    @property
    def complete(self) -> bool:
        return self.problem is None


def inspect(path: Path) -> Checkpoint:
    """Look at one ``checkpoint-N`` folder and say whether it is complete, and for how many ranks."""
    match = CHECKPOINT_DIR.match(path.name)
    step = int(match.group(1)) if match else -1
    if not (path / "trainer_state.json").is_file():
        return Checkpoint(path, step, None, "trainer_state.json missing")
    latest = path / "latest"
    if not latest.is_file():
        return Checkpoint(path, step, None, "no DeepSpeed 'latest' file (not a ZeRO checkpoint)")
    tag = latest.read_text(encoding="utf-8").strip()
    shards_dir = path / tag
    if not shards_dir.is_dir():
        return Checkpoint(path, step, None, f"'latest' names {tag}, which is missing")
    names = [p.name for p in shards_dir.iterdir()]
    optim = {int(m.group(1)) for n in names if (m := OPTIM_SHARD.match(n))}
    model = {int(m.group(1)) for n in names if (m := MODEL_SHARD.match(n))}
    declared = None
    marker = path / MARKER
    if marker.is_file():
        try:
            content = json.loads(marker.read_text(encoding="utf-8"))
            declared = int(content["world_size"])
            # On node-local storage each node holds only its own ranks' shards.
            expected = {int(r) for r in content.get("ranks", range(declared))}
            lineage = str(content.get("lineage", UNRECORDED))
        except (ValueError, KeyError, TypeError):
            return Checkpoint(path, step, None, f"{MARKER} unreadable")
    else:
        return Checkpoint(path, step, None, f"{MARKER} missing: the save did not finish on every rank")
    # Names alone miss a shard cut short (a crash, a full disk, a half-finished copy): sizes catch it.
    # A marker without a manifest (written before dzctl kept one) is judged by names only.
    problem = _manifest_problem(path, content.get("files"))
    if problem:
        return Checkpoint(path, step, None, problem, lineage)
    if optim != expected:
        problem = f"optimizer shards for ranks {sorted(expected - optim)} missing"
        return Checkpoint(path, step, None, problem, lineage)
    if model != expected:
        problem = f"model-state shards for ranks {sorted(expected - model)} missing"
        return Checkpoint(path, step, None, problem, lineage)
    return Checkpoint(path, step, declared, None, lineage)


def list_checkpoints(output_dir: Path) -> list[Checkpoint]:
    """Every ``checkpoint-N`` in ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [inspect(p) for p in output_dir.iterdir() if p.is_dir() and CHECKPOINT_DIR.match(p.name)]
    return sorted(found, key=lambda c: c.step)


def choose_resume(
    resume: str, output_dir: Path, world_size: int, *, load_universal: bool = False, max_steps: int = 0
) -> Checkpoint | None:
    """The checkpoint to continue from: ``auto`` (newest complete, or none), ``never``, or a path.

    ``resume_candidate`` then ``check_resume``: see both.
    """
    chosen = resume_candidate(resume, output_dir)
    return check_resume(chosen, resume, output_dir, world_size, load_universal=load_universal, max_steps=max_steps)


def resume_candidate(resume: str, output_dir: Path) -> Checkpoint | None:
    """What ``train.resume`` names: the newest complete checkpoint (``auto``), none (``never``), or a path."""
    if resume == "never":
        return None
    if resume == "auto":
        complete = [c for c in list_checkpoints(output_dir) if c.complete]
        return complete[-1] if complete else None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"train.resume: {path} is not a folder", fix="name a checkpoint-N folder, or auto")
    chosen = inspect(path)
    if not chosen.complete:
        raise CheckpointError(f"train.resume: {path} is incomplete: {chosen.problem}", fix="resume an older one")
    return chosen


def check_resume(
    chosen: Checkpoint | None,
    resume: str,
    output_dir: Path,
    world_size: int,
    *,
    load_universal: bool = False,
    max_steps: int = 0,
) -> Checkpoint | None:
    """Refuse, before any model is built, a start that would harm another run or fail later.

    Refused: complete checkpoints in ``output_dir`` that this start does not continue
    (see ``refuse_other_lines``); a checkpoint past ``max_steps``; one written by another
    number of data-parallel ranks (DeepSpeed would otherwise fail deep inside loading).
    ``load_universal`` (``zero.overrides.checkpoint.load_universal``): the user
    converted it with ds_to_universal, which loads on any number of ranks.
    """
    refuse_other_lines(chosen, resume, output_dir)
    if chosen is None:
        return None
    if max_steps > 0 and chosen.step > max_steps:
        # Another, longer run left it in this output dir (the default dir is per job name): resuming
        # would train nothing and save that run's weights as this one's ("step 32/30").
        raise CheckpointError(
            f"checkpoint {chosen.path} is at step {chosen.step}, past this run's train.max_steps {max_steps}: "
            "it was written by a longer run into the same output directory",
            fix=f"raise train.max_steps above {chosen.step} to continue that run, or give this run its own "
            f"train.output_dir (or delete the checkpoint-* folders in {chosen.path.parent})",
        )
    if max_steps > 0 and chosen.step == max_steps:
        # A finished run's relaunch ends before this (finished_run); here its model is missing.
        raise CheckpointError(
            f"checkpoint {chosen.path} is at this run's train.max_steps {max_steps}: nothing is left to train, "
            "and no model of it is there: the run that trained it did not finish writing it, or it was removed",
            fix=f"write the model from it: python -m deepspeed.utils.zero_to_fp32 {chosen.path} "
            f"{chosen.path.parent / 'model-fp32'} --safe_serialization; or raise train.max_steps above "
            f"{max_steps} to train on (the model is written at the end)",
        )
    if chosen.world_size != world_size and not load_universal:
        raise CheckpointError(
            f"checkpoint {chosen.path} was written by {chosen.world_size} data-parallel ranks; "
            f"this run has {world_size}. ZeRO-3 shards only load on the same number of ranks.",
            fix=universal_fix(chosen),
        )
    return chosen


def agree_on_resume(
    mine: Checkpoint | None, all_steps: list[int | None], output_dir: Path, node: str
) -> Checkpoint | None:
    """Every node must resume from the same step: the newest one that all of them hold complete.

    ``all_steps``: each rank's own choice (None: nothing to resume). Nodes can differ
    only if a run died between the nodes' markers; then the older common step is taken.
    """
    if all(step == (mine.step if mine else None) for step in all_steps):
        return mine
    if any(step is None for step in all_steps):
        raise CheckpointError(
            f"{node}: the nodes disagree on what to resume: newest complete checkpoint per rank {all_steps} "
            "(None: none found); a node's output dir was lost or replaced",
            fix="restore the missing node's output dir, or give the run a new train.output_dir to start over",
        )
    target = min(s for s in all_steps if s is not None)
    chosen = inspect(output_dir / f"checkpoint-{target}")
    if not chosen.complete:
        raise CheckpointError(
            f"{node}: the nodes' newest complete checkpoints differ ({sorted(set(all_steps))}) and "
            f"checkpoint-{target} is not complete here: {chosen.problem}",
            fix="give the run a new train.output_dir to start over",
        )
    return chosen


@dataclass(frozen=True)
class Finished:
    """A run that trained to its end and wrote its model (``dzctl-finished.json``)."""

    lineage: str
    step: int  # its final checkpoint's
    max_steps: int  # train.max_steps it ran with (-1: epochs decided)
    epochs: float
    model: str  # the model folder, as rank 0 wrote it
    stopped_early: bool = False  # train.early_stopping ended it before max_steps (or its epochs)


def write_finished(
    output_dir: Path,
    *,
    lineage: str,
    step: int,
    max_steps: int,
    epochs: float,
    model: Path,
    stopped_early: bool = False,
) -> None:
    """Record that this lineage trained to ``step`` and its model is written (call once the model is checked)."""
    record = {"lineage": lineage, "step": step, "max_steps": max_steps, "epochs": epochs, "model": str(model)}
    if stopped_early:
        record["stopped_early"] = True
    _write_durably(output_dir / FINISHED, record)


def _write_durably(path: Path, record: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(record))
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    _fsync_path(path.parent)


@dataclass(frozen=True)
class Best:
    """``dzctl-best.json``: the checkpoint of the best eval loss so far (``train.save_best``)."""

    step: int
    eval_loss: float
    lineage: str

    @property
    def checkpoint(self) -> str:
        return f"checkpoint-{self.step}"


def write_best(output_dir: Path, best: Best) -> None:
    """Name the best checkpoint (call once it is marked complete on every node)."""
    record = {"checkpoint": best.checkpoint, "step": best.step, "eval_loss": best.eval_loss, "lineage": best.lineage}
    _write_durably(output_dir / BEST, record)


def read_best(output_dir: Path, lineage: str | None = None) -> Best | None:
    """The best checkpoint's record (only ``lineage``'s when given); None when there is none or it is unreadable."""
    try:
        record = json.loads((output_dir / BEST).read_text(encoding="utf-8"))
        best = Best(int(record["step"]), float(record["eval_loss"]), str(record.get("lineage", UNRECORDED)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return best if lineage is None or best.lineage == lineage else None


def read_finished(output_dir: Path) -> Finished | None:
    try:
        record = json.loads((output_dir / FINISHED).read_text(encoding="utf-8"))
        return Finished(
            str(record["lineage"]),
            int(record["step"]),
            int(record["max_steps"]),
            float(record["epochs"]),
            str(record["model"]),
            bool(record.get("stopped_early", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, or unreadable: the run is not known to be finished


def finished_run(
    chosen: Checkpoint | None, max_steps: int, epochs: float, *, model_here: bool = False
) -> Finished | None:
    """The finished run this start would only repeat: ``chosen`` is its final checkpoint and no more is asked.

    No more: ``train.max_steps`` at that checkpoint's step; with epochs deciding
    (``max_steps`` -1), no more epochs than that run had. ``model_here``: this rank
    is the one that holds the model (global rank 0): it must still be there.
    """
    if chosen is None:
        return None
    done = read_finished(chosen.path.parent)
    if done is None or (done.lineage, done.step) != (chosen.lineage, chosen.step):
        return None
    if model_here and not Path(done.model).is_dir():
        return None
    if done.stopped_early:
        # Early stopping ended it short of its max_steps: finished while no more is asked than then.
        return done if max_steps == done.max_steps and epochs <= done.epochs else None
    if max_steps > 0:
        return done if chosen.step == max_steps else None
    return done if done.max_steps <= 0 and epochs <= done.epochs else None


def refuse_other_lines(chosen: Checkpoint | None, resume: str, output_dir: Path) -> None:
    """Refuse to start where complete checkpoints lie that a run starting from ``chosen`` does not continue.

    Such a run would write ``checkpoint-N`` folders of the same names over them and
    rotate the rest away. A run continues the checkpoints of ``chosen``'s lineage up to
    its step; nothing when it starts fresh. Incomplete folders are nobody's to resume:
    they may be replaced.
    """
    others = [c for c in list_checkpoints(output_dir) if c.complete and not continues(chosen, c)]
    if not others:
        return
    names = _names(others)
    if chosen is None:
        raise CheckpointError(
            f"train.resume: {resume}, but {output_dir} holds complete checkpoints of an earlier run ({names}): "
            "a fresh run there would overwrite them by name and rotate them away",
            fix="give this run its own train.output_dir, or set train.resume: auto to continue that run; "
            f"to discard it, delete the checkpoint-* folders in {output_dir} first",
        )
    newer = [c for c in others if c.step > chosen.step]
    if newer:
        raise CheckpointError(
            f"train.resume: {chosen.path} is at step {chosen.step}, but {output_dir} also holds newer checkpoints "
            f"({_names(newer)}): continuing from step {chosen.step} there would overwrite them by name and "
            "rotate them away",
            fix=f"keep train.resume and give this run its own train.output_dir (the branch from step "
            f"{chosen.step} goes there), or delete the newer checkpoint-* folders to abandon them",
        )
    raise CheckpointError(
        f"{output_dir} holds checkpoints of another run ({names}) than {chosen.path} (run {chosen.lineage}): "
        "continuing there would rotate them away",
        fix=f"give this run its own train.output_dir, or move the other run's checkpoint-* folders out of {output_dir}",
    )


def continues(chosen: Checkpoint | None, checkpoint: Checkpoint) -> bool:
    """Whether a run starting from ``chosen`` continues ``checkpoint``: same lineage, at or before its step."""
    return chosen is not None and checkpoint.lineage == chosen.lineage and checkpoint.step <= chosen.step


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


def _names(found: list[Checkpoint]) -> str:
    names = [c.path.name for c in found]
    if len(names) > 3:
        return f"{names[0]} to {names[-1]}, {len(names)} in all"
    return ", ".join(names)


def universal_fix(checkpoint: Checkpoint) -> str:
    tag = (checkpoint.path / "latest").read_text(encoding="utf-8").strip()
    shards = checkpoint.path / tag
    return (
        "run on the original number of GPUs, or convert it to a universal checkpoint: "
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {shards} "
        f"--output_folder {shards}_universal, write {tag}_universal into {checkpoint.path / 'latest'}, "
        "then set zero.overrides: {checkpoint: {load_universal: true}} and train.resume: "
        f"{checkpoint.path}"
    )


def write_latest_tag(checkpoint_dir: Path) -> None:
    """Write DeepSpeed's ``latest`` file on this node if global rank 0 (another node) did not.

    DeepSpeed 0.19 writes ``latest`` from global rank 0 only, even with
    ``use_node_local_storage``; without it the ranks of other nodes cannot find
    their own shards when resuming from their node's disk.
    """
    if (checkpoint_dir / "latest").is_file():
        return
    tags = sorted(p.name for p in checkpoint_dir.iterdir() if p.is_dir() and p.name.startswith("global_step"))
    if tags:
        (checkpoint_dir / "latest").write_text(tags[-1], encoding="utf-8")


def write_marker(
    checkpoint_dir: Path, world_size: int, step: int, ranks: list[int] | None = None, *, lineage: str
) -> None:
    """Record that every rank finished writing this checkpoint (call after a barrier).

    ``ranks``: the ranks whose shards are in this folder, when it is one node's own
    disk (``train.output_storage: node-local``); all of them when omitted.
    ``lineage``: the run line it belongs to (see the module's notes).
    The marker lists every file with its size, and is written only once those files
    are on disk (fsync): after a power cut it never vouches for data still in a cache.
    """
    files = manifest(checkpoint_dir)
    for name in files:
        _fsync_path(checkpoint_dir / name)
    for folder in {(checkpoint_dir / name).parent for name in files}:
        _fsync_path(folder)
    content: dict = {"world_size": world_size, "step": step, "lineage": lineage}
    if ranks is not None:
        content["ranks"] = ranks
    content["files"] = files
    tmp = checkpoint_dir / (MARKER + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(content))
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(checkpoint_dir / MARKER)  # atomic: a reader sees all of it or nothing
    _fsync_path(checkpoint_dir)  # the rename itself, durable
    # A save has worked again: an earlier failure's note is history.
    (checkpoint_dir.parent / SAVE_FAILED_NOTE).unlink(missing_ok=True)


def manifest(checkpoint_dir: Path) -> dict[str, int]:
    """Every file of a checkpoint folder (relative path → size in bytes), the marker aside."""
    found = {}
    for item in sorted(checkpoint_dir.rglob("*")):
        name = item.relative_to(checkpoint_dir).as_posix()
        if item.is_file() and not name.startswith(MARKER):
            found[name] = item.stat().st_size
    return found


def _manifest_problem(path: Path, files: object) -> str | None:
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"{MARKER}: its manifest is unreadable"
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} missing (listed in {MARKER})"
        if actual != size:
            return f"{name} is {actual} bytes, {MARKER} says {size}: cut short or changed after the save"
    return None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotate(output_dir: Path, keep: int, lineage: str, *, protect: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints of ``lineage``, and incomplete ones older than those.

    Called once the newest checkpoint is marked complete on every node, by the rank
    that marks this folder: the one being replaced is deleted only after its
    successor can be resumed. Another lineage's checkpoints are never deleted, not
    even damaged ones (their marker names it); an unmarked folder is nobody's.
    ``protect``: the step of the best checkpoint (``train.save_best``), kept whatever
    its age and not counted among the ``keep``. Returns what was deleted.
    """
    found = [c for c in list_checkpoints(output_dir) if protect is None or c.step != protect]
    mine = [c for c in found if c.complete and c.lineage == lineage]
    if not mine:
        return []
    kept_from = mine[-keep].step if len(mine) > keep else mine[0].step
    doomed = [
        c.path
        for c in found
        if c.step < kept_from and (c.lineage == lineage if c.complete else c.lineage in (None, lineage))
    ]
    for path in doomed:
        _delete(path)
    return doomed


def clear_for_rewrite(path: Path, lineage: str) -> bool:
    """Remove a ``checkpoint-N`` folder the trainer is about to write again; False when there is none.

    The Trainer writes into an existing folder file by file. A marker left there
    would vouch for a mix of old and new files, and same-shape shards keep their
    sizes, so the manifest would not tell. The folders that reach here are cut-short
    saves, or (node-local storage) this lineage's newer checkpoint on a node that
    resumes an older common step; another lineage's complete one is refused.
    """
    if not path.is_dir():
        return False
    found = inspect(path)
    if found.complete and found.lineage != lineage:
        raise CheckpointError(
            f"{path} is complete and belongs to another run (run {found.lineage}, this run is {lineage}): "
            "it is not overwritten",
            fix="give this run its own train.output_dir",
        )
    _delete(path)
    return True


def _delete(path: Path) -> None:
    # Marker first: a folder half-deleted by a crash reads as incomplete, never as complete.
    with contextlib.suppress(FileNotFoundError):
        (path / MARKER).unlink()
        _fsync_path(path)
    shutil.rmtree(path, ignore_errors=True)


SAVE_FAILED_NOTE = "dzctl-save-failed.json"
# A write that failed with this little left was the disk filling up. torch.save reports
# ENOSPC as a bare RuntimeError ("unexpected pos ...", "iostream error"), with no errno.
LOW_SPACE_BYTES = 1 << 20


def remove_incomplete(path: Path) -> bool:
    """Delete a ``checkpoint-N`` folder that lacks the completeness marker; never one that has it."""
    if not CHECKPOINT_DIR.match(path.name) or not path.is_dir() or (path / MARKER).exists():
        return False
    shutil.rmtree(path, ignore_errors=True)  # another rank may be removing it too
    return not path.exists()


def disk_full(exc: BaseException, directory: Path) -> bool:
    """Whether a failed write was the filesystem (or quota) running out of space."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        stat = os.statvfs(directory)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < LOW_SPACE_BYTES


def save_failed(path: Path, exc: BaseException, run_id: str | None = None) -> SaveFailed:
    """Clean up after a failed save of checkpoint ``path`` and say why, the same on every rank of this node.

    Every local rank writing to one folder may fail at once (each hits the full
    disk), or fail later because a peer that failed has gone. Under an exclusive
    lock on the output folder, the first to come here judges the cause (before
    anything is freed), removes the incomplete folder (the space it held lets the
    ``error`` event be written) and leaves its verdict in a note; the others of
    this launch adopt the note, so their ``error`` events name the real cause, not
    "connection closed by peer". A folder with the marker is complete: it is kept.
    """
    output_dir = path.parent
    run_id = run_id if run_id is not None else f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{os.getppid()}"
    note = output_dir / SAVE_FAILED_NOTE
    fd = _lock(output_dir)
    try:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            earlier = json.loads(note.read_text(encoding="utf-8"))
            if earlier["run"] == run_id and earlier["checkpoint"] == str(path):
                return SaveFailed(earlier["message"], fix=earlier["fix"])
        full = disk_full(exc, output_dir)
        space = _space(output_dir)  # before the removal: what the failed write saw
        removed = remove_incomplete(path)
        kept = (path / MARKER).exists()
        previous = [c for c in list_checkpoints(output_dir) if c.complete and c.path != path]
        resume = f"resume: auto continues from {previous[-1].path.name}" if previous else "no complete checkpoint yet"
        cause = f"No space left on device on {output_dir} ({space})" if full else _first_line(exc)
        fate = f"{path.name} is complete and kept" if kept else f"the incomplete {path.name} was removed"
        message = f"saving checkpoint {path} failed: {cause}; {fate}; {resume}"
        if full:
            need = f" (a checkpoint here takes {_size(previous[-1].path)})" if previous else ""
            fix = f"free space on {output_dir}{need} or lower train.save_total_limit, then relaunch"
        else:
            fix = "see this rank's log above for the failed write, then relaunch"
        with contextlib.suppress(OSError):  # no room even now: stderr still says it all
            tmp = output_dir / f"{SAVE_FAILED_NOTE}.{os.getpid()}"
            text = {"run": run_id, "checkpoint": str(path), "message": message, "fix": fix, "removed": removed}
            tmp.write_text(json.dumps(text), encoding="utf-8")
            tmp.replace(note)
        return SaveFailed(message, fix=fix)
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _lock(directory: Path) -> int | None:
    """An exclusive flock on the folder itself (it needs no space on the full disk); None where not possible."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return None  # the folder is gone: nothing to clean up, nothing to share
    # A filesystem without flock (some network mounts): judge alone rather than fail here.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _space(directory: Path) -> str:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return "free space unknown"
    return f"{_mib(stat.f_bavail * stat.f_frsize)} free of {_mib(stat.f_blocks * stat.f_frsize)}"


def _size(folder: Path) -> str:
    return _mib(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor name → shape over all ``*.safetensors`` files, read from their JSON headers."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise IncompleteWeights(f"{model_dir}: no .safetensors file was written")
    shapes: dict[str, list[int]] = {}
    for file in files:
        with file.open("rb") as handle:
            # The format: 8-byte little-endian header length, then a JSON header.
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = list(info["shape"])
    return shapes


def check_consolidated(model_dir: Path, expected: dict[str, list[int]]) -> None:
    """Fail loudly unless every expected tensor was saved with its full shape.

    ZeRO-3's classic bug saves each rank's empty placeholder (shape ``[0]``)
    instead of the gathered weight; ``expected`` are the real shapes (``ds_shape``).
    """
    saved = safetensors_shapes(model_dir)
    empty = sorted(name for name, shape in saved.items() if 0 in shape)
    missing = sorted(set(expected) - set(saved))
    wrong = sorted(n for n, s in expected.items() if n in saved and saved[n] != list(s) and n not in empty)
    problems = []
    if empty:
        problems.append(f"{len(empty)} empty tensors (e.g. {', '.join(empty[:3])})")
    if missing:
        problems.append(f"{len(missing)} tensors missing (e.g. {', '.join(missing[:3])})")
    if wrong:
        name = wrong[0]
        problems.append(
            f"{len(wrong)} tensors with wrong shapes (e.g. {name}: {saved[name]} != {list(expected[name])})"
        )
    if problems:
        raise IncompleteWeights(
            f"{model_dir}: the consolidated model is incomplete: " + "; ".join(problems),
            fix="keep zero_optimization.stage3_gather_16bit_weights_on_model_save true (do not override it), "
            "or rebuild the weights from the last checkpoint with its zero_to_fp32.py",
        )
