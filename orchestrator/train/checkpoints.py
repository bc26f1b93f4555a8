"""Checkpoints on disk: which are complete, which to resume, whether saved weights are whole (no torch).

A Trainer checkpoint under ZeRO-3 is ``<output_dir>/checkpoint-<step>/`` holding
``trainer_state.json``, ``latest`` (the DeepSpeed tag) and
``global_step<step>/`` with, per data-parallel rank R,
``zero_pp_rank_R_mp_rank_00_model_states.pt`` and
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``. After every rank has
written its part the trainer writes ``dzctl-complete.json`` (world size, step):
a checkpoint cut short by a crash lacks it, or lacks shards, and is never resumed.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, RuntimeFailure

MARKER = "dzctl-complete.json"
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
OPTIM_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
MODEL_SHARD = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$")


class CheckpointError(InputError):
    """A checkpoint cannot be resumed as asked (wrong world size, incomplete, missing)."""


class IncompleteWeights(RuntimeFailure):
    """Saved model weights are missing or empty (ZeRO-3 partitions not gathered)."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    world_size: int | None  # data-parallel ranks that wrote it; None when incomplete
    problem: str | None  # why it is incomplete, None when complete

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
            declared = int(json.loads(marker.read_text(encoding="utf-8"))["world_size"])
        except (ValueError, KeyError, TypeError):
            return Checkpoint(path, step, None, f"{MARKER} unreadable")
    else:
        return Checkpoint(path, step, None, f"{MARKER} missing: the save did not finish on every rank")
    expected = set(range(declared))
    if optim != expected:
        return Checkpoint(path, step, None, f"optimizer shards for ranks {sorted(expected - optim)} missing")
    if model != expected:
        return Checkpoint(path, step, None, f"model-state shards for ranks {sorted(expected - model)} missing")
    return Checkpoint(path, step, declared, None)


def list_checkpoints(output_dir: Path) -> list[Checkpoint]:
    """Every ``checkpoint-N`` in ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [inspect(p) for p in output_dir.iterdir() if p.is_dir() and CHECKPOINT_DIR.match(p.name)]
    return sorted(found, key=lambda c: c.step)


def choose_resume(resume: str, output_dir: Path, world_size: int) -> Checkpoint | None:
    """The checkpoint to continue from: ``auto`` (newest complete, or none), ``never``, or a path.

    Refuses, before any model is built, a checkpoint written by another number of
    data-parallel ranks: DeepSpeed would otherwise fail deep inside loading.
    """
    if resume == "never":
        return None
    if resume == "auto":
        complete = [c for c in list_checkpoints(output_dir) if c.complete]
        if not complete:
            return None
        chosen = complete[-1]
    else:
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"train.resume: {path} is not a folder", fix="name a checkpoint-N folder, or auto")
        chosen = inspect(path)
        if not chosen.complete:
            raise CheckpointError(f"train.resume: {path} is incomplete: {chosen.problem}", fix="resume an older one")
    if chosen.world_size != world_size:
        raise CheckpointError(
            f"checkpoint {chosen.path} was written by {chosen.world_size} data-parallel ranks; "
            f"this run has {world_size}. ZeRO-3 shards only load on the same number of ranks.",
            fix=universal_fix(chosen),
        )
    return chosen


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


def write_marker(checkpoint_dir: Path, world_size: int, step: int) -> None:
    """Record that every rank finished writing this checkpoint (call after a barrier)."""
    text = json.dumps({"world_size": world_size, "step": step})
    tmp = checkpoint_dir / (MARKER + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(checkpoint_dir / MARKER)  # atomic: a reader sees all of it or nothing


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
