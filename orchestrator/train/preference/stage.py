"""A preference stage's part of a run (``run.train`` calls these where ``train.stage`` is not sft).

The data (``encode.py``), the reference policy (``planning/preference/reference.py`` chooses), the
TRL trainer (``trainers.py``) and the progress keys of its metrics.
"""

from __future__ import annotations

from typing import Any

from ...planning.memory.preference import REFERENCE_KEY
from ...planning.preference.metrics import TRL_NAMES
from ...planning.preference.reference import WORDS, Reference, choose_reference, copy_bytes_per_gpu
from ...planning.shape import shape_from_config
from ...spec.job import LoadedJob
from . import encode, trainers


def say(ranks, text: str) -> None:
    if ranks.rank == 0:
        print(f"dzctl-train: {text}", flush=True)


def load_data(loaded: LoadedJob, tokenizer, ranks) -> tuple[Any, Any]:
    """The training pairs (or KTO answers) and the held-out ones, as ``datasets.Dataset``."""
    spec = loaded.spec
    encoded = encode.encode_job(loaded, tokenizer)
    train_rows, held = encode.split(encoded, spec.data.eval_split)
    say(ranks, encode.summary(encoded, spec.train.stage, spec.train.max_seq_len))
    for line in encoded.skipped[:20]:
        say(ranks, f"skipped row: {line}")
    if spec.data.eval is not None:
        held = encode.encode_job(loaded, tokenizer, "eval").examples
    if held is not None:
        say(ranks, f"data held out for evaluation: {len(held):,} examples, {len(train_rows):,} to train on")
    return trainers.as_dataset(train_rows, spec.train), trainers.as_dataset(held, spec.train)


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
