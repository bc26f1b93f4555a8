"""orchestrator/planning/dsconfig.py: the DeepSpeed config from the spec, pure and torch-free."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.planning import dsconfig
from orchestrator.planning.dsconfig import Resolved
from orchestrator.spec.job import load_job

ROOT = Path(__file__).resolve().parent.parent


def _job(tmp_path: Path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    return load_job(path)


BASE = """\
name: t
accelerator: gpu
model: {name_or_path: m, init: random, config: {model_type: qwen3, hidden_size: 4096}}
data: {path: d.jsonl}
train: {gradient_accumulation_steps: 8, learning_rate: 2.0e-5, weight_decay: 0.1}
"""


def test_resolve_defaults_gpu_is_safe_not_fast(tmp_path):
    spec = _job(tmp_path, BASE).spec
    assert dsconfig.resolve_defaults(spec) == Resolved(
        micro_batch_size=1,
        gradient_checkpointing=True,
        offload_optimizer=False,
        offload_param=False,
        reduce_bucket_size=4096 * 4096,
        prefetch_bucket_size=int(0.9 * 4096 * 4096),
        param_persistence_threshold=40960,
        precision="bf16",
    )


def test_precision_auto(tmp_path):
    spec = _job(tmp_path, BASE).spec
    assert dsconfig.resolve_precision(spec, bf16_supported=True) == "bf16"
    assert dsconfig.resolve_precision(spec, bf16_supported=False) == "fp16"
    cpu = _job(tmp_path, BASE.replace("accelerator: gpu", "accelerator: cpu")).spec
    assert dsconfig.resolve_precision(cpu) == "fp32"
    fixed = _job(tmp_path, BASE.replace("weight_decay: 0.1}", "weight_decay: 0.1, precision: fp16}")).spec
    assert dsconfig.resolve_precision(fixed, bf16_supported=True) == "fp16"


def test_unknown_hidden_size_leaves_buckets_auto(tmp_path):
    spec = _job(tmp_path, BASE.replace(", hidden_size: 4096", "")).spec
    resolved = dsconfig.resolve_defaults(spec)
    zero = dsconfig.build_ds_config(spec, resolved, 2)["zero_optimization"]
    assert zero["reduce_bucket_size"] == "auto"
    assert zero["stage3_prefetch_bucket_size"] == "auto"
    assert zero["stage3_param_persistence_threshold"] == "auto"


def test_build_no_offload_whole_value(tmp_path):
    spec = _job(tmp_path, BASE).spec
    resolved = Resolved(4, True, False, False, 100, 90, 10, "bf16")
    assert dsconfig.build_ds_config(spec, resolved, world_size=16) == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "train_batch_size": 4 * 8 * 16,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 100,
            "stage3_prefetch_bucket_size": 90,
            "stage3_param_persistence_threshold": 10,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        # No "optimizer": the Trainer passes torch's fused AdamW (see the module).
        "bf16": {"enabled": True},
        "fp16": {
            "enabled": False,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def test_offload_all_uses_deepspeed_cpu_adam_with_pinned_memory(tmp_path):
    spec = _job(tmp_path, BASE).spec
    ds = dsconfig.build_ds_config(spec, Resolved(2, True, True, True, None, None, None, "fp16"), 2)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert ds["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1},
    }
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert ds["bf16"] == {"enabled": False}
    assert dsconfig.offload_of(ds) == (True, True)
    assert dsconfig.precision_of(ds) == "fp16"


def test_offload_optimizer_only(tmp_path):
    spec = _job(tmp_path, BASE).spec
    ds = dsconfig.build_ds_config(spec, Resolved(2, True, True, False, None, None, None, "bf16"), 2)
    assert "offload_param" not in ds["zero_optimization"]
    assert dsconfig.offload_of(ds) == (True, False)


def test_overrides_merge_last_and_deep(tmp_path):
    text = BASE + "zero: {overrides: {zero_optimization: {overlap_comm: false}, gradient_clipping: 0.5}}\n"
    spec = _job(tmp_path, text).spec
    ds = dsconfig.build_ds_config(spec, dsconfig.resolve_defaults(spec), 2)
    assert ds["zero_optimization"]["overlap_comm"] is False
    assert ds["zero_optimization"]["contiguous_gradients"] is True  # siblings kept
    assert ds["gradient_clipping"] == 0.5


def test_world_size_must_be_positive(tmp_path):
    spec = _job(tmp_path, BASE).spec
    with pytest.raises(ValueError):
        dsconfig.build_ds_config(spec, dsconfig.resolve_defaults(spec), 0)


def test_user_config_autos_filled_and_overrides_applied(tmp_path):
    (tmp_path / "seed.json").write_text((ROOT / "benchmarks" / "seed_ds_config.json").read_text(), encoding="utf-8")
    text = BASE + "zero: {config: seed.json, overrides: {steps_per_print: 5}}\n"
    loaded = _job(tmp_path, text)
    resolved = Resolved(2, True, True, True, 16, 15, 1, "fp16")
    ds = dsconfig.job_ds_config(loaded, resolved, world_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 8
    assert ds["train_batch_size"] == 2 * 8 * 4
    assert ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"]["reduce_bucket_size"] == 16
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 15
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 1
    # The Trainer resolves these from its arguments, which come from the same spec.
    assert ds["optimizer"]["params"]["lr"] == "auto"
    assert ds["steps_per_print"] == 5
    assert dsconfig.precision_of(ds) == "fp16"


def test_user_config_missing_names_the_key_line(tmp_path):
    loaded = _job(tmp_path, BASE + "zero:\n  config: nothere.json\n")
    with pytest.raises(SpecError) as err:
        dsconfig.load_user_config(loaded)
    assert f"{tmp_path / 'job.yaml'}:7: zero.config: file not found" in str(err.value)


def test_user_config_bad_json_names_file_and_line(tmp_path):
    (tmp_path / "ds.json").write_text('{\n  "zero_optimization": {\n    "stage": 3,\n  }\n}\n', encoding="utf-8")
    loaded = _job(tmp_path, BASE + "zero: {config: ds.json}\n")
    with pytest.raises(SpecError) as err:
        dsconfig.load_user_config(loaded)
    assert str(err.value).startswith(f"{tmp_path / 'ds.json'}:4: not valid JSON")


def test_user_config_other_stage_refused(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}), encoding="utf-8")
    loaded = _job(tmp_path, BASE + "zero: {config: ds.json}\n")
    with pytest.raises(SpecError, match="stage is 2; dzctl runs ZeRO stage 3 only"):
        dsconfig.load_user_config(loaded)


def test_tiny_cpu_job_config():
    loaded = load_job(ROOT / "jobs" / "tiny-cpu.yaml")
    resolved = dsconfig.resolve_defaults(loaded.spec)
    assert (resolved.micro_batch_size, resolved.gradient_checkpointing, resolved.precision) == (4, False, "fp32")
    ds = dsconfig.job_ds_config(loaded, resolved, 2)
    assert ds["train_batch_size"] == 8 and dsconfig.offload_of(ds) == (False, False)


def test_controller_side_never_imports_torch():
    code = (
        "import sys, orchestrator.planning.dsconfig, orchestrator.train.data.conversations\n"
        "import orchestrator.train.checkpoints, orchestrator.train.progress, orchestrator.train.entry\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
