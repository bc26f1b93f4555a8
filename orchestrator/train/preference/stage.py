"""A preference stage's part of a run (``run.train`` calls these where ``train.stage`` is not sft).

The data (``encode.py``), the reference policy (``planning/preference/reference.py`` chooses), the
TRL trainer (``trainers.py``) and the progress keys of its metrics.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...planning.preference.reference import WORDS, Reference, choose_reference, copy_bytes_per_gpu
from ...planning.shape import shape_from_config
from ...spec.job import LoadedJob
from . import encode, trainers

# The plan's GPU peak per rank (bytes), where the launch gives it: the reference copy is chosen when it fits beside it.
PLAN_PEAK_ENV = "DZCTL_PLAN_PEAK_BYTES"

# TRL's metric names -> progress.jsonl keys (train: as they are; eval: with eval_ before them).
METRICS = {
    "rewards/chosen": "rewards_chosen",
    "rewards/rejected": "rewards_rejected",
    "rewards/accuracies": "reward_accuracy",
    "rewards/margins": "reward_margin",
    "kl": "kl",
    "logps/chosen": "logps_chosen",
    "logps/rejected": "logps_rejected",
    "nll_loss": "nll_loss",
    "log_odds_ratio": "log_odds_ratio",
}


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


def reference_for(loaded: LoadedJob, config, world_size: int) -> Reference:
    """Where this run's reference policy comes from (the planner's rule, with the plan's peak where given)."""
    train = loaded.spec.train
    params = shape_from_config(config.to_dict(), name=loaded.spec.model.name_or_path, source="config").total_params
    peak = os.environ.get(PLAN_PEAK_ENV)
    capacity = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return choose_reference(
        train.stage,
        train.pref_loss,
        train.method,
        copy_bytes=copy_bytes_per_gpu(params, world_size),
        peak_bytes=int(peak) if peak and capacity else None,
        capacity_bytes=capacity if peak else None,
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
    for name, key in METRICS.items():
        value = logs.get(prefix + name)
        if isinstance(value, (int, float)):
            out[prefix + key] = float(value)
    return out


def make_trainer(loaded: LoadedJob, model, ref_model, args, dataset, eval_dataset, tokenizer, callbacks):
    """The stage's TRL trainer under dzctl's (``trainers.trainer_class``); LoRA's reference adapter dropped."""
    train = loaded.spec.train
    extra = {"ref_model": ref_model} if train.stage == "kto" or train.pref_loss in ("sigmoid", "ipo") else {}
    trainer = trainers.trainer_class(train)(
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
