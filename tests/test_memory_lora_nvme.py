"""The planner's LoRA and NVMe-offload terms, the auto order, and the 72B-on-seed-hardware case (issue 14)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.planning import dsconfig
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.memory.estimate import (
    GIB,
    Choice,
    LoraShape,
    NvmeReading,
    estimate,
    nvme_io_per_step,
    nvme_step_seconds,
)
from orchestrator.planning.memory.fromjob import plan_for_job
from orchestrator.planning.memory.refusal import DoesNotFit, require_fit
from orchestrator.planning.memory.search import Allowed, Hardware, plan_memory
from orchestrator.planning.shape import CATALOGUE, shape_from_config
from orchestrator.spec.job import LORA_DEFAULT_TARGETS, load_job

ROOT = Path(__file__).resolve().parent.parent
QWEN3_8B = shape_from_config(CATALOGUE["Qwen/Qwen3-8B"], name="Qwen/Qwen3-8B", source="catalogue")
QWEN25_72B = shape_from_config(CATALOGUE["Qwen/Qwen2.5-72B"], name="Qwen/Qwen2.5-72B", source="catalogue")
LORA16 = LoraShape(16, LORA_DEFAULT_TARGETS, 0.05)
SEED_NODES = [4, 4]  # hostfiles/2x4.txt: the seed article's two nodes of 4 A100-40GB, 256 GiB RAM each


def _dzctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_adapter_count_matches_what_peft_creates():
    # The planner's formula against PEFT itself on a real (tiny) Qwen2 model with GQA and a wide MLP.
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {
        "model_type": "qwen2",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    from orchestrator.spec.job import LoraSpec
    from orchestrator.train.model.lora import lora_config

    peft_model = get_peft_model(model, lora_config(LoraSpec(r=4)))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    shape = shape_from_config(config, name="tiny", source="test")
    assert LoraShape(4, LORA_DEFAULT_TARGETS, 0.05).adapter_params(shape) == trainable


def test_qwen25_72b_adapters_at_r16():
    # Per layer r·(in+out) over q (8192→8192), k, v (8192→1024), o (8192→8192), gate, up (8192→29568), down.
    per_layer = 16 * ((8192 + 8192) + 2 * (8192 + 1024) + (8192 + 8192) + 3 * (8192 + 29568))
    assert LORA16.adapter_params(QWEN25_72B) == 80 * per_layer == 210_534_400


def test_lora_states_are_the_adapters_only():
    choice = Choice(1, True, "none")
    full = estimate(QWEN25_72B, choice, seq_len=2048, precision="bf16", world_size=8)
    lora = estimate(QWEN25_72B, choice, seq_len=2048, precision="bf16", world_size=8, lora=LORA16)
    adapters = math.ceil(210_534_400 / 8)
    assert lora.gpu_terms["params"] == full.gpu_terms["params"]  # the frozen base: still bf16 and partitioned
    assert lora.gpu_terms["grads"] == 2 * adapters
    assert lora.gpu_terms["fp32 master + Adam m,v"] == 12 * adapters
    # The largest weight is gathered, but a frozen one has no gradient.
    assert lora.gpu_terms["gathered largest layer"] == 2 * QWEN25_72B.largest_layer_params
    assert lora.trainable_params == 210_534_400 and lora.method == "lora"
    # Activations as full fine-tuning (whose peak here is its optimizer step: compare with its forward/backward),
    # less the frozen final norm's normalised copy (HF's norm keeps it for its weight's gradient alone), plus the
    # adapters' dropout copies in the one layer being recomputed.
    forward = estimate(QWEN25_72B, Choice(1, True, "optimizer"), seq_len=2048, precision="bf16", world_size=8)
    assert full.peak_phase == "optimizer step" and lora.peak_phase == "forward/backward"
    frozen_norm = 2 * QWEN25_72B.hidden_size * 2048
    assert lora.gpu_terms["activations (checkpoints)"] == forward.gpu_terms["activations (checkpoints)"] - frozen_norm
    assert lora.gpu_terms["logits + loss"] >= forward.gpu_terms["logits + loss"]
    assert lora.gpu_peak < full.gpu_peak - 10 * GIB


def test_lora_dropout_adds_its_copies_to_the_layer_activations():
    no_dropout = LoraShape(16, LORA_DEFAULT_TARGETS, 0.0)
    h, q, i = QWEN3_8B.hidden_size, QWEN3_8B.q_dim, QWEN3_8B.intermediate_size
    inputs = 3 * h + q + 2 * h + i  # q, k, v and gate, up read h; o reads q; down reads i
    assert no_dropout.activation_bytes_per_token(QWEN3_8B, 2) == 7 * 2 * 16
    assert LORA16.activation_bytes_per_token(QWEN3_8B, 2) == 3 * inputs + 7 * 2 * 16


def test_cli_qwen72b_lora_fits_the_seed_hardware_with_its_breakdown():
    argv = ["plan", "jobs/qwen72b.yaml", "--hosts", "hostfiles/2x4.txt", "--gpu-mem-gib", "40", "--host-mem-gib", "256"]
    run = _dzctl(*argv, "--set", "train.method=lora")
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "method lora: r 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in text
    assert "210.5 M trainable params" in text and "\nfits" in text
    for term in ("params", "grads", "fp32 master + Adam m,v", "gathered largest layer", "logits + loss"):
        assert f"\n  {term} " in text, term
    as_json = _dzctl(*argv, "--set", "train.method=lora", "--json")
    out = json.loads(as_json.stdout)
    assert out["fits"] and out["method"] == "lora" and out["offload"] == "none"
    assert out["per_gpu_required_gib"] <= 40
    assert out["host_per_node_gib"] <= 256 * 0.9


def test_cli_qwen72b_full_refusal_names_the_lora_fix_with_numbers():
    argv = ["plan", "jobs/qwen72b.yaml", "--hosts", "hostfiles/2x4.txt", "--gpu-mem-gib", "40", "--host-mem-gib", "256"]
    run = _dzctl(*argv)
    assert run.returncode == 2
    assert "fix: use 7 such nodes, or nodes with more host RAM; or train LoRA adapters instead of all weights: " in (
        run.stderr
    )
    assert "--set train.method=lora" in run.stderr.splitlines()[-1]
    lora_line = next(line for line in run.stderr.splitlines() if "LoRA would fit" in line)
    # The numbers of the plan that `--set train.method=lora` gives.
    lora = json.loads(_dzctl(*argv, "--set", "train.method=lora", "--json").stdout)
    assert f"{lora['per_gpu_required_gib']} GiB per GPU" in lora_line
    assert "210.5 M trainable parameters" in lora_line and "offload none" in lora_line
    as_json = json.loads(_dzctl(*argv, "--json").stdout)
    assert as_json["fits"] is False and as_json["method"] == "full"
    assert as_json["lora_alternative"]["set"] == "--set train.method=lora"
    assert as_json["lora_alternative"]["per_gpu_required_gib"] == lora["per_gpu_required_gib"]


def test_lora_is_never_chosen_for_a_full_job():
    job = load_job(ROOT / "jobs" / "qwen72b.yaml")
    plan, ds_config = plan_for_job(read_inputs(job), SEED_NODES, gpu_mem_gib=40, host_mem_gib=256)
    assert not plan.fits and ds_config is None and plan.lora is None
    assert plan.lora_alternative is not None and plan.lora_alternative.fits
    with pytest.raises(DoesNotFit) as info:
        require_fit(plan, "2 nodes")
    assert "train.method=lora" in info.value.fix
    # Where full fine-tuning fits, no alternative is offered.
    fits, _ = plan_for_job(read_inputs(job), SEED_NODES * 4, gpu_mem_gib=80, host_mem_gib=2048)
    assert fits.fits and fits.lora_alternative is None


# --- NVMe ---------------------------------------------------------------------------------------


def test_nvme_moves_every_state_to_the_disk():
    est = estimate(QWEN3_8B, Choice(1, True, "nvme"), seq_len=4096, precision="bf16", world_size=2)
    shard = math.ceil(QWEN3_8B.total_params / 2)
    assert "params" not in est.gpu_terms and "grads" not in est.gpu_terms
    assert est.nvme_terms_per_rank == {
        "params": 2 * shard,
        "fp32 master + Adam m,v": 12 * shard,
        "fp32 grads": 4 * shard,
    }
    host = est.host_terms_per_rank
    assert "fp32 master + Adam m,v" not in host  # on the disk, not in RAM
    # DeepSpeed's swap buffers, sized as dsconfig writes them: 5 buffers of the largest weight (the embedding).
    assert host["NVMe parameter swap buffers (pinned)"] == 1 << (5 * QWEN3_8B.largest_layer_params * 2 - 1).bit_length()
    assert host["NVMe optimizer swap buffers (pinned)"] == 1 << (4 * 100_000_000 * 4 - 1).bit_length()
    all_host = estimate(QWEN3_8B, Choice(1, True, "all"), seq_len=4096, precision="bf16", world_size=2)
    assert est.gpu_terms == all_host.gpu_terms  # the GPU sees the same as offload to host RAM
    assert est.host_per_rank < all_host.host_per_rank / 3


def test_nvme_io_and_step_time_from_the_bandwidth():
    est = estimate(QWEN3_8B, Choice(1, True, "nvme"), seq_len=4096, precision="bf16", world_size=2)
    disk = est.nvme_terms_per_rank
    read, written = nvme_io_per_step(est, accumulation=2)
    # Forward, recomputation and backward read the partition each micro-step; the step reads and writes the states.
    assert read == 2 * 3 * disk["params"] + disk["fp32 master + Adam m,v"] + disk["fp32 grads"]
    assert written == disk["params"] + disk["fp32 master + Adam m,v"] + disk["fp32 grads"]
    reading = NvmeReading(free_bytes=10**13, read_bytes_per_s=2e9, write_bytes_per_s=1e9)
    assert nvme_step_seconds(est, reading, ranks_per_node=2, accumulation=2) == pytest.approx(
        2 * (read / 2e9 + written / 1e9)
    )
    lora = estimate(QWEN3_8B, Choice(1, True, "nvme"), seq_len=4096, precision="bf16", world_size=2, lora=LORA16)
    assert nvme_io_per_step(lora, accumulation=1)[1] < disk["params"]  # a frozen base is never written back


def _hw(host_gib, nvme=None):
    return Hardware((8,), 80, host_gib, nvme=nvme)


def _plan(hardware, allowed):
    return plan_memory(
        QWEN25_72B, allowed=allowed, seq_len=2048, precision="bf16", gradient_accumulation_steps=1, hardware=hardware
    )


FAST_DISK = NvmeReading(free_bytes=4 * 2**40, read_bytes_per_s=6e9, write_bytes_per_s=3e9)


def test_auto_tries_nvme_last_and_only_where_preflight_found_it():
    # 72B full on one node of 8×80 GB with 512 GiB RAM: no-offload and host-RAM offloads do not fit.
    with_path = Allowed(nvme=True)
    assert not _plan(_hw(512), with_path).fits  # no preflight reading: NVMe is not tried
    assert not _plan(_hw(512, FAST_DISK), Allowed()).fits  # a reading, but the job names no nvme_path
    plan = _plan(_hw(512, FAST_DISK), with_path)
    assert plan.fits and plan.choice.offload == "nvme"
    tried = [c.offload for c, _, _ in plan.candidates]
    assert tried.index("nvme") > max(i for i, o in enumerate(tried) if o in ("none", "optimizer", "all"))
    assert plan.nvme_step_s is not None and plan.nvme_step_s > 0
    # With enough RAM for host offload, NVMe is not used even though it is there.
    roomy = _plan(_hw(8192, FAST_DISK), with_path)
    assert roomy.fits and roomy.choice.offload in ("optimizer", "all")


def test_nvme_without_the_space_does_not_fit():
    small = NvmeReading(free_bytes=100 * 2**30, read_bytes_per_s=6e9, write_bytes_per_s=3e9)
    plan = _plan(_hw(512, small), Allowed(offload="nvme"))
    assert not plan.fits
    assert "NVMe: needs" in plan.reason and "100.0 GiB free" in plan.reason


def test_nvme_plan_writes_the_zero_infinity_config(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text((ROOT / "jobs" / "qwen3-8b.yaml").read_text())
    job = load_job(job_file, ["zero.offload=nvme", "zero.nvme_path=/mnt/nvme/dz"])
    plan, ds = plan_for_job(read_inputs(job), [2], gpu_mem_gib=140, host_mem_gib=512, nvme=FAST_DISK)
    assert plan.fits and plan.choice.offload == "nvme"
    zero = ds["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"] == "/mnt/nvme/dz"
    # DeepSpeed refuses a parameter buffer smaller than the largest weight (the embedding here).
    assert zero["offload_param"]["buffer_size"] >= QWEN3_8B.largest_layer_params
    assert zero["sub_group_size"] == dsconfig.NVME_SUB_GROUP_SIZE and ds["aio"] == dsconfig.AIO_CONFIG
    assert ds["optimizer"]["type"] == "AdamW"  # offloaded optimizer: DeepSpeed's CPU Adam steps it


def test_nvme_needs_a_path_and_an_absolute_one(tmp_path):
    from orchestrator.errors import SpecError

    with pytest.raises(SpecError, match=r"offload: nvme needs zero\.nvme_path"):
        load_job(ROOT / "jobs" / "tiny-cpu.yaml", ["zero.offload=nvme"])
    with pytest.raises(SpecError, match=r"nvme_path.*must be an absolute path"):
        load_job(ROOT / "jobs" / "tiny-cpu.yaml", ["zero.offload=nvme", "zero.nvme_path=nvme"])
