"""The trainer's environment defaults and command line, without starting torch."""

from __future__ import annotations

from pathlib import Path

from orchestrator.spec.job import load_job
from orchestrator.train.entry import default_output_dir, parse_args, single_rank_defaults
from orchestrator.train.environment import early_defaults

ROOT = Path(__file__).resolve().parent.parent


def test_early_defaults_never_override():
    env = {"TORCH_EXTENSIONS_DIR": "/opt/ops"}
    applied = early_defaults("cpu", env)
    assert env["TORCH_EXTENSIONS_DIR"] == "/opt/ops" and "TORCH_EXTENSIONS_DIR" not in applied
    assert env["DS_ACCELERATOR"] == "cpu"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env  # a CUDA allocator setting; CPU runs have none


def test_gpu_leaves_accelerator_to_deepspeed():
    env: dict[str, str] = {}
    early_defaults("gpu", env)
    assert "DS_ACCELERATOR" not in env and env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_allocator_setting_of_the_user_wins():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    applied = early_defaults("gpu", env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512" and "PYTORCH_CUDA_ALLOC_CONF" not in applied


def test_single_rank_defaults_only_without_a_launcher():
    env = {"RANK": "3", "WORLD_SIZE": "8"}
    single_rank_defaults(env)
    assert env == {"RANK": "3", "WORLD_SIZE": "8"}
    bare: dict[str, str] = {}
    single_rank_defaults(bare)
    assert (bare["RANK"], bare["WORLD_SIZE"], bare["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert 0 < int(bare["MASTER_PORT"]) < 65536


def test_output_dir(tmp_path, monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "node7")
    job = tmp_path / "job.yaml"
    job.write_text((ROOT / "jobs" / "tiny-cpu.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    spec = load_job(job, ["launch.remote_dir=/shared/{host}/dz"]).spec
    assert default_output_dir(spec) == Path("/shared/node7/dz/output/tiny-cpu")
    spec = load_job(job, ["train.output_dir=/ckpt/{host}"]).spec
    assert default_output_dir(spec) == Path("/ckpt/node7")


def test_command_line():
    args = parse_args(["/job/job.yaml", "--ds-config", "ds.json", "--set", "a=1", "--set", "b=2", "--no-save"])
    assert (args.job, args.ds_config, args.overrides, args.no_save) == (
        Path("/job/job.yaml"),
        Path("ds.json"),
        ["a=1", "b=2"],
        True,
    )
