"""The memory planner: pinned to measurements on 2×H200, checked against torch's saved tensors, auto choices, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.memory.estimate import (
    ALLOCATOR_MARGIN,
    GIB,
    NON_TORCH_GPU_GIB,
    Choice,
    LoraShape,
    estimate,
    layer_activation_bytes_per_token,
    logits_bytes_per_token,
    norm_bytes_per_token,
    pinned_bytes,
)
from orchestrator.planning.memory.fromjob import plan_for_job
from orchestrator.planning.memory.refusal import DoesNotFit, require_fit
from orchestrator.planning.memory.search import Allowed, Hardware, plan_memory
from orchestrator.planning.shape import CATALOGUE, shape_from_config
from orchestrator.planning.speed import recompute
from orchestrator.spec.job import load_job

REPO = Path(__file__).resolve().parent.parent
QWEN3_8B = shape_from_config(CATALOGUE["Qwen/Qwen3-8B"], name="Qwen/Qwen3-8B", source="catalogue")
QWEN25_72B = shape_from_config(CATALOGUE["Qwen/Qwen2.5-72B"], name="Qwen/Qwen2.5-72B", source="catalogue")
H200_GIB = 143771 / 1024  # nvidia-smi memory.total on the measured machine (tests/fixtures/h200x2/query-gpu.csv)

# Outside figures (the first four): peak torch.cuda.max_memory_allocated per GPU, 2×H200, Qwen3-8B
# shape, seq 4096, ZeRO-3, torch 2.11, DeepSpeed 0.19.8, measured by the CEO session on 2026-11-30
# with a raw DeepSpeed-engine loop that is not in this repo (design notes §5); dzctl's trainer
# measured 95.8 and 18.5 again (benchmarks/results/h200x2-20261130). (micro, ckpt, offload, precision, GiB)
MEASURED = [
    (2, True, "none", "bf16", 79.4),
    (4, True, "none", "bf16", 95.8),
    (1, False, "none", "bf16", 99.7),
    (2, True, "all", "fp16", 18.5),  # the seed article's config: optimizer + params offloaded, pinned
    # Through dzctl's trainer (HF Trainer), same machine kind: the micro-batches auto reaches
    # now that it tries every one (benchmarks/results/h200x2-20261130, runs 7 and 8).
    (5, True, "none", "bf16", 104.0),
    (6, True, "none", "bf16", 112.2),
]


@pytest.mark.parametrize(("micro", "ckpt", "offload", "precision", "measured"), MEASURED)
def test_estimate_within_ten_percent_of_h200_measurements(micro, ckpt, offload, precision, measured):
    est = estimate(QWEN3_8B, Choice(micro, ckpt, offload), seq_len=4096, precision=precision, world_size=2)
    assert est.gpu_peak / GIB == pytest.approx(measured, rel=0.10)
    # train.fused_loss: none is the model's own loss: exactly the estimate these pins were made for.
    same = estimate(
        QWEN3_8B, Choice(micro, ckpt, offload), seq_len=4096, precision=precision, world_size=2, fused_loss="none"
    )
    assert same.gpu_terms == est.gpu_terms


# DESIGN §5 / issue 12: the same machine and shape through dzctl's trainer with HF's
# use_liger_kernel (liger-kernel 0.8.5: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE),
# synthetic full rows, bf16, no offload. (micro, checkpointing, peak allocated GiB per GPU)
MEASURED_LIGER = [
    (6, True, 73.6),
    (12, True, 84.0),
    (20, True, 98.0),
    (2, False, 102.2),
]


@pytest.mark.parametrize(("micro", "ckpt", "measured"), MEASURED_LIGER)
def test_liger_estimate_within_ten_percent_of_h200_measurements(micro, ckpt, measured):
    est = estimate(
        QWEN3_8B, Choice(micro, ckpt, "none"), seq_len=4096, precision="bf16", world_size=2, fused_loss="liger"
    )
    assert est.gpu_peak / GIB == pytest.approx(measured, rel=0.10)
    # The unfused estimate at these micro-batches is what the issue saw the planner predict: far off.
    unfused = estimate(QWEN3_8B, Choice(micro, ckpt, "none"), seq_len=4096, precision="bf16", world_size=2)
    assert unfused.gpu_peak / GIB > measured * 1.10


def test_fused_losses_hold_no_logits():
    tokens = 6 * 4096
    none, liger, chunked = (
        estimate(QWEN3_8B, Choice(6, True, "none"), seq_len=4096, precision="bf16", world_size=2, fused_loss=f)
        for f in ("none", "liger", "chunked")
    )
    from orchestrator.planning.memory.estimate import loss_bytes

    # The unfused logits are 41.7 GiB at micro 6; both fused losses stay below 2 GiB at the loss...
    assert loss_bytes(QWEN3_8B, 2, tokens, "none") / GIB == pytest.approx(41.73, abs=0.01)
    assert loss_bytes(QWEN3_8B, 2, tokens, "liger") / GIB < 1.0
    assert loss_bytes(QWEN3_8B, 2, tokens, "chunked") / GIB < 2.0
    # ...so under checkpointing the peak is the last layer's recomputation, smaller with Liger's kernels.
    assert liger.gpu_peak < chunked.gpu_peak < none.gpu_peak - 30 * GIB


# benchmarks/memory_check.py on one H200 (world size 1; torch 2.11, DeepSpeed 0.19.8,
# transformers 5.17), results in benchmarks/results/memory-check-h200-20261130/:
# (model, micro, offload, peak allocated GiB, peak host RSS of the rank GiB)
MEASURED_ONE_GPU = [
    ("Qwen/Qwen3-4B", 2, "none", 77.81, None),
    ("Qwen/Qwen3-1.7B", 2, "optimizer", 20.51, 35.14),
    ("Qwen/Qwen3-1.7B", 2, "all", 19.17, 42.55),
]


@pytest.mark.parametrize(("model", "micro", "offload", "gpu", "host"), MEASURED_ONE_GPU)
def test_estimate_against_one_gpu_measurements(model, micro, offload, gpu, host):
    shape = shape_from_config(CATALOGUE[model], name=model, source="catalogue")
    est = estimate(shape, Choice(micro, True, offload), seq_len=4096, precision="bf16", world_size=1)
    if offload == "all":
        # Known gap: with parameters offloaded on one GPU, 3.1 GiB more were allocated than
        # modelled (-16 %; docs/memory-planner.md). The fit rule's margins still cover it.
        assert est.gpu_required >= gpu * GIB
    else:
        assert est.gpu_peak / GIB == pytest.approx(gpu, rel=0.10)
    if host is not None:
        # VmHWM: the rank's peak resident memory, pinned buffers included.
        assert est.host_per_rank / GIB == pytest.approx(host, rel=0.10)


def test_estimate_terms_follow_the_zero3_arithmetic():
    est = estimate(QWEN3_8B, Choice(2, True, "none"), seq_len=4096, precision="bf16", world_size=2)
    n = QWEN3_8B.total_params
    # 8.19 B params over 2 GPUs: bf16 shards of 8.2 GB, fp32 master + m + v = 12 B/param / 2 ≈ 45.8 GiB.
    assert est.gpu_terms["params"] == est.gpu_terms["grads"] == 2 * n // 2
    assert est.gpu_terms["fp32 master + Adam m,v"] / GIB == pytest.approx(45.8, abs=0.05)
    # Logits at micro 2 × 4096 tokens × 151936 vocab: bf16 + 2 fp32 + bf16 copies.
    assert est.gpu_terms["logits + loss"] == 2 * 4096 * 151936 * (2 + 4 + 4 + 2)
    # Offloading moves every state off the GPU and onto the host.
    off = estimate(QWEN3_8B, Choice(2, True, "all"), seq_len=4096, precision="bf16", world_size=2)
    assert not {"params", "grads", "fp32 master + Adam m,v"} & set(off.gpu_terms)
    assert off.host_per_rank > (2 + 2 + 12) * n // 2


def test_step_grows_with_micro_batch_like_the_measurements():
    # Outside figures (raw engine, design notes §5): 79.4 → 95.8 GiB from micro 2 to 4,
    # i.e. 8.2 GiB per sample of 4096 tokens.
    two, four = (
        estimate(QWEN3_8B, Choice(m, True, "none"), seq_len=4096, precision="bf16", world_size=2).gpu_peak
        for m in (2, 4)
    )
    assert (four - two) / 2 / GIB == pytest.approx(8.2, rel=0.05)


def test_pinned_buffers_round_to_powers_of_two():
    assert pinned_bytes(0) == 0
    assert pinned_bytes(1) == 1
    assert pinned_bytes(4 * GIB) == 4 * GIB
    assert pinned_bytes(int(2.08 * GIB)) == 4 * GIB  # vllm-project/vllm#53042, torch 2.11


# --- activation terms against what torch really saves ----------------------------------------

TINY_QWEN3 = dict(
    model_type="qwen3",
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
)
TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=500,
    hidden_size=192,
    intermediate_size=512,
    num_attention_heads=6,
    num_key_value_heads=3,
)


def _saved_bytes(
    config: dict, layers: int, checkpointing: bool, dtype_name: str, tokens: tuple[int, int], lora_r: int | None = None
) -> int:
    """Bytes of distinct non-parameter tensors autograd saves in one forward of a real HF model on CPU.

    ``lora_r``: wrapped by PEFT with LoRA of that rank on the 7 projections, adapters in the model's dtype
    (as DeepSpeed's bf16 makes them), the base and its norms frozen."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**dict(config, num_hidden_layers=layers))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype_name))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_r is not None:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=targets)
        model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, config["vocab_size"], tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()  # the graph is real: it must run backward
    return sum(seen.values())


@pytest.mark.parametrize(("config", "dtype", "act"), [(TINY_QWEN3, "bfloat16", 2), (TINY_LLAMA, "float32", 4)])
def test_layer_activations_equal_what_autograd_saves(config, dtype, act):
    shape = shape_from_config(dict(config, num_hidden_layers=1), name="tiny", source="test")
    batch, seq = 2, 64
    per_layer = _saved_bytes(config, 3, False, dtype, (batch, seq)) - _saved_bytes(
        config, 2, False, dtype, (batch, seq)
    )
    assert per_layer == layer_activation_bytes_per_token(shape, act) * batch * seq


def test_lora_layer_activations_equal_what_autograd_saves_with_the_norms_frozen():
    """LoRA freezes the RMSNorm weights: HF's norm then keeps no normalised copy for the weight's gradient.
    Failed before: the estimate counted it (26,624 B a token per Qwen3-8B layer, 7 GiB on the H100's
    LoRA DPO launch, benchmarks/preference_peak_check.py)."""
    shape = shape_from_config(dict(TINY_QWEN3, num_hidden_layers=1), name="tiny", source="test")
    batch, seq, r = 2, 64, 4
    per_layer = _saved_bytes(TINY_QWEN3, 3, False, "bfloat16", (batch, seq), lora_r=r) - _saved_bytes(
        TINY_QWEN3, 2, False, "bfloat16", (batch, seq), lora_r=r
    )
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    planned = layer_activation_bytes_per_token(shape, 2, norm_weights_train=False)
    planned += LoraShape(r, targets, 0.0).activation_bytes_per_token(shape, 2)
    assert per_layer == planned * batch * seq


def test_checkpointing_keeps_one_hidden_state_per_layer_and_the_loss():
    shape = shape_from_config(dict(TINY_QWEN3, num_hidden_layers=1), name="tiny", source="test")
    batch, seq = 2, 64
    tokens = batch * seq
    three = _saved_bytes(TINY_QWEN3, 3, True, "bfloat16", (batch, seq))
    two = _saved_bytes(TINY_QWEN3, 2, True, "bfloat16", (batch, seq))
    assert three - two == 2 * shape.hidden_size * tokens  # each layer's bf16 input
    # Besides the layer inputs: the final norm, the fp32 log-softmax of the loss, int64
    # input ids and labels (8 B each per token), and the loss's fp32 total-weight scalar.
    rest = norm_bytes_per_token(shape.hidden_size, 2, weighted_output_saved=True) + 4 * shape.vocab_size + 16
    assert two - 2 * 2 * shape.hidden_size * tokens == rest * tokens + 4
    # The fp32 log-softmax saved is one of the four logits-sized buffers the estimate holds.
    assert 4 * shape.vocab_size < logits_bytes_per_token(shape, 2)


# --- auto choice --------------------------------------------------------------------------


def _plan(shape, slots, gpu, host, *, seq, accumulation=8, allowed=None, precision="bf16"):
    return plan_memory(
        shape,
        allowed=allowed or Allowed(),
        seq_len=seq,
        precision=precision,
        gradient_accumulation_steps=accumulation,
        hardware=Hardware(tuple(slots), gpu, host),
    )


def test_qwen3_8b_on_one_h200_pair_chooses_no_offload_micro_6():
    plan = _plan(QWEN3_8B, [2], H200_GIB, None, seq=4096)
    assert plan.fits
    # The largest micro-batch that fits, not a power of two: measured 6,678 tokens/s/GPU
    # at micro 6 against 6,399 at micro 4 in one device call.
    assert plan.choice == Choice(6, True, "none")
    assert plan.train_batch_size == 6 * 8 * 2  # the user's accumulation is kept
    # The chosen setup leaves the stated headroom on a 140 GiB GPU.
    assert plan.estimate.gpu_peak * (1 + ALLOCATOR_MARGIN) + NON_TORCH_GPU_GIB * GIB <= H200_GIB * GIB
    # micro 7 would not: it is among the candidates and was refused for GPU memory.
    refused = {c: why for c, ok, why in plan.candidates if not ok}
    assert refused[Choice(7, True, "none")].startswith("GPU: needs")
    # Checkpointing off fits only at micro 1, which the throughput model ranks lower
    # (4,050 vs 6,511 tok/s: outside raw-engine figures).
    assert any(c == Choice(1, False, "none") and ok for c, ok, _ in plan.candidates)


def test_qwen3_8b_on_one_h200_pair_with_liger_chooses_micro_29():
    plan = plan_memory(
        QWEN3_8B,
        allowed=Allowed(gradient_checkpointing=True),
        seq_len=4096,
        precision="bf16",
        gradient_accumulation_steps=8,
        hardware=Hardware((2,), H200_GIB, None),
        fused_loss="liger",
    )
    assert plan.fits and plan.fused_loss == "liger"
    # Without the logits the largest micro-batch that fits with every layer checkpointed is 29 (the
    # search went past 64 before stopping at the first that does not fit: 30).
    assert plan.choice == Choice(29, True, "none")
    refused = {c: why for c, ok, why in plan.candidates if not ok}
    assert refused[Choice(30, True, "none")].startswith("GPU: needs")
    assert not any(c.micro_batch_size > 30 and c.gradient_checkpointing for c, _, _ in plan.candidates)
    # Checkpointing off fits at micro 2 (measured 102.2 GiB) but is ranked below: measured
    # 6,850 tokens/s/GPU there against 8,300 at micro 6 with checkpointing (DESIGN §5).
    from orchestrator.planning.memory.search import expected_cost_per_token

    assert expected_cost_per_token(Choice(2, False, "none"), 4096, 36) > expected_cost_per_token(
        Choice(6, True, "none"), 4096, 36
    )
    # Measured with Liger, every layer checkpointed: 8,300 / 8,662 / 8,881 at micro 6 / 12 / 20 on two
    # GPUs; the one-GPU fit (planning/speed/recompute.py) ranks them in that order, within 5 % of the ratios.
    cost = {m: expected_cost_per_token(Choice(m, True, "none"), 4096, 36) for m in (6, 12, 20)}
    assert cost[6] > cost[12] > cost[20]
    assert cost[6] / cost[12] == pytest.approx(8662 / 8300, rel=0.05)
    assert cost[6] / cost[20] == pytest.approx(8881 / 8300, rel=0.05)


def test_auto_checkpoints_only_the_layers_memory_needs_on_one_h200():
    """Issue 29: the planner picks the layer count with the micro-batch (18-layer Qwen3-8B, Liger, seq 4096)."""
    shape = shape_from_config(dict(CATALOGUE["Qwen/Qwen3-8B"], num_hidden_layers=18), name="q18", source="test")
    plan = plan_memory(
        shape,
        allowed=Allowed(),
        seq_len=4096,
        precision="bf16",
        gradient_accumulation_steps=1,
        hardware=Hardware((1,), 140.4, None),
        fused_loss="liger",
    )
    # Micro 6 with the first 5 layers checkpointed: the cost model ranks it ahead of micro 4 with none
    # (measured 19,070 tokens/s) and micro 36 with all (17,644 at micro 32, recompute-h200x1-20261203).
    assert plan.choice == Choice(6, True, "none", 5)
    out = plan.to_dict(None)
    assert (out["checkpointed_layers"], out["decoder_layers"], out["gradient_checkpointing"]) == (5, 18, True)
    # Its neighbours: one layer fewer does not fit at micro 6; micro 7 needs more layers.
    refused = {c for c, ok, _ in plan.candidates if not ok}
    assert Choice(6, True, "none", 4) in refused
    assert plan.resolved().checkpointing_setting == 5


def test_micro_batch_search_goes_past_64_and_stops_at_the_first_that_does_not_fit():
    small = shape_from_config(CATALOGUE["Qwen/Qwen3-0.6B"], name="Qwen/Qwen3-0.6B", source="catalogue")
    plan = plan_memory(
        small,
        allowed=Allowed(gradient_checkpointing=False),
        seq_len=1024,
        precision="bf16",
        gradient_accumulation_steps=1,
        hardware=Hardware((8,), H200_GIB, None),
        fused_loss="liger",
    )
    assert plan.fits and plan.choice == Choice(93, False, "none")  # the search stopped at 64 before
    assert [c.micro_batch_size for c, _, _ in plan.candidates] == list(range(1, 95))
    assert [ok for _, ok, _ in plan.candidates] == [True] * 93 + [False]


def test_offload_only_when_nothing_fits_without_it():
    # 8B on 2 GPUs of 80 GiB: the states alone (61 GiB) plus logits exceed 80 GiB with margin.
    plan = _plan(QWEN3_8B, [2], 80, 512, seq=4096)
    assert plan.fits and plan.choice.offload == "optimizer"
    # On 8 such GPUs the states shrink to a quarter: no offload.
    plan8 = _plan(QWEN3_8B, [8], 80, 512, seq=4096)
    assert plan8.fits and plan8.choice.offload == "none"


def test_qwen25_72b_on_the_seed_hardware_does_not_claim_a_fit():
    # hostfiles/2x4.txt: two nodes of 4 GPUs; the seed's 40 GiB GPUs and 256 GiB RAM per node.
    plan = _plan(QWEN25_72B, [4, 4], 40, 256, seq=2048)
    assert not plan.fits
    assert not any(ok for _, ok, _ in plan.candidates)
    assert "host RAM" in plan.reason
    # What it needs is stated, and the smallest number of such nodes really fits (one fewer does not).
    assert plan.min_nodes is not None and plan.min_nodes > 2
    assert _plan(QWEN25_72B, [4] * plan.min_nodes, 40, 256, seq=2048).fits
    assert not _plan(QWEN25_72B, [4] * (plan.min_nodes - 1), 40, 256, seq=2048).fits
    with pytest.raises(DoesNotFit) as info:
        require_fit(plan, "2 nodes")
    assert info.value.exit_code == 2
    assert f"would fit: {plan.min_nodes}" in str(info.value)


def test_no_number_of_nodes_helps_when_activations_alone_overflow():
    # seq 131072 at micro 1: the logits alone need ~220 GiB, whatever the number of GPUs.
    plan = _plan(QWEN3_8B, [8], 80, 2048, seq=131072)
    assert not plan.fits and plan.min_nodes is None


def test_explicit_settings_are_evaluated_not_changed():
    allowed = Allowed(micro_batch_size=8, gradient_checkpointing=True, offload="none")
    plan = _plan(QWEN3_8B, [2], H200_GIB, None, seq=4096, allowed=allowed)
    assert not plan.fits and plan.choice == Choice(8, True, "none")
    assert len(plan.candidates) == 1


@settings(max_examples=60, deadline=None)
@given(
    micro=st.integers(1, 16),
    seq=st.sampled_from([512, 2048, 4096, 8192]),
    world=st.integers(1, 64),
    ckpt=st.booleans(),
    precision=st.sampled_from(["bf16", "fp16", "fp32"]),
)
def test_estimate_is_monotone(micro, seq, world, ckpt, precision):
    def est(m=micro, s=seq, w=world, c=ckpt, o="none"):
        return estimate(QWEN3_8B, Choice(m, c, o), seq_len=s, precision=precision, world_size=w)

    def peak(**kw):
        return est(**kw).gpu_peak

    # The peak is the larger of the forward/backward and the optimizer step (which does
    # not depend on tokens): more tokens never lower it, and raise it when activations dominate.
    for bigger in (est(m=micro + 1), est(s=seq * 2)):
        assert bigger.gpu_peak >= peak()
        if bigger.peak_phase == "forward/backward":
            assert bigger.gpu_peak > peak()
    assert peak(w=world + 1) <= peak()
    assert peak(c=True) <= peak(c=False)
    assert peak(o="all") <= peak(o="optimizer") <= peak()


# --- from a job, and the CLI --------------------------------------------------------------------


def test_plan_for_job_builds_the_ds_config():
    job = load_job(REPO / "jobs" / "qwen3-8b.yaml", ["train.fused_loss=none"])
    plan, ds = plan_for_job(read_inputs(job), [2], gpu_mem_gib=H200_GIB, host_mem_gib=None)
    assert plan.fits and ds is not None and plan.fused_loss == "none"
    assert ds["train_micro_batch_size_per_gpu"] == 6
    assert ds["train_batch_size"] == 6 * 8 * 2
    assert "offload_optimizer" not in ds["zero_optimization"]
    assert ds["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096
    assert ds["bf16"]["enabled"] is True


def test_plan_for_job_resolves_fused_loss_auto_to_liger_on_gpus():
    job = load_job(REPO / "jobs" / "qwen3-8b.yaml")  # fused_loss not given: auto
    plan, ds = plan_for_job(read_inputs(job), [2], gpu_mem_gib=H200_GIB, host_mem_gib=None)
    assert plan.fused_loss == "liger" and plan.resolved().fused_loss == "liger"
    assert ds["train_micro_batch_size_per_gpu"] == 29 and ds["train_batch_size"] == 29 * 8 * 2
    chunked, _ = plan_for_job(
        read_inputs(load_job(REPO / "jobs" / "qwen3-8b.yaml", ["train.fused_loss=chunked"])),
        [2],
        gpu_mem_gib=H200_GIB,
        host_mem_gib=None,
    )
    assert chunked.fused_loss == "chunked" and 6 < chunked.choice.micro_batch_size < 29


def test_precision_auto_follows_the_gpus_compute_capability():
    from orchestrator.backends.launcher import memory_choice
    from orchestrator.errors import SpecError
    from orchestrator.spec.hostfile import Node

    nodes = [Node("gpu-node-1", (0, 1))]
    job = load_job(REPO / "jobs" / "qwen3-8b.yaml")  # precision: auto
    # 9.0 is the recorded H200's; None: preflight could not read it (assume a current GPU).
    for capability, precision in ((9.0, "bf16"), (8.0, "bf16"), (None, "bf16"), (7.0, "fp16"), (7.5, "fp16")):
        resolved, ds = memory_choice(read_inputs(job), nodes, H200_GIB, None, capability)
        assert resolved.precision == precision, capability
        assert ds["bf16"]["enabled"] is (precision == "bf16") and ds["fp16"]["enabled"] is (precision == "fp16")
    # A job that insists on bf16 is refused before launch, naming the key and the fix.
    forced = load_job(REPO / "jobs" / "qwen3-8b.yaml", ["train.precision=bf16"])
    with pytest.raises(SpecError) as info:
        memory_choice(read_inputs(forced), nodes, H200_GIB, None, 7.0)
    assert "--set train.precision=bf16" in str(info.value) and "compute capability 7" in str(info.value)
    assert "train.precision: auto" in info.value.fix
    assert memory_choice(read_inputs(forced), nodes, H200_GIB, None, 9.0)[0].precision == "bf16"


def test_spec_offload_and_user_config_are_respected(tmp_path):
    job = load_job(REPO / "jobs" / "qwen3-8b.yaml", ["zero.offload=all", "train.micro_batch_size=2"])
    plan, ds = plan_for_job(read_inputs(job), [2], gpu_mem_gib=H200_GIB, host_mem_gib=512)
    assert plan.choice.offload == "all" and plan.choice.micro_batch_size == 2
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    # A hand-written ds_config that offloads decides, even with zero.offload: auto.
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    job = load_job(REPO / "jobs" / "qwen3-8b.yaml", [f"zero.config={user}"])
    plan, _ = plan_for_job(read_inputs(job), [2], gpu_mem_gib=H200_GIB, host_mem_gib=512)
    assert plan.choice.offload == "optimizer"


def test_gpu_memory_is_required_for_gpu_jobs():
    from orchestrator.errors import InputError

    with pytest.raises(InputError, match="GPU's memory") as info:
        plan_for_job(read_inputs(load_job(REPO / "jobs" / "qwen3-8b.yaml")), [2], gpu_mem_gib=None, host_mem_gib=None)
    assert "--gpu-mem-gib" in info.value.fix


def _dzctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_cli_plan_json_for_qwen3_8b():
    run = _dzctl(
        "plan",
        "jobs/qwen3-8b.yaml",
        "--hosts",
        "hostfiles/localhost.txt",
        "--gpu-mem-gib",
        "140.4",
        "--json",
        "--set",
        "train.fused_loss=none",
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)  # exactly one object
    required = {
        "fits",
        "per_gpu_gib",
        "host_per_node_gib",
        "breakdown",
        "micro_batch_size",
        "gradient_checkpointing",
        "zero",
        "ds_config",
    }
    assert required <= set(out)
    assert out["fits"] is True and out["micro_batch_size"] == 6 and out["gradient_checkpointing"] is True
    assert out["zero"] == {"offload_optimizer": False, "offload_param": False}
    assert out["per_gpu_gib"] == pytest.approx(112.2, rel=0.10)  # measured at micro 6 on 2×H200
    assert out["ds_config"]["train_micro_batch_size_per_gpu"] == 6
    assert sum(out["breakdown"]["gpu"].values()) == pytest.approx(out["per_gpu_gib"], abs=0.1)
    assert out["fused_loss"] == out["breakdown"]["fused_loss"] == "none"
    # The job as written (fused_loss: auto) on the same GPUs: Liger, and the micro-batch it allows.
    run = _dzctl("plan", "jobs/qwen3-8b.yaml", "--hosts", "hostfiles/localhost.txt", "--gpu-mem-gib", "140.4", "--json")
    assert run.returncode == 0, run.stderr
    auto = json.loads(run.stdout)
    assert required <= set(auto)
    assert auto["fused_loss"] == "liger" and auto["micro_batch_size"] == 29
    assert auto["breakdown"]["gpu"]["logits + loss"] < 20  # the last layer's recomputation, not logits
    run = _dzctl("plan", "jobs/qwen3-8b.yaml", "--hosts", "hostfiles/localhost.txt", "--gpu-mem-gib", "140.4")
    assert "loss: liger (fused linear cross-entropy" in run.stdout and "(train.fused_loss: auto)" in run.stdout


def test_cli_plan_refuses_qwen72b_on_the_seed_hardware():
    run = _dzctl(
        "plan", "jobs/qwen72b.yaml", "--hosts", "hostfiles/2x4.txt", "--gpu-mem-gib", "40", "--host-mem-gib", "256"
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert "error: the job does not fit on 2 node(s) × 4 GPU(s)" in run.stderr
    assert "smallest number of such nodes (4 GPUs each) that would fit" in run.stderr
    assert "does not fit" in run.stdout  # the plan is still printed
    run = _dzctl(
        "plan",
        "jobs/qwen72b.yaml",
        "--hosts",
        "hostfiles/2x4.txt",
        "--gpu-mem-gib",
        "40",
        "--host-mem-gib",
        "256",
        "--json",
    )
    assert run.returncode == 2
    out = json.loads(run.stdout)
    assert out["fits"] is False and out["ds_config"] is None and out["min_nodes"] > 2


def test_cli_plan_tiny_cpu_job_needs_no_gpu_memory():
    run = _dzctl("plan", "jobs/tiny-cpu.yaml", "--hosts", "hostfiles/localhost.txt", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["fits"] is True and out["zero"] == {"offload_optimizer": False, "offload_param": False}
    assert out["micro_batch_size"] == 4 and out["gradient_checkpointing"] is False
    assert out["ds_config"]["fp16"]["enabled"] is False and out["ds_config"]["bf16"]["enabled"] is False


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(sorted(CATALOGUE)),
    slots=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4),
    gpu=st.sampled_from([24.0, 40.0, 80.0, 140.4]),
    host=st.sampled_from([None, 64.0, 256.0, 1024.0]),
    seq=st.sampled_from([1024, 2048, 4096, 8192]),
)
def test_auto_choice_is_the_fastest_candidate_that_fits(model, slots, gpu, host, seq):
    from orchestrator.planning.memory.search import OFFLOAD_ORDER, expected_cost_per_token

    shape = shape_from_config(CATALOGUE[model], name=model, source="catalogue")
    plan = _plan(shape, slots, gpu, host, seq=seq)
    fitting = [c for c, ok, _ in plan.candidates if ok]
    if not plan.fits:
        assert not fitting and plan.reason
        if plan.min_nodes is not None:
            assert _plan(shape, [min(slots)] * plan.min_nodes, gpu, host, seq=seq).fits
        return
    chosen = plan.choice
    assert chosen in fitting
    assert plan.estimate.gpu_required <= gpu * GIB
    if host is not None:
        assert max(plan.host_per_node) <= host * GIB
    # Nothing at a faster offload level fits; nothing at this level is expected to be faster.
    level = OFFLOAD_ORDER.index(chosen.offload)
    assert all(OFFLOAD_ORDER.index(c.offload) >= level for c in fitting)
    same_level = [c for c in fitting if c.offload == chosen.offload]
    scale = recompute.floor_scale(shape, seq)  # the model's own floor (speed/recompute.py)
    cost = [expected_cost_per_token(c, seq, shape.num_layers, floor_scale=scale) for c in same_level]
    assert expected_cost_per_token(chosen, seq, shape.num_layers, floor_scale=scale) == min(cost)
