"""What a preference stage adds to the memory plan, the reference it chooses, and what status shows (issue 44).

Pure planning on the shipped jobs' shapes (no hosts, no torch training), plus the trainer's reading of
the plan's choice and the progress keys ``status`` and the log lines show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.observe.lines import event_line
from orchestrator.observe.status import parse_progress
from orchestrator.observe.watchstate import JobWatch
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.memory.fromjob import SpeedInputs, plan_for_job
from orchestrator.planning.memory.preference import REFERENCE_KEY
from orchestrator.planning.preference.reference import choose_reference
from orchestrator.planning.speed.communication import Links
from orchestrator.planning.speed.steptime import gpu_kind
from orchestrator.spec.job import load_job

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "jobs" / "tiny-cpu.yaml"
QWEN8B = ROOT / "jobs" / "qwen3-8b.yaml"
FIXTURES = ROOT / "tests" / "fixtures" / "preference"
DPO_ROWS = [f"data.path={FIXTURES / 'dpo_en_demo.json'}", "data.format=sharegpt"]  # absolute: read on the nodes
KTO_ROWS = [f"data.path={FIXTURES / 'kto_en_demo.json'}", "data.format=messages"]


def _plan(job: Path, *sets: str, gpu: float | None = None, slots: int = 2):
    inputs = read_inputs(load_job(job, list(sets)))
    return plan_for_job(inputs, [slots], gpu_mem_gib=gpu, host_mem_gib=None)


def _activations(plan) -> int:
    return sum(v for k, v in plan.estimate.gpu_terms.items() if k.startswith("activations"))


def test_dpo_counts_two_sequences_a_row_and_the_reference_copy_on_cpu_ranks():
    sft, _ = _plan(TINY)
    dpo, ds = _plan(TINY, "train.stage=dpo", *DPO_ROWS)
    assert dpo.choice.micro_batch_size == sft.choice.micro_batch_size == 4
    assert _activations(dpo) == 2 * _activations(sft)
    assert ds[REFERENCE_KEY] == "frozen-copy"
    assert any("preference reference: a frozen ZeRO-3-partitioned copy" in note for note in dpo.notes)
    _, sft_ds = _plan(TINY)
    assert REFERENCE_KEY not in sft_ds  # an SFT job's DeepSpeed config is as it was


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["train.stage=dpo", "train.pref_loss=orpo", *DPO_ROWS], "none"),
        (["train.stage=dpo", "train.pref_loss=simpo", *DPO_ROWS], "none"),
        (["train.stage=dpo", "train.method=lora", *DPO_ROWS], "adapters-off"),
        (["train.stage=kto", "train.method=lora", *KTO_ROWS], "adapters-off"),
    ],
)
def test_orpo_simpo_and_lora_plan_no_reference_copy(sets, expected):
    plan, ds = _plan(TINY, *sets)
    assert ds[REFERENCE_KEY] == expected
    assert not any("frozen ZeRO-3-partitioned copy" in note for note in plan.notes)


def test_full_fine_tuning_keeps_the_copy_where_it_fits_else_precomputes(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(QWEN8B.read_text(encoding="utf-8").replace("/data/alpaca-gpt4-data-zh.json", "/data/x.json"))
    fixed = ["train.stage=dpo", "train.max_seq_len=1024", "train.micro_batch_size=1", "zero.offload=optimizer"]
    fixed += ["train.gradient_checkpointing=false"]  # else the planner recomputes layers to make room
    roomy, roomy_ds = _plan(job, *fixed, gpu=141.0, slots=1)
    assert roomy.fits and roomy_ds[REFERENCE_KEY] == "frozen-copy"
    # 8.19 B parameters in bf16 on one GPU: 15.26 GiB, in the plan's peak.
    assert any("frozen ZeRO-3-partitioned copy of the model, 15.26 GiB per GPU" in note for note in roomy.notes)
    assert roomy.estimate.gpu_terms["reference model (frozen ZeRO-3 copy)"] == 2 * 8_190_735_360
    assert roomy.estimate.gpu_required <= 141.0 * 2**30
    # The same plan without a reference (ORPO: same two sequences a row) needs R GiB: on a GPU of R + 7 the
    # policy fits and the copy does not, so the log-probs are precomputed.
    orpo, _ = _plan(job, *fixed, "train.pref_loss=orpo", gpu=141.0, slots=1)
    tight, tight_ds = _plan(job, *fixed, gpu=orpo.estimate.gpu_required / 2**30 + 7, slots=1)
    assert tight.fits and tight_ds[REFERENCE_KEY] == "precomputed"
    assert any("does not fit beside the plan" in note for note in tight.notes)


def test_the_reference_rule():
    assert choose_reference("dpo", "sigmoid", "full", copy_bytes=10, peak_bytes=85, capacity_bytes=100) == "frozen-copy"
    assert choose_reference("dpo", "sigmoid", "full", copy_bytes=10, peak_bytes=95, capacity_bytes=100) == "precomputed"
    assert choose_reference("kto", "sigmoid", "lora", copy_bytes=10) == "adapters-off"
    assert choose_reference("dpo", "orpo", "full", copy_bytes=10) == "none"


def test_the_trainer_takes_the_plans_choice():
    from transformers import AutoConfig

    from orchestrator.train.preference.stage import reference_for

    loaded = load_job(TINY, ["train.stage=dpo"])
    config = dict(loaded.spec.model.config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    assert reference_for(loaded, config, 2, {REFERENCE_KEY: "precomputed"}) == "precomputed"
    assert reference_for(loaded, config, 2, {}) == "frozen-copy"  # no plan: the rule, on CPU ranks


STEP = {
    "event": "step", "time": 10.0, "step": 3, "max_steps": 20, "loss": 0.2, "tokens_per_s": 100.0,
    "rewards_chosen": 1.5, "rewards_rejected": -0.25, "reward_accuracy": 0.875, "reward_margin": 1.75, "kl": 0.5,
}  # fmt: skip


def test_status_and_the_step_line_show_the_rewards():
    import json

    progress, _, _ = parse_progress(json.dumps(STEP) + "\n", now=11.0)
    assert progress["preference"] == {
        "rewards_chosen": 1.5, "rewards_rejected": -0.25, "reward_accuracy": 0.875, "reward_margin": 1.75, "kl": 0.5,
    }  # fmt: skip
    sft = {k: v for k, v in STEP.items() if not k.startswith(("reward", "kl"))}
    assert "preference" not in parse_progress(json.dumps(sft) + "\n", now=11.0)[0]
    line = event_line(STEP, JobWatch(job="j", job_id="j", nodes=[], started_at=0.0))
    assert "reward-acc 88%  margin 1.75  kl 0.5" in line


def test_the_plot_has_a_preference_panel(tmp_path):
    from orchestrator.observe.plot import write_plot

    events = [{**STEP, "step": n, "reward_accuracy": n / 4, "reward_margin": n / 2.0} for n in range(1, 5)]
    drawn = write_plot(events, tmp_path / "p.png", "dpo")
    assert drawn["reward accuracy"] == {"step": [1, 2, 3, 4], "value": [0.25, 0.5, 0.75, 1.0]}
    assert drawn["reward margin"]["value"] == [0.5, 1.0, 1.5, 2.0] and drawn["KL"]["value"] == [0.5] * 4


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_step_time_holds_the_reference_forward(method):
    """DPO's sigmoid loss runs a reference forward each micro-step (the base with LoRA's adapters off, or the
    frozen copy); SimPO has none. Same rows, same plan: the step differs by the reference's forward alone."""
    speed = SpeedInputs(gpu=gpu_kind("H100"), links=Links.rated(None, gpu_kind("H100").intra_bytes_per_s, "test"))
    dpo_job = ROOT / "jobs" / "qwen3-8b-dpo.yaml"
    sets = [f"train.method={method}", "train.micro_batch_size=2", "train.gradient_checkpointing=false"]
    plans = {}
    for loss in ("sigmoid", "simpo"):
        inputs = read_inputs(load_job(dpo_job, [*sets, f"train.pref_loss={loss}", *DPO_ROWS]))
        plans[loss], _ = plan_for_job(inputs, [1], gpu_mem_gib=141, host_mem_gib=1024, speed=speed)
    with_reference, without = plans["sigmoid"].speed.step, plans["simpo"].speed.step
    assert plans["sigmoid"].choice == plans["simpo"].choice
    # the forward is 2 N FLOPs a token against the policy's 4 N (LoRA: no weight gradients of the base) or 6 N
    assert with_reference.compute_s / without.compute_s == pytest.approx(1.5 if method == "lora" else 4 / 3)
    assert any("preference reference: its forward is in the step time" in n for n in plans["sigmoid"].speed.notes)


