"""``train.pure_bf16``: bf16 master weights, gradients and AdamW states under ZeRO-3 (DeepSpeed 0.19's
``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``).

The DeepSpeed config carries both keys; the memory plan counts what DeepSpeed keeps (10 bytes a trained parameter
instead of 16: a bf16 master copy beside the bf16 weights, bf16 gradients, bf16 m and v), so the 12-layer Qwen3-8B
shape on one H100 recomputes fewer layers; what cannot run is refused naming the key; and real ZeRO-3 on CPU (gloo)
trains with bf16 states, read from the live optimizer and from the checkpoint the trainer writes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.errors import SpecError
from orchestrator.planning import dsconfig
from orchestrator.planning.memory.estimate import SUB_GROUP_SIZE, Choice, estimate
from orchestrator.planning.shape import CATALOGUE, shape_from_config
from orchestrator.spec.job import load_job
from orchestrator.train.progress import read_events

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "jobs" / "tiny-cpu.yaml"
PURE = ("train.precision=bf16", "train.pure_bf16=true")
# The shape of benchmarks/results/plans-h100x1-20261207c's full12 launches: Qwen3-8B's layers, 12 of them.
QWEN3_8B_12 = {**CATALOGUE["Qwen/Qwen3-8B"], "num_hidden_layers": 12}
H100_GIB = 79.2  # what dzctl reads on an H100 80GB: nvidia-smi memory.total / 1024, rounded


# --- the DeepSpeed config ---------------------------------------------------------------------------


def test_the_generated_config_carries_deepspeeds_two_keys_only_with_pure_bf16():
    pure = load_job(TINY, list(PURE)).spec
    mixed = load_job(TINY, ["train.precision=bf16"]).spec
    ds = dsconfig.build_ds_config(pure, dsconfig.resolve_defaults(pure), world_size=2)
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert dsconfig.pure_bf16_of(ds)
    ds = dsconfig.build_ds_config(mixed, dsconfig.resolve_defaults(mixed), world_size=2)
    assert ds["bf16"] == {"enabled": True} and not dsconfig.pure_bf16_of(ds)


def test_a_zero_config_gets_the_keys_where_it_leaves_them_open_and_keeps_its_own_values():
    spec = load_job(TINY, list(PURE)).spec
    resolved = dsconfig.resolve_defaults(spec)
    open_keys = {"bf16": {"enabled": "auto", "bf16_optimizer_states": "auto"}, "zero_optimization": {"stage": 3}}
    assert dsconfig.ds_config_for(spec, open_keys, resolved, 2)["bf16"] == {
        "enabled": True,
        "bf16_optimizer_states": True,
        "bf16_master_weights_and_grads": True,
    }
    written = {"bf16": {"enabled": True, "bf16_optimizer_states": False}}
    assert dsconfig.ds_config_for(spec, written, resolved, 2)["bf16"]["bf16_optimizer_states"] is False


# --- the memory plan ---------------------------------------------------------------------------------


def _model_states(est) -> int:
    return sum(v for k, v in est.gpu_terms.items() if k in ("params", "grads") or "master + Adam" in k)


@pytest.mark.parametrize(
    "user",
    [
        None,
        {"bf16": {"enabled": "auto"}},
        {"bf16": {"enabled": True, "bf16_optimizer_states": "auto"}},
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": False}},
        {"bf16": {"bf16_optimizer_states": True}},
        {"zero_optimization": {"stage": 3}},
    ],
)
@pytest.mark.parametrize("sets", [PURE, ("train.precision=bf16",)])
def test_the_section_the_planner_reads_is_the_one_the_launch_writes(user, sets):
    """``bf16_section_to_run`` (what the plan reads before planning) and ``ds_config_for`` (the launch's whole
    config) make the same bf16 section, ``zero.overrides`` included, for a generated config and a user's."""
    spec = load_job(TINY, [*sets, "zero.overrides={bf16: {bf16_master_weights_and_grads: auto}}"]).spec
    resolved = dsconfig.resolve_defaults(spec)
    whole = dsconfig.ds_config_for(spec, user, resolved, 2)
    assert dsconfig.bf16_section_to_run(spec, user, resolved.precision).get("bf16") == whole.get("bf16")


