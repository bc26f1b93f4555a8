"""Activation checkpointing switched on in the words this transformers release expects.

transformers renamed ``gradient_checkpointing`` (the ``TrainingArguments`` field, its
``_kwargs`` and the model's ``gradient_checkpointing_enable``/``is_gradient_checkpointing``)
to ``activation_checkpointing``, and the old names now raise a ``FutureWarning`` on every
rank, even when the value passed is ``False``. That warning names a key that is also
dzctl's own (``train.gradient_checkpointing``), so users read it as their config being
deprecated. Releases before the rename (the GPU machine's 5.17, say) know only the old
names: the names are picked by what the installed release has, not by its version number.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

NEW = "activation_checkpointing"
OLD = "gradient_checkpointing"
# Non-reentrant checkpointing is the one that works with ZeRO-3's parameter hooks.
CHECKPOINT_KWARGS = {"use_reentrant": False}


def field_name(arguments_class: type) -> str:
    """``activation_checkpointing`` where this ``TrainingArguments`` has it, else the old name."""
    return NEW if hasattr(arguments_class, NEW) else OLD


def trainer_arguments(enabled: bool, arguments_class: type) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords that turn checkpointing on or off, and nothing else."""
    name = field_name(arguments_class)
    return {name: enabled, f"{name}_kwargs": dict(CHECKPOINT_KWARGS) if enabled else None}


@contextlib.contextmanager
def peft_reads_the_old_name() -> Iterator[None]:
    """Around ``get_peft_model``: PEFT asks the model ``is_gradient_checkpointing`` (the old name).

    That read is PEFT's own code, not the job's, and is the only one: its warning is dropped
    here and nowhere else (the Trainer, which does the enabling, already uses the new name).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def decoder_layers(model) -> list:
    """The model's decoder layers in forward order (transformers' ``GradientCheckpointingLayer`` instances)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_first(model, count: int | None) -> None:
    """Recompute the activations of the first ``count`` decoder layers only (``None``: every layer).

    ``train.gradient_checkpointing: N``. Called once checkpointing is enabled on every layer (the
    Trainer does that before ``on_train_begin``), it turns transformers' per-layer flag off for the
    layers after the first ``count``; their forward then keeps every activation. The first layers,
    as Megatron-LM's ``--recompute-method block`` does: which ones are checkpointed does not change
    the peak (every layer holds the same activations), and the last layers, run in full, are the
    first ones the backward frees, before any recomputation starts.
    """
    layers = decoder_layers(model)
    if count is None:
        return
    if not 0 <= count <= len(layers):
        raise ValueError(f"{count} layers to checkpoint, the model has {len(layers)}")
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < count


def layers_checkpointed(model) -> tuple[int, int]:
    """(layers that recompute their activations, decoder layers): what the model will really do.

    Read from transformers' own per-layer flag (``GradientCheckpointingLayer.gradient_checkpointing``),
    which its forward consults, so the log reports the model's state and not the setting asked for.
    """
    layers = decoder_layers(model)
    return sum(bool(m.gradient_checkpointing) for m in layers), len(layers)
