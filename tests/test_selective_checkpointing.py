"""Selective activation checkpointing (issue 29): the spec key, the estimate for N layers, the auto choice.

Pure planning on the catalogue's Qwen3-8B shape and the tiny CPU job; the trainer's side (the first N
layers recompute, same loss and gradients) is in tests/test_train_checkpointing.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from orchestrator.errors import InputError, SpecError
from orchestrator.planning import dsconfig
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.memory.estimate import (
    GIB,
    Choice,
    LoraShape,
    estimate,
    layer_activation_bytes_per_token,
    repeated_kv_bytes_per_token,
)
from orchestrator.planning.memory.fromjob import allowed_from, plan_for_job
from orchestrator.planning.memory.search import Allowed, Hardware, expected_cost_per_token, plan_memory
from orchestrator.planning.shape import CATALOGUE, shape_from_config
from orchestrator.planning.speed import recompute
from orchestrator.spec.job import LORA_DEFAULT_TARGETS, load_job

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = shape_from_config(CATALOGUE["Qwen/Qwen3-8B"], name="Qwen/Qwen3-8B", source="catalogue")
Q18 = shape_from_config(dict(CATALOGUE["Qwen/Qwen3-8B"], num_hidden_layers=18), name="q18", source="test")
LORA = LoraShape(16, LORA_DEFAULT_TARGETS, 0.0)


def _peak(shape, micro, n, *, lora=None, packed=False) -> int:
    choice = Choice.with_layers(micro, n, shape.num_layers, "none")
    return estimate(
        shape, choice, seq_len=4096, precision="bf16", world_size=1, fused_loss="liger", lora=lora, kv_repeated=packed
    ).gpu_peak


def test_the_spec_takes_a_layer_count_and_refuses_other_values(tmp_path):
    job = load_job(ROOT / "jobs/tiny-cpu.yaml", ["train.gradient_checkpointing=1"])
    assert job.spec.train.gradient_checkpointing == 1 and not isinstance(job.spec.train.gradient_checkpointing, bool)
    assert load_job(
        ROOT / "jobs/tiny-cpu.yaml", ["train.gradient_checkpointing=true"]
    ).spec.train.gradient_checkpointing
    for bad in ("some", "1.5", "-1"):
        with pytest.raises(SpecError, match=r"train\.gradient_checkpointing"):
            load_job(ROOT / "jobs/tiny-cpu.yaml", [f"train.gradient_checkpointing={bad}"])
    # More layers than the model has: refused before any host, naming where it was set.
    inputs = read_inputs(load_job(ROOT / "jobs/tiny-cpu.yaml", ["train.gradient_checkpointing=3"]))
    with pytest.raises(InputError) as info:
        allowed_from(inputs)
    assert "--set train.gradient_checkpointing=3: 3 layers to checkpoint" in info.value.message
    assert "has 2" in info.value.message


def test_a_fixed_count_reaches_the_plan_the_ds_settings_and_the_node_job_file():
    inputs = read_inputs(load_job(ROOT / "jobs/tiny-cpu.yaml", ["train.gradient_checkpointing=1"]))
    assert allowed_from(inputs).gradient_checkpointing == 1
    plan, _ = plan_for_job(inputs, [2], gpu_mem_gib=None, host_mem_gib=None)
    assert plan.choice.layers_checkpointed(2) == 1
    resolved = plan.resolved()
    assert (resolved.gradient_checkpointing, resolved.checkpointed_layers, resolved.checkpointing_setting) == (
        True,
        1,
        1,
    )
    # The node reads its resolved job file back: the count survives as the same setting.
    again = dsconfig.resolve_defaults(inputs.spec)
    assert (again.gradient_checkpointing, again.checkpointed_layers) == (True, 1)
    assert plan.choice.checkpointing_words(2) == "on in 1 of 2 layers"


@pytest.mark.parametrize(("shape", "lora"), [(Q18, None), (QWEN3_8B, LORA)])
def test_the_estimate_falls_with_every_layer_checkpointed_and_meets_both_ends(shape, lora):
    layers = shape.num_layers
    peaks = [_peak(shape, 4, n, lora=lora) for n in range(layers + 1)]
    # Never more with more layers checkpointed, up to L - 1; flat only where another moment (the optimizer
    # step) decides the peak. The last layer is the exception: its recomputation comes first in the
    # backward, with every other checkpoint still held, so checkpointing it keeps one more hidden state
    # than running it in full (at most that much: 2 bytes x hidden x tokens).
    assert all(a >= b for a, b in itertools.pairwise(peaks[:-1])) and peaks[0] > peaks[-1]
    assert peaks[-1] - peaks[-2] <= 2 * shape.hidden_size * 4 * 4096
    # N = 0 and N = L are exactly the all-or-nothing estimates.
    assert peaks[0] == estimate(shape, Choice(4, False, "none"), seq_len=4096, precision="bf16", world_size=1,
                                fused_loss="liger", lora=lora).gpu_peak  # fmt: skip
    assert peaks[-1] == estimate(shape, Choice(4, True, "none"), seq_len=4096, precision="bf16", world_size=1,
                                 fused_loss="liger", lora=lora).gpu_peak  # fmt: skip
    # In between, each layer not checkpointed adds its activations less its kept input.
    step = (layer_activation_bytes_per_token(shape, 2, "liger") - 2 * shape.hidden_size) * 4 * 4096
    if lora is None:
        assert peaks[layers // 2 - 1] - peaks[layers // 2] == step


def test_the_estimate_is_within_5_percent_of_the_measured_peaks_on_one_h200():
    """benchmarks/results/recompute-h200x1-20261203 and selective-h200x1-20261203 (GiB, max_memory_allocated)."""
    measured = [
        (Q18, None, 4, 0, False, 109.84),
        (Q18, None, 4, 9, False, 92.08),
        (Q18, None, 8, 9, False, 112.61),
        (Q18, None, 32, 18, False, 108.28),
        (Q18, None, 6, 5, False, 114.26),  # the auto plan on synthetic rows, through dzctl launch
        (Q18, None, 4, 0, True, 113.22),  # the auto plan on packed SFT rows
        (QWEN3_8B, LORA, 4, 0, False, 92.54),
        (QWEN3_8B, LORA, 8, 18, False, 97.91),
        (QWEN3_8B, LORA, 6, 6, False, 113.02),  # LoRA's auto plan
    ]
    for shape, lora, micro, n, packed, gib in measured:
        assert _peak(shape, micro, n, lora=lora, packed=packed) / GIB == pytest.approx(gib, rel=0.05), (micro, n)


def test_packed_rows_count_the_repeated_keys_and_values_of_each_full_layer():
    # Issue 29: LoRA on the 36-layer Qwen3-8B, dropout 0, micro 5 without checkpointing on packed rows was
    # predicted 112.22 GiB and measured 119.94. torch 2.11's varlen kernel keeps k and v repeated to 32 heads.
    extra = repeated_kv_bytes_per_token(QWEN3_8B, 2)
    assert extra == 2 * 2 * (32 - 8) * 128
    plain, packed = _peak(QWEN3_8B, 5, 0, lora=LORA), _peak(QWEN3_8B, 5, 0, lora=LORA, packed=True)
    assert packed - plain == 36 * extra * 5 * 4096
    assert plain / GIB < 119.94 * 0.95 and packed / GIB == pytest.approx(119.94, rel=0.05)


def test_auto_picks_the_cheapest_layer_count_at_each_micro_batch_and_the_cheapest_of_those():
    hardware = Hardware((1,), 140.4, None)
    plan = plan_memory(Q18, allowed=Allowed(), seq_len=4096, precision="bf16", gradient_accumulation_steps=1,
                       hardware=hardware, fused_loss="liger")  # fmt: skip
    assert plan.choice == Choice(6, True, "none", 5)
    # Packed rows need the repeated k/v per full layer: micro 6 then needs more layers, and micro 4 with
    # none is cheaper (what the SFT-rows run chose through dzctl launch).
    packed = plan_memory(Q18, allowed=Allowed(), seq_len=4096, precision="bf16", gradient_accumulation_steps=1,
                         hardware=hardware, fused_loss="liger", kv_repeated=True)  # fmt: skip
    assert packed.choice == Choice(4, False, "none")
    # Every fitting candidate tried costs at least the chosen one; every micro-batch got its fewest layers.
    for chosen in (plan, packed):
        best = expected_cost_per_token(chosen.choice, 4096, 18)
        assert all(expected_cost_per_token(c, 4096, 18) >= best for c, ok, _ in chosen.candidates if ok)
    lora = plan_memory(QWEN3_8B, allowed=Allowed(), seq_len=4096, precision="bf16", gradient_accumulation_steps=1,
                       hardware=hardware, fused_loss="liger", lora=LORA)  # fmt: skip
    assert lora.choice == Choice(6, True, "none", 6)
    # Bisection: about log2(L) + 1 estimates per micro-batch tried (1 to 37 here), not L + 1.
    assert len(plan.candidates) <= 37 * 6


def test_the_cost_model_reproduces_the_measured_step_times():
    """planning/speed/recompute.py against benchmarks/results/recompute-h200x1-20261203 (full FT, micro >= 4)."""
    measured = {(4, 0): 0.8591, (4, 9): 0.9688, (4, 18): 1.1395, (8, 9): 1.7689, (8, 18): 1.975, (32, 18): 7.4289}
    base = measured[(8, 18)] / (8 * 4096 * recompute.cost_per_token(8, 4096, 18, 18, recompute.FULL))
    for (micro, n), seconds in measured.items():
        predicted = base * micro * 4096 * recompute.cost_per_token(micro, 4096, n, 18, recompute.FULL)
        assert predicted == pytest.approx(seconds, rel=0.05), (micro, n)
    # LoRA's floor: small micro-batches are no faster per step.
    small = recompute.cost_per_token(2, 4096, 0, 36, recompute.LORA) * 2
    assert small == pytest.approx(recompute.cost_per_token(4, 4096, 0, 36, recompute.LORA) * 4, rel=0.01)