def test_dzctl_plan_of_a_dpo_job_prints_trls_loss(tmp_path):
    """`dzctl plan` of the shipped DPO job on a GPU node: the loss line names TRL's fused head. Failed before:
    a KeyError ('trl') took the command down."""
    from click.testing import CliRunner

    from orchestrator.cli import main

    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=1\n", encoding="utf-8")
    args = ["plan", str(ROOT / "jobs" / "qwen3-8b-dpo.yaml"), "--hosts", str(hosts), "--gpu-mem-gib", "140"]
    result = CliRunner().invoke(main, [*args, "--host-mem-gib", "125", "--gpu-kind", "H200"])
    assert result.exit_code == 0, result.output
    assert "loss: TRL's own (its fused LM head" in result.output
    assert "(train.stage dpo: train.fused_loss not used)" in result.output


RESULTS = ROOT / "benchmarks" / "results"
H100_TRACE = RESULTS / "plans-h100x1-20261207d" / "trace-dpo-full" / "peak-live-rank0-712.json"
GIB = 2**30


def _launch_planned_and_measured(folder: str) -> tuple[float, float]:
    """A committed DPO launch planned again on its own plan, and its measured peak (GiB)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import preference_peak_check as check

    result, sets = check.launch_plan(RESULTS / folder)
    return check.planned(result["layers"], sets).estimate.gpu_peak / GIB, max(result["peak_allocated_gib"])


@pytest.mark.parametrize("folder", ["plans-h100x1-20261207b/dpo-full-2", "plans-h100x1-20261207d/trace-dpo-full"])
def test_the_full_fine_tuning_dpo_peak_is_within_5_percent_on_the_h100(folder):
    """DPO with full fine-tuning, 18 layers, micro 16 pairs at seq 2048, optimizer offloaded, on one H100 (its
    micro-batches reach the planned length: the trace's reference forward held 65,387 of 65,536 tokens' worth).
    Planned 51.94 GiB before, +8.2 %: the fp64 norm chunk of the offloaded gradient was counted at the peak,
    and the trace shows it at neither of the step's two high moments."""
    planned, measured = _launch_planned_and_measured(folder)
    assert measured <= planned <= measured * 1.05


