"""A preference stage's part of a run (``run.train`` calls these where ``train.stage`` is not sft).

The data (``encode.py``'s examples, built once per node into the memory-mapped cache by
``train/preference/cache.py`` and mapped by every rank as a ``datasets.Dataset``), the reference
policy (``planning/preference/reference.py`` chooses), the TRL trainer (``trainers.py``) and the
progress keys of its metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from datasets import Dataset

from ...planning.memory.preference import REFERENCE_KEY
from ...planning.preference.metrics import TRL_NAMES
from ...planning.preference.reference import WORDS, Reference, choose_reference, copy_bytes_per_gpu
from ...planning.shape import shape_from_config
from ...spec.job import LoadedJob
from ..data import prepare
from . import cache as cached
from . import encode, trainers


def say(ranks, text: str) -> None:
    if ranks.rank == 0:
        print(f"dzctl-train: {text}", flush=True)


def load_data(loaded: LoadedJob, tokenizer, ranks, output_dir: Path) -> tuple[Any, Any]:
    """The training pairs (or KTO answers) and the held-out ones, as ``datasets.Dataset`` mapped from the node's cache.

    Local rank 0 builds the cache (or finds it built); the node's other ranks wait for it and map
    the same files (``data/prepare.py``). ``data.eval`` is a second cache of its own sources."""
    spec = loaded.spec
    encode.refuse_synthetic(loaded)

    def prepared(source_set: str):
        split = spec.data.eval_split if source_set == "train" else None
        recipe = prepare.Recipe(
            material=lambda found, folder: cached.key_material(loaded, found, tokenizer, folder, split),
            build=lambda found, folder, report, alive: cached.build(
                loaded, found, tokenizer, folder, report, alive, split
            ),
            open=MappedPreference,
        )
        return prepare.prepare_with(
            recipe,
            loaded,
            local_rank=ranks.local_rank,
            cache_dir=prepare.cache_dir_for(loaded, output_dir),
            say=lambda text: say(ranks, text) if ranks.rank == 0 else None,
            source_set=source_set,
        ).data

    data = prepared("train")
    info = data.info
    say(ranks, cached.summary(info, spec.train.max_seq_len))
    for line in info.get("skipped_lines", [])[:20]:
        say(ranks, f"skipped row: {line}")
    held = data.part("eval") if "eval_examples" in info else None
    if spec.data.eval is not None:
        evaluated = prepared("eval")
        say(ranks, f"eval {cached.summary(evaluated.info, spec.train.max_seq_len)}")
        held = evaluated.part("train")
    if held is not None:
        say(ranks, f"data held out for evaluation: {len(held):,} examples, {info['train_examples']:,} to train on")
    return trainers.as_dataset(data.part("train"), spec.train), trainers.as_dataset(held, spec.train)


class MappedPreference:
    """A built preference cache: its info, and each part as a ``datasets.Dataset`` memory-mapped from its file.

    ``Dataset.from_file`` maps the Arrow stream: the rows stay in the page cache, shared by the
    node's ranks, and a row becomes Python lists only when a batch reads it."""

    def __init__(self, folder: Path) -> None:
        manifest = prepare.cache.read_manifest(folder)
        if manifest is None:
            raise FileNotFoundError(f"{folder}: no manifest")
        self.folder, self.info = folder, manifest["info"]

    def part(self, name: str) -> Dataset:
        return Dataset.from_file(str(self.folder / (cached.EVAL_FILE if name == "eval" else cached.TRAIN_FILE)))


def eval_fields(dataset: Any, stage: str) -> dict[str, Any]:
    """What the ``eval`` event says of a preference evaluation's data: its examples and their tokens.

    TRL's eval loss is a mean over pairs (KTO: answers), not tokens: ``eval_unit`` says which, and
    ``eval_tokens`` counts the prompt's and every answer's tokens of the examples evaluated."""
    if dataset is None:
        return {}
    tokens = 0
    for batch in dataset.select_columns(list(cached.id_columns(stage))).with_format("arrow").iter(batch_size=65536):
        for column in batch.columns:
            tokens += int(pc.sum(pc.list_value_length(column)).as_py() or 0)
    return {"eval_rows": len(dataset), "eval_unit": "pairs" if stage == "dpo" else "answers", "eval_tokens": tokens}


def reference_for(loaded: LoadedJob, config, world_size: int, ds_config: dict[str, Any]) -> Reference:
    """Where this run's reference policy comes from: the plan's choice (in the DeepSpeed config it generated),
    else the planner's rule without the plan's peak (a hand-written zero.config, a trainer run by hand)."""
    planned = ds_config.get(REFERENCE_KEY)
    if planned in WORDS:
        return planned
    train = loaded.spec.train
    params = shape_from_config(config.to_dict(), name=loaded.spec.model.name_or_path, source="config").total_params
    return choose_reference(
        train.stage, train.pref_loss, train.method, copy_bytes=copy_bytes_per_gpu(params, world_size)
    )


def describe(loaded: LoadedJob, reference: Reference) -> str:
    train = loaded.spec.train
    loss = train.pref_loss if train.stage == "dpo" else "kto"
    return f"{train.stage} ({loss}, beta {train.pref_beta:g}); reference: {WORDS[reference]}"


def arguments(loaded: LoadedJob, reference: Reference, with_eval: bool) -> tuple[type, dict[str, Any]]:
    cls, fields = trainers.config_class_and_fields(loaded.spec.train, reference)
    if with_eval and loaded.spec.train.eval_steps:
        fields = {**fields, "eval_strategy": "steps", "eval_steps": loaded.spec.train.eval_steps}
    return cls, fields


def progress_keys(logs: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The preference metrics of one log (``prefix``: ``eval_`` for an evaluation's), under dzctl's names."""
    out = {}
    for name, key in TRL_NAMES.items():
        value = logs.get(prefix + name)
        if isinstance(value, (int, float)):
            out[prefix + key] = float(value)
    return out


def make_trainer(
    loaded: LoadedJob, dz_trainer: type, model, ref_model, args, dataset, eval_dataset, tokenizer, callbacks
):
    """The stage's TRL trainer under dzctl's (``trainers.trainer_class``); LoRA's reference adapter dropped."""
    train = loaded.spec.train
    extra = {"ref_model": ref_model} if train.stage == "kto" or train.pref_loss in ("sigmoid", "ipo") else {}
    trainer = trainers.trainer_class(train, dz_trainer)(
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        **extra,
    )
    trainers.drop_reference_adapter(trainer)
    return trainer