def test_model_states_drop_from_16_to_10_bytes_a_parameter():
    shape = shape_from_config(QWEN3_8B_12, name="qwen3-8b-12", source="test")
    n = shape.total_params
    kw = dict(seq_len=4096, precision="bf16", world_size=1, fused_loss="liger")
    mixed = estimate(shape, Choice(1, True, "none"), **kw)
    pure = estimate(shape, Choice(1, True, "none"), pure_bf16=True, **kw)
    assert _model_states(mixed) == 16 * n  # bf16 weights 2 + bf16 grads 2 + fp32 master 4 + fp32 m, v 8
    assert _model_states(pure) == 10 * n  # bf16 weights 2 + bf16 grads 2 + bf16 master 2 + bf16 m, v 4
    assert pure.gpu_terms["bf16 master + Adam m,v"] == 6 * n and "fp32 master + Adam m,v" not in pure.gpu_terms
    assert pure.pure_bf16 and not mixed.pure_bf16
    # The step's gradient sub-group and AdamW's temporaries in the master's dtype: seen where the step is the peak.
    tiny = dict(kw, seq_len=8)
    assert estimate(shape, Choice(1, True, "none"), **tiny).gpu_terms["optimizer step temporaries"] == (
        2 * 4 * min(n, SUB_GROUP_SIZE)
    )
    assert estimate(shape, Choice(1, True, "none"), pure_bf16=True, **tiny).gpu_terms["optimizer step temporaries"] == (
        2 * 2 * min(n, SUB_GROUP_SIZE)
    )


def _h100_plan(tmp_path: Path, *sets: str, gpu_gib: float = H100_GIB, exit_code: int = 0) -> dict:
    job = tmp_path / "full12.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "full12",
                "runtime": "process",
                "model": {"name_or_path": "qwen3-8b-shape", "init": "random", "config": QWEN3_8B_12},
                "data": {"path": "synthetic:random", "format": "alpaca"},
                "train": {"max_seq_len": 4096, "global_batch_size": 32, "save": False},
            }
        )
    )
    hosts = tmp_path / "one-gpu.txt"
    hosts.write_text("localhost slots=1\n")
    argv = ["plan", str(job), "--hosts", str(hosts), "--gpu-mem-gib", str(gpu_gib), "--gpu-kind", "H100", "--json"]
    argv += ["--host-mem-gib", "125"]  # the measured H100 machine's RAM
    for item in sets:
        argv += ["--set", item]
    result = CliRunner().invoke(main, argv, env={"DZCTL_HOME": str(tmp_path / "home")})
    assert result.exit_code == exit_code, result.output
    return json.loads(result.stdout) | {"output": result.output}


def test_the_12_layer_job_on_one_h100_recomputes_fewer_layers(tmp_path):
    mixed = _h100_plan(tmp_path)
    pure = _h100_plan(tmp_path, "train.pure_bf16=true")
    assert mixed["fits"] and pure["fits"] and mixed["offload"] == pure["offload"] == "none"
    # Before: micro 8 with 11 of 12 layers recomputed (the launch of plans-h100x1-20261207c); now fewer.
    assert pure["checkpointed_layers"] < mixed["checkpointed_layers"]
    assert pure["pure_bf16"] is True and mixed["pure_bf16"] is False
    assert pure["breakdown"]["gpu"]["bf16 master + Adam m,v"] == pytest.approx(
        mixed["breakdown"]["gpu"]["fp32 master + Adam m,v"] / 2, abs=0.01
    )
    assert pure["ds_config"]["bf16"]["bf16_master_weights_and_grads"] is True
    assert pure["ds_config"]["bf16"]["bf16_optimizer_states"] is True
    # The optimizer's own step moves half the bytes (steptime.PURE_BF16_OPTIMIZER_BYTES_PER_PARAM).
    assert pure["step_time"]["optimizer_s"] == pytest.approx(mixed["step_time"]["optimizer_s"] / 2, rel=0.02)


def test_a_pure_bf16_job_that_does_not_fit_is_not_offloaded_and_the_fix_names_the_key(tmp_path):
    mixed = _h100_plan(tmp_path, gpu_gib=40)
    assert mixed["fits"] and mixed["offload"] == "optimizer"  # fp32 states may go to the host
    pure = _h100_plan(tmp_path, "train.pure_bf16=true", gpu_gib=40, exit_code=2)
    assert not pure["fits"] and pure["offload"] == "none"
    assert "or remove train.pure_bf16, which lets the planner offload" in pure["output"]


