"""``dzctl launch --dry-run`` runs every local check the launch runs and exits as the launch would.

The launch reads the job's files and plans memory before it touches a host; the dry run
does the same on the hardware the user gives (``--gpu-mem-gib``, ``--host-mem-gib``) or,
when every node is this machine, on what this machine has (its ``nvidia-smi`` is the
recorded H200 output here: these machines have no GPU).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from click.testing import CliRunner

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[1]
QWEN72B = str(ROOT / "jobs/qwen72b.yaml")
TWO_BY_FOUR = str(ROOT / "hostfiles/2x4.txt")
TINY = str(ROOT / "jobs/tiny-cpu.yaml")
LOCALHOST = str(ROOT / "hostfiles/localhost.txt")
H200_QUERY = ROOT / "tests/fixtures/h200x2/query-gpu.csv"


def dzctl(*args: str):
    return CliRunner().invoke(main, list(args))


def test_dry_run_refuses_the_72b_job_on_the_seed_hardware_as_the_launch_does():
    result = dzctl(
        "launch", QWEN72B, "--hosts", TWO_BY_FOUR, "--dry-run", "--gpu-mem-gib", "40", "--host-mem-gib", "256"
    )
    assert result.exit_code == 2, result.output
    assert "does not fit on 2 node(s) × 4 GPU(s), 40.0 GiB per GPU, 256.0 GiB host RAM per node" in result.output
    assert "Traceback" not in result.output


def test_dry_run_refuses_a_missing_shipped_data_file_naming_it():
    result = dzctl("launch", TINY, "--hosts", LOCALHOST, "--dry-run", "--set", "data.path=data/missing.jsonl")
    assert result.exit_code == 2, result.output
    assert "data/missing.jsonl" in result.output


def test_dry_run_of_a_gpu_job_on_remote_nodes_asks_for_their_gpu_memory():
    result = dzctl("launch", QWEN72B, "--hosts", TWO_BY_FOUR, "--dry-run")
    assert result.exit_code == 2, result.output
    assert "--gpu-mem-gib" in result.output


def test_dry_run_prints_the_memory_plan_and_the_ds_config():
    args = ("launch", QWEN72B, "--hosts", TWO_BY_FOUR, "--dry-run", "--gpu-mem-gib", "140", "--host-mem-gib", "2048")
    shown = dzctl(*args, "--json")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert data["world_size"] == 8 and [n["node_rank"] for n in data["nodes"]] == [0, 1]
    memory = data["memory"]
    assert memory["fits"] is True
    assert memory["ds_config"]["zero_optimization"]["stage"] == 3
    assert memory["ds_config"]["train_micro_batch_size_per_gpu"] == memory["micro_batch_size"]
    text = dzctl(*args)
    assert text.exit_code == 0, text.output
    assert f"choice: micro-batch {memory['micro_batch_size']} " in text.output
    assert '"train_micro_batch_size_per_gpu"' in text.output, "the text form shows the ds_config"


def _fake_nvidia_smi(folder: Path) -> Path:
    """An ``nvidia-smi`` that prints what the real one printed on two H200s for preflight's query."""
    tool = folder / "nvidia-smi"
    tool.write_text(f'#!/bin/sh\ncase "$*" in *--query-gpu=*) cat {H200_QUERY} ;; *) exit 9 ;; esac\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return folder


def test_plan_and_dry_run_on_localhost_read_this_machines_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_nvidia_smi(tmp_path)}:{Path('/usr/bin')}:{Path('/bin')}")
    gpu_job = ("--set", "accelerator=gpu")
    planned = dzctl("plan", TINY, "--hosts", LOCALHOST, *gpu_job, "--json")
    assert planned.exit_code == 0, planned.output
    data = json.loads(planned.output)
    assert data["gpu_mem_gib"] == round(143771 / 1024, 1)
    meminfo = Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]
    assert data["host_mem_gib"] == round(int(meminfo) * 1024 / 2**30, 1), "and this machine's RAM"
    dry = dzctl("launch", TINY, "--hosts", LOCALHOST, *gpu_job, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["memory"]["gpu_mem_gib"] == round(143771 / 1024, 1)


def test_plan_on_localhost_without_nvidia_smi_still_asks_for_gpu_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    result = dzctl("plan", TINY, "--hosts", LOCALHOST, "--set", "accelerator=gpu")
    assert result.exit_code == 2, result.output
    assert "--gpu-mem-gib" in result.output


def test_slurm_dry_run_refuses_a_missing_shipped_data_file_as_the_submission_does(tmp_path):
    result = dzctl(
        "launch", TINY, "--slurm", "--nodes", "2", "--dry-run",
        "--set", f"launch.remote_dir={tmp_path}", "--set", "data.path=data/missing.jsonl",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "data/missing.jsonl" in result.output


def test_memory_flags_without_dry_run_are_refused_rather_than_ignored():
    result = dzctl("launch", QWEN72B, "--hosts", TWO_BY_FOUR, "--gpu-mem-gib", "40")
    assert result.exit_code == 2, result.output
    assert "--gpu-mem-gib" in result.output and "--dry-run" in result.output
    on_slurm = dzctl("launch", TINY, "--slurm", "--dry-run", "--host-mem-gib", "64")
    assert on_slurm.exit_code == 2, on_slurm.output
    assert "slurm.gpu_mem_gib" in on_slurm.output
