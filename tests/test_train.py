"""The training entrypoint end to end: real DeepSpeed ZeRO-3 on 2 CPU processes (gloo).

jobs/tiny-cpu.yaml (a Qwen3-shaped model with random weights and the built-in
byte-level tokenizer; nothing is downloaded) trains for 6 steps, saving every 3;
a second run with ``resume: auto`` continues to step 8. Then: the loss fell, the
checkpoints are complete, the resume started at the saved step, and the
consolidated model loads with ``from_pretrained`` with exactly the weights of the
final ZeRO checkpoint (read back independently by DeepSpeed's zero_to_fp32).
Also: a checkpoint of 2 ranks is refused on 1, and a malformed data row fails
with its file and row, both as ``error`` events.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.train import checkpoints
from orchestrator.train.data.build import BAD_ROW_FIX
from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "tiny-cpu.yaml"
TIMEOUT = 900  # the first run on a machine also JIT-builds DeepSpeed's CPU shm op (~1.5 min)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def train(
    output: Path, *sets: str, nproc: int = 2, job: Path = JOB, script: Path | None = None
) -> subprocess.CompletedProcess:
    """torchrun of the trainer (or of ``script``, a wrapper taking the trainer's arguments)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    argv += [str(script)] if script else ["-m", "orchestrator.train"]
    argv += [str(job), "--output-dir", str(output)]
    for item in sets:
        argv += ["--set", item]
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, check=False)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    output = tmp_path_factory.mktemp("train") / "out"
    first = train(output, "train.max_steps=6", "train.save_steps=3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert "dzctl-train: data: building cache" in first.stdout
    first_events = read_events(output / "progress.jsonl")
    second = train(output, "train.max_steps=8", "train.save_steps=3", "train.resume=auto")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "dzctl-train: data: cached: mapped 72 examples" in second.stdout  # the resume maps, builds nothing
    all_events = read_events(output / "progress.jsonl")
    return output, first_events, all_events[len(first_events) :]


def _steps(events):
    return [e for e in events if e["event"] == "step"]


def test_loss_falls(two_runs):
    _, first, _ = two_runs
    losses = [e["loss"] for e in _steps(first)]
    assert len(losses) == 6
    assert sum(losses[:2]) / 2 - sum(losses[-2:]) / 2 > 0.5, losses


def test_same_losses_as_todays_data_path(two_runs, tmp_path):
    """The per-node cache trains exactly like the in-memory path it replaced (tests/reference_data.py)."""
    _, first, _ = two_runs
    reference = train(
        tmp_path / "out", "train.max_steps=6", "train.save_steps=3", script=ROOT / "tests" / "reference_data.py"
    )
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-5000:]
    assert "data: building cache" not in reference.stdout  # it really ran the old path
    expected = [e["loss"] for e in _steps(read_events(tmp_path / "out" / "progress.jsonl"))]
    assert [e["loss"] for e in _steps(first)] == expected


def test_progress_events(two_runs):
    _, first, _ = two_runs
    assert [e["event"] for e in first] == ["start"] + ["step"] * 3 + ["checkpoint"] + ["step"] * 3 + [
        "checkpoint",
        "end",
    ]
    for event in _steps(first):
        assert event["max_steps"] == 6 and event["learning_rate"] == pytest.approx(3e-3)
        assert event["tokens_per_s"] > 0 and event["samples_per_s"] > 0 and event["eta_s"] >= 0
        assert event["gpu_mem_peak_gib"] is None  # CPU run
    assert first[-1]["path"].endswith("/model")


def test_checkpoints_complete(two_runs):
    output, first, _ = two_runs
    assert [e["step"] for e in first if e["event"] == "checkpoint"] == [3, 6]
    # save_total_limit 2: after the second run, checkpoints 6 and 8 remain (8: the end always saves).
    found = checkpoints.list_checkpoints(output)
    assert [(c.step, c.world_size, c.complete) for c in found] == [(6, 2, True), (8, 2, True)]


