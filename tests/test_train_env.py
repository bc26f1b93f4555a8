"""The trainer's environment defaults and command line, without starting torch."""

from __future__ import annotations

import subprocess
import sys
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


# Liger-Kernel 0.8.5's own call (liger_kernel/backends/registry.py), made the first time an op is
# dispatched, once per optional backend whose package this machine lacks; as seen on the GPU nodes.
LIGER_BACKEND_CALL = """
import logging, sys
logging.basicConfig(stream=sys.stdout, format="%(levelname)s:%(name)s:%(message)s")
if sys.argv[1] == "quiet":
    from orchestrator.train.environment import quiet_known_warnings
    quiet_known_warnings()
log = logging.getLogger("liger_kernel.backends.registry")
for path, op, kind, text in [
    ("liger_kernel.ops.backends._ascend.rope", "rope", "ImportError",
     "cannot import name 'tanh' from 'triton.language.math'"),
    ("liger_kernel.ops.backends._cutedsl.rms_norm", "rms_norm", "ModuleNotFoundError", "No module named 'cuda'"),
    ("liger_kernel.ops.backends._cutile.swiglu", "swiglu", "ModuleNotFoundError", "No module named 'cuda'"),
    ("liger_kernel.ops.backends._triton.rope", "rope", "ImportError", "libcuda.so.1: cannot open shared object"),
]:
    log.warning("Backend impl '%s' for op '%s' could not be imported: %s: %s", path, op, kind, text)
log.warning("something else liger says")
"""


def _liger_lines(mode: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", LIGER_BACKEND_CALL, mode], capture_output=True, text=True, check=True, timeout=60
    )
    return proc.stdout.splitlines()


def test_liger_optional_backends_missing_here_are_not_reported_but_its_triton_kernels_are():
    assert len(_liger_lines("plain")) == 5  # what a rank printed before the filter
    lines = _liger_lines("quiet")
    # Ascend (Huawei NPUs) and the CuTe/cuTile DSLs are alternatives Liger falls back from to Triton.
    assert not [x for x in lines if "._ascend." in x or "._cutedsl." in x or "._cutile." in x], lines
    # Triton is the one Liger runs on NVIDIA GPUs: its import failing stays visible.
    assert lines == [
        "WARNING:liger_kernel.backends.registry:Backend impl 'liger_kernel.ops.backends._triton.rope' for op 'rope' "
        "could not be imported: ImportError: libcuda.so.1: cannot open shared object",
        "WARNING:liger_kernel.backends.registry:something else liger says",
    ]
