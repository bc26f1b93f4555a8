"""A job whose own DeepSpeed settings dzctl cannot run is refused at plan time (exit 2, no traceback): ZenFlow, and
a ZeRO stage other than 3 given in ``zero.overrides``.

Measured: two launches of the 18-layer Qwen3-8B shape on one H100 with the optimizer offloaded and
``zero_optimization.zenflow`` set (DeepSpeed 0.19.8) failed in the first forward, with hidden states as wide as
the vocabulary (``benchmarks/results/plans-h100x1-20261207e/off-zenflow-noliger-1.log``). Why, in DeepSpeed's
source: ``orchestrator/planning/dsconfig.py::refuse_unsupported``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from shapejobs import write_shape_job

from orchestrator.cli import main
from orchestrator.errors import InputError

ZENFLOW = {"topk_ratio": 0.05, "update_interval": 4, "overlap_step": True}
OFFLOADED = {"stage": 3, "offload_optimizer": {"device": "cpu"}}  # a zero.config's own offload, as launched


def _job(tmp_path: Path, zero: dict) -> Path:
    train = {"max_seq_len": 4096, "global_batch_size": 32, "save": False}
    return write_shape_job(tmp_path / "job.yaml", "zenflow", train, layers=18, zero={"offload": "optimizer", **zero})


def _plan(tmp_path: Path, job: Path, *extra: str):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=1\n", encoding="utf-8")
    args = ["plan", str(job), "--hosts", str(hosts), "--gpu-mem-gib", "80", "--host-mem-gib", "125", *extra]
    return CliRunner().invoke(main, args)


def _line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if text in line)


def _assert_refusal(result, where: str) -> None:
    assert result.exit_code == InputError.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = result.output
    assert where in message, message
    assert "zero_optimization.zenflow" in message
    assert "ZeRO-3" in message and "first forward" in message
    assert "transposed" in message
    fix = message.split("fix: ", 1)[1]
    assert "remove" in fix and "zenflow" in fix
    assert "offload_optimizer.ratio" in fix and "train.pure_bf16" in fix


def test_zenflow_in_the_jobs_zero_overrides_is_refused_naming_its_line(tmp_path):
    job = _job(tmp_path, {"overrides": {"zero_optimization": {"zenflow": ZENFLOW}}})
    result = _plan(tmp_path, job)
    _assert_refusal(result, f"{job}:{_line_of(job, 'zenflow:')}")


def test_zenflow_given_with_set_is_refused_naming_the_set(tmp_path):
    job = _job(tmp_path, {})
    item = "zero.overrides={zero_optimization: {zenflow: {topk_ratio: 0.05, update_interval: 4}}}"
    _assert_refusal(_plan(tmp_path, job, "--set", item), f"--set {item}")


def test_zenflow_given_with_a_dotted_set_is_refused_naming_the_set(tmp_path):
    job = _job(tmp_path, {})
    item = "zero.overrides.zero_optimization.zenflow.topk_ratio=0.05"
    _assert_refusal(_plan(tmp_path, job, "--set", item), f"--set {item}")


def test_zenflow_in_the_zero_config_file_is_refused_naming_the_file(tmp_path):
    config = tmp_path / "ds_z3.json"
    config.write_text(
        json.dumps({"zero_optimization": {**OFFLOADED, "zenflow": ZENFLOW}}, indent=2) + "\n", encoding="utf-8"
    )
    job = _job(tmp_path, {"config": config.name})
    result = _plan(tmp_path, job)
    _assert_refusal(result, f"{config}: zero_optimization.zenflow")
    assert f"{job}:{_line_of(job, f'config: {config.name}')}" in result.output  # where the job names that file


def test_zenflow_refused_in_json_output_too(tmp_path):
    job = _job(tmp_path, {"overrides": {"zero_optimization": {"zenflow": ZENFLOW}}})
    result = _plan(tmp_path, job, "--json")
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout.strip().splitlines()[-1])
    assert "zero_optimization.zenflow" in error["error"] and error["exit_code"] == 2
    assert "offload_optimizer.ratio" in error["fix"]


def test_launch_refuses_zenflow_before_any_host_is_touched(tmp_path):
    job = _job(tmp_path, {"overrides": {"zero_optimization": {"zenflow": ZENFLOW}}})
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("unreachable.invalid slots=1\n", encoding="utf-8")  # preflight would fail on it: never reached
    result = CliRunner().invoke(main, ["launch", str(job), "--hosts", str(hosts)])
    _assert_refusal(result, f"{job}:{_line_of(job, 'zenflow:')}")
    assert "preflight" not in result.output and "unreachable.invalid" not in result.output


def test_overrides_that_clear_the_config_files_zenflow_plan(tmp_path):
    config = tmp_path / "ds_z3.json"
    config.write_text(json.dumps({"zero_optimization": {**OFFLOADED, "zenflow": ZENFLOW}}), encoding="utf-8")
    job = _job(tmp_path, {"config": config.name, "overrides": {"zero_optimization": {"zenflow": None}}})
    result = _plan(tmp_path, job)
    assert result.exit_code == 0, result.output


def test_the_same_job_without_zenflow_plans(tmp_path):
    job = _job(tmp_path, {"overrides": {"zero_optimization": {"offload_optimizer": {"pin_memory": True}}}})
    result = _plan(tmp_path, job)
    assert result.exit_code == 0, result.output
    assert "zenflow" not in result.output


@pytest.mark.parametrize("how", ["job", "set"])
def test_a_zero_stage_other_than_3_in_zero_overrides_is_refused_naming_where(tmp_path, how):
    """Planned exit 0 before: the plan was ZeRO-3's, and DeepSpeed would have run stage 2."""
    if how == "job":
        job = _job(tmp_path, {"overrides": {"zero_optimization": {"stage": 2}}})
        result, where = _plan(tmp_path, job), f"{job}:{_line_of(job, 'stage: 2')}"
    else:
        job = _job(tmp_path, {})
        result = _plan(tmp_path, job, "--set", "zero.overrides.zero_optimization.stage=2")
        where = "--set zero.overrides.zero_optimization.stage=2"
    assert result.exit_code == InputError.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert f"{where}: zero.overrides: zero_optimization.stage is 2" in result.output, result.output
    assert "remove zero_optimization.stage from zero.overrides" in result.output.split("fix: ", 1)[1]


def test_stage_3_in_zero_overrides_still_plans(tmp_path):
    job = _job(tmp_path, {"overrides": {"zero_optimization": {"stage": 3}}})
    assert _plan(tmp_path, job).exit_code == 0
