"""train.global_batch_size / _tokens: micro × accumulation × world equals it on any hardware, or a refusal.

Through the real CLI (``dzctl plan``, ``dzctl launch --dry-run``) on Qwen3-8B's shape (the model
catalogue, no download), with the GPU and host memory given as flags, as tests/test_memory.py does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[1]

# 1 × 4 A100-40GB, 2 × 4 A100-40GB (256 GiB RAM a node, the seed's nodes), 1 × 2 H200.
HARDWARE = {
    "1x4-a100-40gb": ("node-a slots=4\n", "40", "256"),
    "2x4-a100-40gb": ("node-a slots=4\nnode-b slots=4\n", "40", "256"),
    "1x2-h200": ("node-a slots=2\n", "140", "1024"),
}


@pytest.fixture
def job(tmp_path):
    """jobs/qwen3-8b.yaml with its accumulation left to the planner and a global batch of 256 rows."""
    text = (ROOT / "jobs" / "qwen3-8b.yaml").read_text(encoding="utf-8")
    assert "  gradient_accumulation_steps: 8\n" in text
    path = tmp_path / "qwen3-8b.yaml"
    path.write_text(text.replace("  gradient_accumulation_steps: 8\n", "  global_batch_size: 256\n"), encoding="utf-8")
    return path


def dzctl(tmp_path, job, hardware, *extra):
    hosts_text, gpu, host = HARDWARE[hardware]
    hosts = tmp_path / f"{hardware}.txt"
    hosts.write_text(hosts_text, encoding="utf-8")
    argv = ["plan", str(job), "--hosts", str(hosts), "--gpu-mem-gib", gpu, "--host-mem-gib", host, *extra]
    return CliRunner().invoke(main, argv)


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_a_global_batch_of_256_rows_is_256_on_every_hardware(tmp_path, job, hardware):
    done = dzctl(tmp_path, job, hardware, "--json")
    assert done.exit_code == 0, done.output
    plan = json.loads(done.stdout)
    split = plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * plan["world_size"]
    assert split == plan["train_batch_size"] == 256
    assert plan["global_batch_fixed_by"] == "train.global_batch_size"
    assert plan["global_batch_tokens"] == 256 * 4096
    # DeepSpeed gets the same split (it refuses a train_batch_size that is not micro × accumulation × world).
    ds = plan["ds_config"]
    assert ds["train_micro_batch_size_per_gpu"] == plan["micro_batch_size"]
    assert ds["gradient_accumulation_steps"] == plan["gradient_accumulation_steps"]
    assert ds["train_batch_size"] == 256


def test_the_split_differs_by_hardware_while_the_batch_does_not(tmp_path, job):
    splits = {}
    for hardware in sorted(HARDWARE):
        plan = json.loads(dzctl(tmp_path, job, hardware, "--json").stdout)
        splits[hardware] = (plan["micro_batch_size"], plan["gradient_accumulation_steps"], plan["world_size"])
    # Three different splits of one batch (the figures README.md "Global batch" quotes).
    assert splits == {"1x2-h200": (16, 8, 2), "1x4-a100-40gb": (8, 8, 4), "2x4-a100-40gb": (4, 8, 8)}, splits
    text = dzctl(tmp_path, job, "1x2-h200").output
    m, a, w = splits["1x2-h200"]
    assert (
        f"global batch 256 rows (1,048,576 tokens at seq 4096) = micro-batch {m} × accumulation {a} × {w} ranks" in text
    )
    assert "as train.global_batch_size fixes it on any hardware" in text


def test_a_global_batch_that_does_not_split_names_the_nearest_that_do(tmp_path, job):
    done = dzctl(tmp_path, job, "2x4-a100-40gb", "--set", "train.global_batch_size=250")
    assert done.exit_code == 2
    assert "250 rows does not split into micro-batch × accumulation × world size on 8 ranks" in done.output
    assert "set train.global_batch_size to 248 or 256 (the nearest that split)" in done.output
    tokens = dzctl(
        tmp_path,
        job,
        "1x4-a100-40gb",
        "--set",
        "train.global_batch_size=null",
        "--set",
        "train.global_batch_tokens=1000000",
        "--json",
    )
    assert tokens.exit_code == 2
    error = json.loads(tokens.stdout)
    assert "not a whole number of rows of train.max_seq_len 4096" in error["error"]
    assert "nearest 999424, 1003520" in error["fix"] and error["exit_code"] == 2


def test_a_split_that_fits_no_memory_is_refused_with_the_largest_that_does(tmp_path, job):
    # Accumulation fixed at 1: 256 rows on 4 A100-40GB would need micro-batch 64.
    done = dzctl(tmp_path, job, "1x4-a100-40gb", "--set", "train.gradient_accumulation_steps=1")
    assert done.exit_code == 2
    assert "needs micro-batch 64 with gradient_accumulation_steps 1 on 4 ranks; the largest that fits is" in done.output
    largest = int(done.output.split("the largest that fits is ")[1].split()[0])
    assert f"set train.global_batch_size to at most {largest * 4}" in done.output
    assert "or leave train.gradient_accumulation_steps unset" in done.output
    # And that value does plan, with accumulation 1.
    fits = dzctl(
        tmp_path,
        job,
        "1x4-a100-40gb",
        "--set",
        "train.gradient_accumulation_steps=1",
        "--set",
        f"train.global_batch_size={largest * 4}",
        "--json",
    )
    assert fits.exit_code == 0, fits.output
    plan = json.loads(fits.stdout)
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (largest, 1)


def test_without_the_keys_the_batch_is_as_before_and_said_to_depend_on_the_hardware(tmp_path, job):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node-a slots=4\n", encoding="utf-8")
    flags = ["--hosts", str(hosts), "--gpu-mem-gib", "40", "--host-mem-gib", "256"]
    shipped = str(ROOT / "jobs" / "qwen3-8b.yaml")
    plan = json.loads(CliRunner().invoke(main, ["plan", shipped, *flags, "--json"]).stdout)
    assert plan["gradient_accumulation_steps"] == 8 and plan["global_batch_fixed_by"] is None
    assert plan["micro_batch_size"] == 13  # 13 × 8 × 4 = 416 rows (README "Global batch"; 14 before the offload
    # estimate counted the gradient DeepSpeed brings back to the GPU to accumulate, issue 42)
    assert plan["train_batch_size"] == plan["micro_batch_size"] * 8 * 4
    for command in (["plan", shipped, *flags], ["launch", shipped, *flags, "--dry-run"]):
        done = CliRunner().invoke(main, command)
        assert f"global batch {plan['train_batch_size']} rows" in done.output, command
        assert "it depends on the hardware (other GPUs fit another micro-batch)" in done.output, command


def test_both_keys_are_refused_at_load(tmp_path, job):
    done = dzctl(tmp_path, job, "1x2-h200", "--set", "train.global_batch_tokens=1048576")
    assert done.exit_code == 2
    assert "give train.global_batch_size (rows) or train.global_batch_tokens, not both" in done.output


def test_launch_refuses_a_batch_that_cannot_split_before_any_host_is_touched(tmp_path, job):
    import os
    import subprocess
    import sys

    bin_dir, marks = tmp_path / "bin", tmp_path / "ran"
    bin_dir.mkdir()
    for name in ("docker", "ssh", "scp", "torchrun", "deepspeed", "nvidia-smi"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {marks}\n")
        (bin_dir / name).chmod(0o755)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HARDWARE["2x4-a100-40gb"][0], encoding="utf-8")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    argv = ["launch", str(job), "--hosts", str(hosts), "--set", "train.global_batch_size=250"]
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "248 or 256" in done.stderr and "Traceback" not in done.stderr
    assert not marks.exists(), f"ran on a host: {marks.read_text()}"


@pytest.mark.parametrize(("fixed", "words"), [(True, "fixed by the spec"), (False, "depends on the hardware")])
def test_the_view_and_the_plain_lines_show_the_global_batch(fixed, words):
    import io

    from rich.console import Console

    from orchestrator.observe.lines import event_line
    from orchestrator.observe.view import render
    from orchestrator.observe.watchstate import JobWatch, NodeView

    watch = JobWatch("tiny", "tiny-20261203-000000-abcd", [NodeView(0, "node0", 2)], started_at=0.0, accelerator="cpu")
    start = {"event": "start", "step": 0, "world_size": 2, "global_batch_size": 16, "global_batch_fixed": fixed}
    watch.feed(0, "dzctl-progress " + json.dumps(start), 1.0)
    assert (
        event_line(start, watch)
        == f"start  tiny-20261203-000000-abcd: 2 rank(s) on 1 node(s), global batch 16 rows ({words})"
    )
    console = Console(width=140, record=True, file=io.StringIO())
    console.print(render(watch, now=2.0, width=140))
    assert f"global batch 16 rows ({words})" in console.export_text()
