"""`dzctl tune` (issue 42, the measured safety net): the planner's top candidates run a few steps each on one
node, the fastest is kept in $DZCTL_HOME/calibration.json, and later plans use it and say so.

The end-to-end test runs the real product: two real launches of the tiny CPU job (ZeRO-3 on gloo, process
runtime, localhost, one rank, 4 steps each), then `dzctl plan --json` on the calibration they wrote. The
rest is pure: the calibration's key, the candidates measured, the runner going on past a failed candidate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.backends.tune import measure_each, median_tokens_per_s
from orchestrator.errors import RuntimeFailure
from orchestrator.planning.memory.estimate import Choice
from orchestrator.planning.memory.search import Allowed, Hardware, plan_memory
from orchestrator.planning.shape import catalogue_config, shape_from_config
from orchestrator.planning.speed.calibration import (
    Calibration,
    CalibrationInput,
    Measured,
    calibrations_text,
    key_for,
    kind_of,
    parse_calibrations,
    shape_fingerprint,
    tune_candidates,
)

ROOT = Path(__file__).resolve().parents[1]


def _shape(layers: int = 36, name: str = "Qwen/Qwen3-8B"):
    _, config = catalogue_config(name)
    return shape_from_config({**config, "num_hidden_layers": layers}, name=name, source="test")


# -- the key (pure) ------------------------------------------------------------------------------------------
def test_the_calibration_key_holds_for_one_gpu_kind_model_shape_seq_len_method_precision_and_ranks():
    shape = _shape()
    key = key_for(shape, kind="H100", seq_len=4096, method="lora", precision="bf16", ranks_per_node=8)
    assert key.text() == f"H100|shape {shape_fingerprint(shape)}|seq 4096|lora|bf16|8 per node"
    # nvidia-smi's name and --gpu-kind's are one kind; a CPU job's is "cpu"; a GPU with no name has none
    assert kind_of("gpu", "NVIDIA H100 80GB HBM3") == kind_of("gpu", "h100") == "H100"
    assert kind_of("gpu", "NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert kind_of("gpu", "NVIDIA GeForce RTX 4090") == "NVIDIA GeForce RTX 4090"
    assert kind_of("cpu", None) == "cpu" and kind_of("gpu", None) is None
    # the shape's sizes, not its name or where they were read, make the fingerprint
    renamed = shape_from_config(dict(catalogue_config("Qwen/Qwen3-8B")[1]), name="my-copy", source="elsewhere")
    assert shape_fingerprint(renamed) == shape_fingerprint(shape)
    assert shape_fingerprint(_shape(layers=18)) != shape_fingerprint(shape)
    others = {
        key_for(shape, kind="H200", seq_len=4096, method="lora", precision="bf16", ranks_per_node=8),
        key_for(shape, kind="H100", seq_len=2048, method="lora", precision="bf16", ranks_per_node=8),
        key_for(shape, kind="H100", seq_len=4096, method="full", precision="bf16", ranks_per_node=8),
        key_for(shape, kind="H100", seq_len=4096, method="lora", precision="fp16", ranks_per_node=8),
        key_for(shape, kind="H100", seq_len=4096, method="lora", precision="bf16", ranks_per_node=4),
    }
    assert len({k.text() for k in others} | {key.text()}) == 6


def test_a_record_round_trips_through_the_file_text_and_a_broken_file_is_named():
    shape = _shape()
    key = key_for(shape, kind="cpu", seq_len=128, method="full", precision="fp32", ranks_per_node=1)
    record = Calibration(
        key,
        (Measured(4, 0, "none", 1, tokens_per_s=900.0, predicted_tokens_per_s=950.0),
         Measured(2, 0, "none", 2, tokens_per_s=1200.0),
         Measured(1, 0, "none", 3, error="exit code 1")),
        "2026-12-06T10:00:00+00:00", 4, 2, "0.1.0", "abc",
    )  # fmt: skip
    records = parse_calibrations(calibrations_text({key.text(): record}), "cal.json")
    found = CalibrationInput(records, "cpu").lookup(key)
    assert found == record and found.fastest.micro_batch_size == 2
    assert found.measured[0].predicted_tokens_per_s == 950.0  # the model's figure is kept beside the measured one
    assert found.source_line() == (
        "from calibration (measured 2026-12-06 on cpu: 1,200 tokens/s; the model ranked it 2nd)"
    )
    with pytest.raises(Exception, match=r"cal.json:1: not JSON"):
        parse_calibrations("{nope", "cal.json")


# -- which candidates, and how each is measured (pure) --------------------------------------------------------
def test_the_plan_ranks_its_fitting_candidates_and_tune_takes_the_top_k_with_the_model_choice_first():
    shape = _shape(layers=18)
    plan = plan_memory(
        shape,
        allowed=Allowed(offload="none"),
        seq_len=4096,
        precision="bf16",
        gradient_accumulation_steps=1,
        hardware=Hardware((8,), 80.0, 1000.0),
        fused_loss="liger",
        kv_repeated=True,
    )
    assert plan.fits and len(plan.ranked) >= 4
    assert plan.ranked[0] == plan.choice  # the model's fastest is its choice
    fitting = {c for c, ok, _ in plan.candidates if ok}
    assert set(plan.ranked) <= fitting
    assert len({c.micro_batch_size for c in plan.ranked}) == len(plan.ranked)  # one per micro-batch
    top = tune_candidates(plan.ranked, plan.choice, 4)
    assert top == list(plan.ranked[:4])
    moved = Choice(3, True, "none", 5)  # a ZeRO setting moved the model's micro-batch after the search
    assert tune_candidates(plan.ranked, moved, 3) == [moved, *plan.ranked[:2]]


class _Notes:
    """What measure_each tells the user, kept."""

    def __init__(self):
        self.lines: list[str] = []

    def note(self, text):
        self.lines.append(text)


def test_a_candidate_that_fails_is_recorded_with_its_reason_and_the_others_still_run():
    candidates = [Choice(4, False, "none"), Choice(8, True, "none", 1), Choice(2, False, "none")]
    ran = []

    def run(rank, choice):
        ran.append(choice.micro_batch_size)
        if rank == 2:
            raise RuntimeFailure("job x failed: CUDA out of memory")
        return Measured(0, 0, "none", 0, tokens_per_s=100.0 * rank)

    notes = _Notes()
    measured = measure_each(candidates, 2, run, notes)
    assert ran == [4, 8, 2, 4]  # the model's choice, beaten, once more at the end: no faster, the first run counts
    assert measured == [
        Measured(4, 0, "none", 1, tokens_per_s=100.0),
        Measured(8, 1, "none", 2, error="job x failed: CUDA out of memory"),
        Measured(2, 0, "none", 3, tokens_per_s=300.0),
    ]
    assert "tune: candidate 2: failed: job x failed: CUDA out of memory" in notes.lines


def test_the_models_choice_beaten_runs_again_last_and_its_faster_run_counts():
    """It runs first and alone pays a node's first launch (one H100: 10,074 tokens/s as a tune's first launch
    against 12,700 launched alone): where another candidate beats it, it runs once more at the end."""
    candidates = [Choice(2, False, "none"), Choice(4, True, "none", 17)]
    rates = iter([10_074.0, 11_183.0, 12_700.0])
    ran = []

    def run(rank, choice):
        ran.append(rank)
        return Measured(0, 0, "none", 0, tokens_per_s=next(rates))

    notes = _Notes()
    measured = measure_each(candidates, 36, run, notes)
    assert ran == [1, 2, 1]
    assert [m.tokens_per_s for m in measured] == [12_700.0, 11_183.0]
    assert measured[0].model_rank == 1 and measured[0].micro_batch_size == 2
    assert any(line.startswith("tune: candidate 1 again, last") for line in notes.lines)


def test_the_models_choice_that_is_fastest_runs_once():
    ran = []

    def run(rank, choice):
        ran.append(rank)
        return Measured(0, 0, "none", 0, tokens_per_s=1000.0 / rank)

    measure_each([Choice(2, False, "none"), Choice(4, True, "none", 17)], 36, run, _Notes())
    assert ran == [1, 2]


def test_the_median_leaves_the_warm_up_steps_out():
    events = [{"event": "start", "step": 0}] + [
        {"event": "step", "step": s, "tokens_per_s": r} for s, r in enumerate([10.0, 20.0, 300.0, 500.0, 400.0], 1)
    ]
    assert median_tokens_per_s(events, warmup=2) == 400.0
    assert median_tokens_per_s(events, warmup=5) is None


# -- the real thing: dzctl tune, then dzctl plan ---------------------------------------------------------------
def _dzctl(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DZCTL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _tunable_tiny_job(tmp_path: Path) -> Path:
    """The quick start's tiny CPU job with its global batch fixed (4 rows) and micro-batch and checkpointing left
    to the planner: its candidates are micro 4, 2 and 1 (the accumulation follows)."""
    spec = yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text())
    train = spec["train"]
    del train["gradient_accumulation_steps"]
    train.update(micro_batch_size="auto", gradient_checkpointing="auto", global_batch_size=4)
    spec["data"]["path"] = str(ROOT / "jobs" / "data" / "tiny-alpaca-zh.jsonl")
    path = tmp_path / "tiny-tune.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.slow
def test_tune_measures_two_candidates_and_the_next_plan_uses_the_fastest(tmp_path):
    from test_watch_run import _free_port

    home, remote = tmp_path / "home", tmp_path / "remote"
    job = _tunable_tiny_job(tmp_path)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=1\n")
    sets = [f"launch.remote_dir={remote}", f"launch.python={sys.executable}", f"launch.master_port={_free_port()}"]
    setargs = [x for s in sets for x in ("--set", s)]
    tuned = _dzctl(home, "tune", str(job), "--hosts", str(hosts), "--runtime", "process", *setargs,
                   "--top", "2", "--steps", "4", "--json")  # fmt: skip
    assert tuned.returncode == 0, (tuned.stdout + tuned.stderr)[-3000:]
    result = json.loads(tuned.stdout)
    candidates = result["candidates"]
    assert [(c["micro_batch_size"], c["model_rank"]) for c in candidates] == [(4, 1), (2, 2)]
    assert all(c["tokens_per_s"] > 0 and c["error"] is None for c in candidates), candidates
    assert all(c["predicted_tokens_per_s"] is None for c in candidates)  # a CPU job has no step-time model
    fastest = max(candidates, key=lambda c: c["tokens_per_s"])
    assert result["fastest"] == fastest and result["kind"] == "cpu"
    # the calibration file: the key, every candidate, when and by which dzctl
    stored = json.loads((home / "calibration.json").read_text())["calibrations"]
    assert list(stored) == [result["key"]] and result["key"].startswith("cpu|shape ")
    record = stored[result["key"]]
    assert record["candidates"] == candidates and record["fastest"] == fastest
    assert record["dzctl_version"] and record["measured_at"] and record["steps"] == 4 and record["warmup"] == 2
    # no run saved anything, and each ran in its own folder under the node's tune/ (the job's output/ untouched)
    assert not (remote / "output").exists()
    runs = sorted(p.name for p in next((remote / "tune").iterdir()).iterdir() if p.name != "data-cache")
    # the model's choice runs once more, last, where the other candidate beat its first run (_first_again_if_beaten;
    # the record keeps the faster of its two runs)
    assert runs in (["c1-model", "c2-micro2-ckpt0"], ["c1-micro4-ckpt0-again", "c1-model", "c2-micro2-ckpt0"]), runs
    if "c1-micro4-ckpt0-again" not in runs:
        assert candidates[0]["tokens_per_s"] >= candidates[1]["tokens_per_s"]
    assert not list((remote / "tune").rglob("checkpoint-*"))
    for run in runs:
        steps = [json.loads(x) for x in (next((remote / "tune").iterdir()) / run / "progress.jsonl").open()]
        assert [e["step"] for e in steps if e["event"] == "step"] == [1, 2, 3, 4]

    # the next plan for this key takes the fastest, and says where it came from
    planned = _dzctl(home, "plan", str(job), "--hosts", str(hosts), "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["choice_source"] == "calibration"
    assert plan["micro_batch_size"] == fastest["micro_batch_size"]
    assert plan["gradient_accumulation_steps"] == 4 // fastest["micro_batch_size"]
    assert plan["calibration"]["key"] == result["key"]
    text = _dzctl(home, "plan", str(job), "--hosts", str(hosts)).stdout
    assert f"on cpu: {fastest['tokens_per_s']:,.0f} tokens/s; the model ranked it " in text
    # another seq_len is another key: the model decides
    other = _dzctl(home, "plan", str(job), "--hosts", str(hosts), "--set", "train.max_seq_len=64", "--json")
    assert other.returncode == 0, other.stderr
    other_plan = json.loads(other.stdout)
    assert other_plan["choice_source"] == "model" and other_plan["calibration"] is None
    assert other_plan["micro_batch_size"] == 4


def test_a_job_that_fixes_micro_batch_and_checkpointing_has_nothing_to_tune(tmp_path):
    """The quick start's job sets both: tune says so and exits 0, before any node is touched."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=1\n")
    done = _dzctl(tmp_path / "home", "tune", str(ROOT / "jobs" / "tiny-cpu.yaml"), "--hosts", str(hosts), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "fixes train.micro_batch_size (4) and train.gradient_checkpointing (false): nothing to tune" in done.stdout
    assert not (tmp_path / "home" / "calibration.json").exists()