def test_the_reference_forward_counted_is_what_the_trace_holds_from_it():
    """The reference's forward at the step's peak (allocations made under dpo_trainer.py:1338), against
    ``reference_forward_bytes_per_token`` at the launch's 16 pairs x 2 x 2048 tokens."""
    import json

    from orchestrator.planning.memory.estimate import reference_forward_bytes_per_token

    trace = json.loads(H100_TRACE.read_text(encoding="utf-8"))
    outside = trace["phases"]["outside backward"]
    assert outside["peak_gib"] == trace["peak_gib"]  # the step's peak is outside the backward
    measured = sum(g["gib"] for g in outside["groups"] if g["where"].endswith("(from dpo_trainer.py:1338)"))
    shape = read_inputs(load_job(ROOT / "jobs" / "qwen3-8b-dpo.yaml")).shape
    counted = reference_forward_bytes_per_token(shape, 2) * 16 * 2 * 2048 / GIB
    assert measured > 6 and counted == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_only_a_stage_with_a_reference_plans_its_forward(method):
    """DPO's sigmoid runs the reference's forward beside the policy's saved activations; SimPO has none. At micro
    16 pairs of 2 x 2048 tokens the reference's forward (6.5 GiB) is larger than the head's backward, with LoRA
    (no head gradient) and with full fine-tuning (its fp32 gradient, the gathered head and its gradient: 6.4)."""
    from orchestrator.planning.memory.estimate import (
        PREFERENCE_MOMENT_TERM,
        reference_forward_bytes_per_token,
        trl_head_bytes,
    )

    sets = [f"train.method={method}", "train.micro_batch_size=16", "train.gradient_checkpointing=false", *DPO_ROWS]
    terms = {}
    for loss in ("sigmoid", "simpo"):
        plan, _ = _plan(ROOT / "jobs" / "qwen3-8b-dpo.yaml", *sets, f"train.pref_loss={loss}", gpu=1000.0, slots=1)
        terms[loss] = plan.estimate.gpu_terms[PREFERENCE_MOMENT_TERM]
    tokens = 16 * 2 * 2048
    shape = read_inputs(load_job(ROOT / "jobs" / "qwen3-8b-dpo.yaml", sets)).shape
    saved, _ = trl_head_bytes(shape, 2, tokens, head_trains=method == "full")
    reference = reference_forward_bytes_per_token(shape, 2) * tokens
    head_backward = terms["simpo"] - saved  # SimPO's one high moment: the head's backward
    assert head_backward > 0 and terms["sigmoid"] == saved + max(head_backward, reference)
    assert terms["sigmoid"] > terms["simpo"]  # at 65,536 tokens the reference's forward is the larger