# --- what cannot run is refused, naming the key ----------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "says", "fix"),
    [
        (("train.precision=fp32",), "train.precision is fp32", "set train.precision: bf16"),
        (("train.precision=fp16",), "train.precision is fp16", "set train.precision: bf16"),
        (("train.precision=auto",), "auto, which is fp32 on accelerator: cpu", "set train.precision: bf16"),
        (("train.precision=bf16", "zero.offload=optimizer"), "zero.offload: optimizer", "zero.offload: none"),
        (("train.precision=bf16", "zero.offload=all"), "keeps the optimizer on the GPUs", "remove train.pure_bf16"),
    ],
)
def test_what_pure_bf16_cannot_run_with_is_refused_at_load(sets, says, fix):
    with pytest.raises(SpecError) as refused:
        load_job(TINY, [*sets, "train.pure_bf16=true"])
    assert "--set train.pure_bf16=true: train.pure_bf16 " in refused.value.message
    assert says in refused.value.message and fix in refused.value.fix


def test_auto_precision_on_gpus_without_bf16_is_refused_naming_the_key():
    spec = load_job(TINY, ["accelerator=gpu", "train.precision=auto", "train.pure_bf16=true"]).spec
    assert dsconfig.resolve_precision(spec, bf16_supported=True) == "bf16"
    with pytest.raises(SpecError) as refused:
        dsconfig.resolve_precision(spec, bf16_supported=False)
    assert refused.value.message.startswith("train.pure_bf16: ") and "remove train.pure_bf16" in refused.value.fix


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("zero.overrides={bf16: {bf16_optimizer_states: false}}", "leaves bf16.bf16_optimizer_states False"),
        ("zero.overrides={zero_optimization: {offload_optimizer: {device: cpu}}}", "offloads it"),
    ],
)
def test_a_deepspeed_config_that_undoes_it_is_refused_by_the_plan(tmp_path, override, says):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=2\n")
    argv = ["plan", str(TINY), "--hosts", str(hosts), "--json"]
    for item in (*PURE, override):
        argv += ["--set", item]
    result = CliRunner().invoke(main, argv, env={"DZCTL_HOME": str(tmp_path / "home")})
    assert result.exit_code == 2, result.output
    assert "train.pure_bf16" in result.output and says in result.output, result.output


# --- real ZeRO-3 on CPU (gloo) ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return {**env, **extra}


def test_deepspeeds_optimizer_keeps_a_bf16_master_copy_and_bf16_moments():
    """The live ZeRO-3 optimizer, one gloo rank, under the config dzctl generates: what the planner counts."""
    env = _env(
        DS_ACCELERATOR="cpu",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    argv = [sys.executable, str(ROOT / "tests" / "purebf16engine.py"), str(TINY), *PURE]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    kept = json.loads(run.stdout.strip().splitlines()[-1])
    assert kept["bf16_section"]["bf16_master_weights_and_grads"] is True
    assert kept["master_dtypes"] == kept["weight_dtypes"] == ["torch.bfloat16"]
    assert kept["master_apart_from_weights"]  # 2 bytes of master beside the 2 of the weights
    assert kept["gradient_dtype"] == "torch.bfloat16"
    assert kept["moment_dtypes"] == ["torch.bfloat16"] and kept["moments"] >= 2
    first, second = kept["losses"]
    assert math.isfinite(first) and math.isfinite(second) and second < first


def test_the_trainer_runs_zero3_with_bf16_adam_states_and_its_checkpoint_exports(tmp_path):
    """2 gloo ranks through the trainer (HF Trainer + DeepSpeed), 3 steps, a checkpoint at the last."""
    import torch
    from safetensors.torch import load_file

    from orchestrator.train.export import consolidated

    output = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    argv += ["-m", "orchestrator.train", str(TINY), "--output-dir", str(output)]
    for item in (*PURE, "train.max_steps=3", "train.save_steps=3"):
        argv += ["--set", item]
    run = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    losses = [e["loss"] for e in read_events(output / "progress.jsonl") if e["event"] == "step"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    checkpoint = output / "checkpoint-3"
    for rank in (0, 1):
        shard = checkpoint / "global_step3" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        states = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        assert {t.dtype for t in states["fp32_flat_groups"]} == {torch.bfloat16}  # the master partitions
        adam = states["optimizer_state_dict"]["state"].values()
        assert {s[m].dtype for s in adam for m in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    # dzctl export's consolidation of those bf16 partitions gives the weights the trainer itself gathered.
    state = consolidated(checkpoint, "global_step3")
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert set(saved) <= set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name].contiguous(), tensor), name