def test_resume_starts_from_saved_step(two_runs):
    _, first, second = two_runs
    assert second[0]["event"] == "start" and second[0]["step"] == 6
    assert [e["step"] for e in _steps(second)] == [7, 8]
    # It continued the trained model, not a fresh one: loss stays near where run 1 left it.
    assert _steps(second)[0]["loss"] < _steps(first)[0]["loss"] - 0.5


def test_consolidated_model_has_the_trained_weights(two_runs):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output, _, second = two_runs
    assert second[-1]["event"] == "end" and second[-1]["path"] == str(output / "model")
    model = AutoModelForCausalLM.from_pretrained(output / "model", dtype=torch.float32)
    loaded = model.state_dict()
    # The fp32 master weights of the final ZeRO checkpoint, merged from both ranks' shards.
    trained = get_fp32_state_dict_from_zero_checkpoint(str(output / "checkpoint-8"))
    assert set(trained) == set(loaded)
    for name, tensor in trained.items():
        assert loaded[name].numel() > 0, name
        assert torch.equal(loaded[name], tensor.float()), name
    tokenizer = AutoTokenizer.from_pretrained(output / "model")
    text = "三原色是什么？"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_other_world_size_refused_before_training(two_runs, tmp_path):
    output, _, _ = two_runs
    copy = tmp_path / "out"
    shutil.copytree(output, copy)
    result = train(copy, "train.max_steps=10", nproc=1)
    assert result.returncode != 0
    assert "written by 2 data-parallel ranks; this run has 1" in result.stderr
    assert "deepspeed.checkpoint.ds_to_universal" in result.stderr
    last = read_events(copy / "progress.jsonl")[-1]
    assert last["event"] == "error" and "written by 2 data-parallel ranks" in last["reason"]


def test_malformed_row_is_an_error_event(tmp_path):
    rows = tmp_path / "bad.jsonl"
    rows.write_text('{"instruction": "一", "output": "二"}\n{"instruction": "三"}\n', encoding="utf-8")
    job = tmp_path / "job.yaml"
    job.write_text(JOB.read_text(encoding="utf-8").replace("data/tiny-alpaca-zh.jsonl", str(rows)), encoding="utf-8")
    # No launcher: a plain `python -m orchestrator.train` is one rank.
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.train", str(job), "--output-dir", str(tmp_path / "out")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: {rows}:row 2: missing key 'output'" in result.stderr
    assert "Traceback" not in result.stderr
    (event,) = read_events(tmp_path / "out" / "progress.jsonl")
    message = f"{rows}:row 2: missing key 'output'"
    assert event["event"] == "error" and event["reason"] == f"{message} (fix: {BAD_ROW_FIX})"
    assert (event["message"], event["fix"], event["exit_code"]) == (message, BAD_ROW_FIX, 2)
    assert f"fix: {BAD_ROW_FIX}" in result.stderr
    assert json.dumps(event)  # plain JSON


def test_pretrained_model_continues_from_its_weights(two_runs, tmp_path):
    """``model.init: pretrained`` from a local folder (loaded partitioned under zero.Init), tokenizer from it too."""
    output, first, _ = two_runs
    job = tmp_path / "job.yaml"
    text = JOB.read_text(encoding="utf-8").replace(
        "data/tiny-alpaca-zh.jsonl", str(JOB.parent / "data/tiny-alpaca-zh.jsonl")
    )
    job.write_text(text, encoding="utf-8")
    result = train(
        tmp_path / "out",
        f"model.name_or_path={output / 'model'}",
        "model.init=pretrained",
        "model.config=null",
        "model.tokenizer=null",
        "train.max_steps=2",
        "train.save_steps=2",
        job=job,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    events = read_events(tmp_path / "out" / "progress.jsonl")
    first_loss = _steps(events)[0]["loss"]
    # Same seed, same first batch as run 1, whose random model started near ln(384) = 5.95.
    assert first_loss < _steps(first)[0]["loss"] - 0.5
