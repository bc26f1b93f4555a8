"""Where the optimizer must be offloaded, the plan's note names ``train.pure_bf16`` when that keeps it on the GPUs
and is predicted faster (``planning/speed/purechoice.py``).

Measured on one H100 (the 18-layer Qwen3-8B shape, SFT rows, seq 4096, global batch 32): the auto plan offloads
the whole optimizer (micro 4 x 8) and ran 10,720 tokens/s; with ``train.pure_bf16`` the optimizer stays on the GPU
(micro 8 x 4, 15 of 18 recomputed) and ran 18,146 (benchmarks/results/plans-h100x1-20261207e). Pure: ``dzctl
plan`` on one H100's memory, no GPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner
from shapejobs import write_shape_job

from orchestrator.cli import main
from orchestrator.planning.speed.partialchoice import MIN_GAIN

H100 = ("--gpu-mem-gib", "80", "--gpu-kind", "H100")
H200 = ("--gpu-mem-gib", "140", "--gpu-kind", "H200")
NOTE = "train.pure_bf16 keeps the optimizer on the GPUs"


def _plan(tmp_path: Path, *sets: str, gpus: tuple[str, ...] = H100, method: str = "full") -> dict:
    train = {"method": method, "max_seq_len": 4096, "global_batch_size": 32, "save": False}
    job = write_shape_job(tmp_path / "job.yaml", "pure-bf16-choice", train, layers=18)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=1\n", encoding="utf-8")
    args = ["plan", str(job), "--hosts", str(hosts), "--host-mem-gib", "125", *gpus, "--host-adam-rate", "3.4"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _notes(plan: dict) -> list[str]:
    return [note for note in plan["step_time"]["notes"] if NOTE in note]


def test_the_offloaded_h100_plan_names_pure_bf16_and_its_predicted_gain(tmp_path):
    plan = _plan(tmp_path)
    assert plan["zero"]["offload_optimizer"] is True
    (note,) = _notes(plan)
    assert "--set train.pure_bf16=true" in note and "pure_bf16: true" in note and "bf16: full" in note
    gain = float(re.search(r"\(\+([\d.]+)%\)", note)[1]) / 100
    assert gain > MIN_GAIN
    assert "18,146" in note and "10,720" in note


def test_the_notes_prediction_is_what_the_pure_bf16_plan_predicts(tmp_path):
    (note,) = _notes(_plan(tmp_path))
    predicted = float(re.search(r": ([\d,]+) tokens/s/GPU against", note)[1].replace(",", ""))
    pure = _plan(tmp_path, "train.pure_bf16=true")
    assert pure["fits"] is True and pure["zero"]["offload_optimizer"] is False
    assert round(pure["step_time"]["tokens_per_s_per_gpu"]) == predicted
    micro, recomputed = pure["micro_batch_size"], pure["checkpointed_layers"]
    assert f"micro-batch {micro}, {recomputed} of 18 layers recomputed" in note


def test_no_pure_bf16_note_where_it_is_on_the_gpu_fits_or_the_user_chose(tmp_path):
    assert not _notes(_plan(tmp_path, "train.pure_bf16=true"))
    h200 = _plan(tmp_path, gpus=H200)
    assert h200["zero"]["offload_optimizer"] is False and not _notes(h200)
    forced = _plan(tmp_path, "zero.offload=optimizer")
    assert forced["zero"]["offload_optimizer"] is True and not _notes(forced)
    assert not _notes(_plan(tmp_path, method="lora"))
