"""Wrapping a model with LoRA (train/model/lora.py) without DeepSpeed: dtype, shapes, a bad target list."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.errors import InputError
from orchestrator.spec.job import load_job

JOB = Path(__file__).resolve().parent.parent / "jobs" / "tiny-cpu.yaml"


def _model(job, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**job.spec.model.config), dtype=dtype)


def test_adapters_take_the_base_dtype_and_only_they_train():
    from orchestrator.train.model import lora

    job = load_job(JOB, ["train.method=lora"])
    wrapped = lora.wrap(_model(job, torch.bfloat16), job)
    trainable = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.bfloat16}  # PEFT alone would make them fp32
    adapters = sum(p.numel() for p in trainable.values())
    assert lora.trainable_summary(wrapped) == (adapters, 186_752)  # the total counts the adapters too


def test_shapes_are_checked_against_the_full_weight():
    from orchestrator.train.model import lora

    job = load_job(JOB, ["train.method=lora"])
    wrapped = lora.wrap(_model(job, torch.float32), job)
    _, layer = next(iter(lora.lora_layers(wrapped)))
    # What ZeRO-3 leaves: an empty local tensor whose real shape is ds_shape.
    layer.get_base_layer().weight.ds_shape = torch.Size([999, 64])
    with pytest.raises(RuntimeError, match="do not fit the base weight"):
        lora.check_adapter_shapes(wrapped, 16)


def test_target_modules_matching_nothing_is_an_input_error():
    from orchestrator.train.model import lora

    job = load_job(JOB, ["train.method=lora", "train.lora.target_modules=[c_attn]"])
    with pytest.raises(InputError) as info:
        lora.wrap(_model(job, torch.float32), job)
    assert "train.lora.target_modules" in str(info.value) and "c_attn" in str(info.value)
    assert "q_proj" in info.value.fix
