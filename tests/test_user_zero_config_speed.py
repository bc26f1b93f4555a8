"""A job's own zero.config reaches the step-time model, and the plan says so (issue 41 item 14).

LLaMA-Factory's ZeRO-3 configs set ``overlap_comm: false``: DeepSpeed then runs every collective on the
compute stream, and the predicted step must add communication to compute, naming the file and key it
took that from, in ``dzctl plan`` and in the launch's predicted-step line. The other keys the model
has a parameter for (buckets, persistence threshold, reuse distance, hpZ) are read the same way. The
dry run marks which values of the user's config were filled from ``"auto"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.planning.dsconfig import auto_filled, auto_left
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.memory.fromjob import SpeedInputs, plan_for_job
from orchestrator.planning.speed.atlaunch import predicted_step_line, speed_notes
from orchestrator.planning.speed.communication import Links
from orchestrator.planning.speed.steptime import GPU_KINDS
from orchestrator.spec.job import load_job

REPO = Path(__file__).resolve().parents[1]
H100 = GPU_KINDS["H100"]

# LLaMA-Factory's examples/deepspeed/ds_z3_config.json, as that project ships it.
LLAMA_FACTORY_Z3 = """{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "zero_allow_untested_optimizer": true,
  "fp16": {
    "enabled": "auto",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "bf16": {
    "enabled": "auto"
  },
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": false,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  }
}
"""
OVERLAP_OFF_NOTE = (
    "note: overlap_comm: false (from zero.config ds_z3_config.json): communication not overlapped with compute"
)


@pytest.fixture
def job(tmp_path: Path) -> tuple[str, str]:
    """The shipped Qwen3-8B job with LLaMA-Factory's ZeRO-3 config beside it, and two nodes of 8 GPUs."""
    (tmp_path / "ds_z3_config.json").write_text(LLAMA_FACTORY_Z3, encoding="utf-8")
    text = (REPO / "jobs" / "qwen3-8b.yaml").read_text(encoding="utf-8")
    assert "  offload: auto\n" in text
    job_file = tmp_path / "qwen3-8b.yaml"
    job_file.write_text(text.replace("  offload: auto\n", "  offload: auto\n  config: ds_z3_config.json\n"))
    hosts = tmp_path / "2x8.txt"
    hosts.write_text("node0 slots=8\nnode1 slots=8\n", encoding="utf-8")
    return str(job_file), str(hosts)


def _plan(job: tuple[str, str], *extra: str):
    job_file, hosts = job
    args = ["plan", job_file, "--hosts", hosts, "--gpu-mem-gib", "80", "--host-mem-gib", "1024"]
    result = CliRunner().invoke(main, [*args, "--gpu-kind", "H100", "--link-gbps", "100", *extra])
    assert result.exit_code == 0, result.output
    return result.output


def test_overlap_comm_false_in_a_llama_factory_config_is_predicted_and_named(job):
    text = _plan(job)
    assert OVERLAP_OFF_NOTE in text
    off = json.loads(_plan(job, "--json"))
    step = off["step_time"]
    assert step["overlap"] == 0.0
    # Nothing hidden: the micro-step is compute and communication, one after the other.
    assert step["micro_step_s"] == pytest.approx(step["compute_s"] + step["comm_s"], abs=2e-3)
    assert {"key": "overlap_comm", "value": False, "source": "zero.config ds_z3_config.json"} in step["user_settings"]
    # hpZ, which the model chose to cut the exposed traffic, is in the config the job runs.
    assert off["ds_config"]["zero_optimization"].get("zero_hpz_partition_size", 1) == step["hpz_partition_size"]

    # zero.overrides wins over the file, and is named as the source.
    on_text = _plan(job, "--set", "zero.overrides={zero_optimization: {overlap_comm: true}}")
    assert "note: overlap_comm: true (from zero.overrides): communication overlapped with compute" in on_text
    assert OVERLAP_OFF_NOTE not in on_text


def test_overlap_off_costs_what_the_model_says_against_the_same_settings_overlapped(job):
    # hpZ held off in both, so that only overlap_comm differs: ~40 % slower at 100 Gbit/s (issue 41 item 14).
    fixed = "zero.overrides={zero_optimization: {zero_hpz_partition_size: 1%s}}"
    off = json.loads(_plan(job, "--set", fixed % "", "--json"))["step_time"]
    on = json.loads(_plan(job, "--set", fixed % ", overlap_comm: true", "--json"))["step_time"]
    assert (off["overlap"], on["overlap"]) == (0.0, 1.0)
    assert off["micro_step_s"] == pytest.approx(on["compute_s"] + on["comm_s"], abs=2e-3)
    assert off["micro_step_s"] / on["micro_step_s"] > 1.3
    assert off["tokens_per_s_per_gpu"] < on["tokens_per_s_per_gpu"]


def test_reuse_distance_and_persistence_threshold_of_the_user_change_the_predicted_traffic(job):
    base = "zero_hpz_partition_size: 1, overlap_comm: true"
    plain = json.loads(_plan(job, "--set", f"zero.overrides={{zero_optimization: {{{base}}}}}", "--json"))["step_time"]
    # Reuse distance 0: the weights recomputed in the backward are released and gathered once more.
    no_reuse = f"zero.overrides={{zero_optimization: {{{base}, stage3_max_reuse_distance: 0}}}}"
    text = _plan(job, "--set", no_reuse)
    assert "note: stage3_max_reuse_distance: 0 (from zero.overrides)" in text
    regathered = json.loads(_plan(job, "--set", no_reuse, "--json"))["step_time"]
    assert regathered["inter_node_gb_per_micro_step"] > plain["inter_node_gb_per_micro_step"]
    # A persistence threshold above the K/V projections (4096 × 1024): those stay whole, never gathered.
    persist = f"zero.overrides={{zero_optimization: {{{base}, stage3_param_persistence_threshold: 5000000}}}}"
    kept = json.loads(_plan(job, "--set", persist, "--json"))
    assert kept["step_time"]["inter_node_gb_per_micro_step"] < plain["inter_node_gb_per_micro_step"]
    assert kept["ds_config"]["zero_optimization"]["stage3_param_persistence_threshold"] == 5_000_000
    assert {"key": "stage3_param_persistence_threshold", "value": 5_000_000, "source": "zero.overrides"} in kept[
        "step_time"
    ]["user_settings"]


def test_the_launch_predicted_step_line_names_the_file_it_took_overlap_from(job):
    job_file, _ = job
    speed = SpeedInputs(gpu=H100, links=Links.rated(100, H100.intra_bytes_per_s, "test"))
    plan, _ = plan_for_job(read_inputs(load_job(job_file)), [8, 8], gpu_mem_gib=80, host_mem_gib=1024, speed=speed)
    line = predicted_step_line(plan.speed)
    assert "overlap_comm false (from zero.config ds_z3_config.json): communication not overlapped" in line
    assert any(note.startswith(OVERLAP_OFF_NOTE) for note in speed_notes(plan.speed))


def test_the_dry_run_marks_the_values_filled_from_auto(job):
    job_file, hosts = job
    args = ["launch", job_file, "--hosts", hosts, "--dry-run", "--gpu-mem-gib", "80", "--host-mem-gib", "1024"]
    args += ["--set", "zero.overrides={zero_optimization: {reduce_bucket_size: 20000000}}"]
    runner = CliRunner()
    out = runner.invoke(main, [*args, "--json"])
    assert out.exit_code == 0, out.output
    shown = json.loads(out.output)
    ds = shown["memory"]["ds_config"]
    filled = {item["key"]: item["value"] for item in shown["ds_config_auto_filled"]}
    assert filled == {
        "train_batch_size": ds["train_batch_size"],
        "train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 1.0,
        "fp16.enabled": False,
        "bf16.enabled": True,
        # reduce_bucket_size is the override's value, not a fill
        "zero_optimization.stage3_prefetch_bucket_size": ds["zero_optimization"]["stage3_prefetch_bucket_size"],
        "zero_optimization.stage3_param_persistence_threshold": 40960,
    }
    assert ds["zero_optimization"]["reduce_bucket_size"] == 20_000_000
    text = runner.invoke(main, args)
    assert text.exit_code == 0, text.output
    assert "ds_config.json (zero.config ds_z3_config.json, zero.overrides merged last):" in text.output
    assert f'  filled from "auto" by the plan: train_batch_size {ds["train_batch_size"]}, ' in text.output


def test_keys_left_auto_are_named_and_a_generated_config_has_no_fills():
    user = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "train_batch_size": "auto"}
    final = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "train_batch_size": 64}
    assert auto_filled(user, final) == [("train_batch_size", 64)]
    assert auto_left(final) == ["optimizer.params.lr"]
    assert auto_filled(None, final) == []
