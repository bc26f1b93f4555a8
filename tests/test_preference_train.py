"""Preference training end to end (issue 44): real DeepSpeed ZeRO-3 on 2 CPU ranks (gloo), TRL's trainers.

jobs/tiny-cpu.yaml's model trains on rows written in LLaMA-Factory's dpo_en_demo and kto_en_demo
layouts (tests/fixtures/preference/), through ``train.stage``. The default set has one launch:
DPO (sigmoid) with full fine-tuning, 20 steps, its reference a frozen ZeRO-3 copy, through
``dzctl launch`` on the shared pair of process test hosts (one rank each, rendezvous across their
bridge: tests/conftest.py). A recorder (tests/preferencerank.py, installed on the ranks by a
``sitecustomize`` on their PYTHONPATH) keeps each step's gathered policy weights and micro-batches,
and TRL's own ``DPOTrainer.compute_loss`` recomputes steps 2 to 10 in a plain process
(tests/preferencecheck.py).
The extended set (tests/conftest.py EXTENDED): LoRA DPO's reference and the merged export of its
checkpoint, KTO with its checkpoint resumed, and a DPO run stopped and resumed, on the hosts too;
ORPO, SimPO and the precomputed reference on 2 local ranks (torchrun on this machine).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from preferencerank import site_hook
from test_e2e import Controller
from test_train import ROOT, TIMEOUT, _env, _free_port

from orchestrator.train.progress import read_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the test hosts (tests/conftest.py)

FIXTURES = ROOT / "tests" / "fixtures" / "preference"
TINY = ROOT / "jobs" / "tiny-cpu.yaml"


def _job(folder: Path, data: str, fmt: str, **train: str) -> Path:
    """The tiny job on a preference fixture, ``train`` keys added (``stage: dpo``, ...); no saves unless asked."""
    text = TINY.read_text(encoding="utf-8")
    text = text.replace(
        "  path: data/tiny-alpaca-zh.jsonl\n  format: alpaca\n", f"  path: {FIXTURES / data}\n  format: {fmt}\n"
    )
    text = text.replace("  max_steps: 30\n", "")  # given below (10 unless asked)
    extra = "".join(f"  {key}: {value}\n" for key, value in {"save": "false", "max_steps": "10", **train}.items())
    text = text.replace("train:\n", "train:\n" + extra, 1)
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    job.write_text(text, encoding="utf-8")
    return job


def _train(job: Path, output: Path, *sets: str, record: Path | None = None, steps: int = 10, ds: Path | None = None):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    argv += [str(ROOT / "tests" / "preferencerank.py")] if record else ["-m", "orchestrator.train"]
    argv += [str(job), "--output-dir", str(output)] + (["--ds-config", str(ds)] if ds else [])
    for item in sets:
        argv += ["--set", item]
    env = _env()
    if record:
        env.update(DZCTL_TEST_RECORD=str(record), DZCTL_TEST_STEPS=str(steps))
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result, read_events(output / "progress.jsonl")


class Hosts(Controller):
    """``dzctl launch`` of one preference job on the shared pair of process hosts, one rank on each."""

    def __init__(self, hosts, folder: Path, job: Path, record: Path | None = None, steps: int = 10) -> None:
        super().__init__(hosts, folder, "process")
        self.job_file = job
        self.record = record
        self.sets = [s for s in self.sets if not s.startswith("train.save_steps=")]
        if record:
            hook = site_hook(folder / "site")
            self.sets += [f"launch.env.PYTHONPATH={hook}", f"launch.env.DZCTL_TEST_RECORD={record}"]
            self.sets.append(f"launch.env.DZCTL_TEST_STEPS={steps}")

    def run(self, *sets: str) -> tuple[str, list[dict]]:
        """Launch to the end (--follow); the nodes' output (each line prefixed by rank and host) and rank 0's events."""
        argv = [item for s in (*self.sets, *sets) for item in ("--set", s)]
        result = self.dzctl("launch", str(self.job_file), "--hosts", str(self.hostfile),
                            "--ssh-config", str(self.cluster.ssh_config), "--follow", "--raw", "--skip-collective",
                            *argv, timeout=TIMEOUT)  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        return result.stdout + result.stderr, read_events(self.output_dir(0) / "progress.jsonl")


def _the_last_checkpoint_exports_as_the_end_model(launch: Hosts, out: Path, step: int) -> None:
    """``dzctl export`` of the last checkpoint gathers every node's shards into the run's own end model (``model/``)."""
    from safetensors.torch import load_file

    result = launch.dzctl("export", launch.job, "--checkpoint", "latest", "--out", str(out), "--json",
                          "--ssh-config", str(launch.cluster.ssh_config))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout)["step"] == step
    exported = load_file(out / "model.safetensors")
    end_model = load_file(launch.output_dir(0) / "model" / "model.safetensors")
    assert exported.keys() == end_model.keys()
    for name, weight in exported.items():
        assert weight.equal(end_model[name]), name


def _steps(events) -> list[dict]:
    return [e for e in events if e["event"] == "step"]


@pytest.fixture(scope="module")
def dpo_run(shared_process_hosts, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo")
    job = _job(folder, "dpo_en_demo.json", "sharegpt", stage="dpo", max_steps="20")
    launch = Hosts(shared_process_hosts, folder, job, record=folder / "record", steps=10)
    try:
        output, events = launch.run()
    finally:
        shared_process_hosts.reset()
    return folder, job, output, events, launch.output_dir(0)


def test_dpo_trains_llama_factorys_dpo_layout_with_a_frozen_zero3_reference(dpo_run):
    folder, _, output, events, _ = dpo_run
    assert re.search(r"data \(dpo\): 24 pairs \(chosen, rejected\)( \([\d,]+ tokens\))? from 24 rows", output)
    assert "reference: a frozen ZeRO-3-partitioned copy of the model" in output
    assert json.loads((folder / "record" / "setup.json").read_text()) == {"ref_model": True, "adapters": None}
    steps = _steps(events)
    assert len(steps) == 20
    # Policy and reference start equal: the first step's loss is log 2 whatever the code.
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin"):
        assert all(isinstance(step[key], float) for step in steps), key


def test_dpo_loss_is_trls_on_each_steps_batch_and_weights(dpo_run):
    folder, job, _, _, node0 = dpo_run
    argv = [sys.executable, str(ROOT / "tests" / "preferencecheck.py"), "loss", str(folder / "record"), str(job)]
    argv.append(str(node0 / "progress.jsonl"))
    check = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert check.returncode == 0, check.stderr[-4000:]
    result = json.loads(check.stdout.split("RESULT ", 1)[1])
    assert sorted(int(step) for step in result) == list(range(2, 11))
    for step, pair in result.items():
        assert pair["logged"] == pytest.approx(pair["trl"], abs=1e-4), step
    assert result["10"]["logged"] < result["2"]["logged"]  # it learns: not the same number each step


def test_reward_accuracy_rises_on_a_separable_set(dpo_run):
    steps = _steps(dpo_run[3])
    assert steps[0]["reward_accuracy"] == 0.0  # rewards start at zero for both answers
    late = [step["reward_accuracy"] for step in steps[-5:]]
    assert sum(late) / len(late) >= 0.9
    assert steps[-1]["reward_margin"] > steps[1]["reward_margin"] > 0


# --- extended set ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_dpo_run(shared_process_hosts, tmp_path_factory):
    """LoRA DPO, 10 steps on the hosts, recorded, its checkpoint at step 10 kept on each node (node-local)."""
    folder = tmp_path_factory.mktemp("lora-dpo")
    job = _job(folder, "dpo_en_demo.json", "sharegpt", stage="dpo", method="lora", lora="{r: 4, alpha: 8}")
    launch = Hosts(shared_process_hosts, folder, job, record=folder / "record", steps=10)
    try:
        output, events = launch.run("train.save=true", "train.save_steps=10")
    finally:
        shared_process_hosts.reset()
    return launch, output, events


def test_lora_dpo_plans_no_reference_copy_and_its_reference_is_the_base(lora_dpo_run):
    launch, output, events = lora_dpo_run
    record = launch.record
    assert "reference: the base with the LoRA adapters switched off (no copy)" in output
    # No reference model and no "ref" adapter (TRL's copy of the adapter): the base, adapters off.
    assert json.loads((record / "setup.json").read_text()) == {"ref_model": False, "adapters": ["default"]}
    import torch

    for rank in (0, 1):
        dzctl = torch.load(record / f"ref-logps-10-rank{rank}.pt")
        frozen = torch.load(record / f"copy-logps-10-rank{rank}.pt")
        for ours, copy in zip(dzctl, frozen, strict=True):
            assert torch.allclose(ours, copy, atol=1e-5, rtol=0), (ours, copy)
    assert _steps(events)[-1]["loss"] < math.log(2)


def test_a_lora_dpo_checkpoint_exports_merged_as_base_plus_the_adapters_delta(lora_dpo_run, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    launch = lora_dpo_run[0]
    node0 = launch.output_dir(0)
    merged = tmp_path / "merged"
    result = launch.dzctl("export", launch.job, "--checkpoint", "10", "--out", str(merged), "--json",
                          "--ssh-config", str(launch.cluster.ssh_config))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    answer = json.loads(result.stdout)
    assert answer["method"] == "lora" and answer["adapter"] is False and answer["verified"] is True
    # The trainer's own adapter at step 10 (PEFT's save of the live parameters into the checkpoint): the policy
    # alone, no "ref" adapter beside it.
    own = load_file(node0 / "checkpoint-10" / "adapter_model.safetensors")
    assert own and all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in own), sorted(own)
    assert not (node0 / "checkpoint-10" / "ref").exists()  # PEFT saves a second adapter in a folder of its name
    config = json.loads((node0 / "checkpoint-10" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    base = load_file(node0 / "base" / "model.safetensors")
    out = load_file(merged / "model.safetensors")
    assert out.keys() == base.keys()  # the base's names: nothing of the adapters left unmerged
    moved = 0
    for name, weight in base.items():
        down = name.removesuffix(".weight")
        a, b = own.get(f"base_model.model.{down}.lora_A.weight"), own.get(f"base_model.model.{down}.lora_B.weight")
        expected = weight if a is None else weight + scale * (b @ a)
        assert torch.allclose(out[name], expected, rtol=0, atol=1e-6), name
        moved += a is not None and not torch.equal(out[name], weight)
    assert moved > 0, "no merged weight differs from the base: the adapters trained nothing"
    # It loads as a plain transformers model and computes what the base with the trainer's adapter computes.
    batch = torch.tensor([[5, 17, 42, 99, 230, 7, 64, 128, 300, 11, 3, 250]])
    trainers = tmp_path / "trainers-adapter"
    trainers.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (trainers / name).write_bytes((node0 / "checkpoint-10" / name).read_bytes())
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()(batch).logits
        on_base = AutoModelForCausalLM.from_pretrained(str(node0 / "base"), dtype=torch.float32)
        adapted = PeftModel.from_pretrained(on_base, str(trainers)).eval()(input_ids=batch).logits
    assert torch.allclose(exported, adapted, rtol=0, atol=1e-5), (exported - adapted).abs().max()


def test_kto_trains_llama_factorys_kto_layout_and_resumes_from_its_checkpoint(shared_process_hosts, tmp_path):
    # 5 steps with a checkpoint, then a relaunch resumes it to 10: a KTO checkpoint is one resume accepts ...
    job = _job(tmp_path, "kto_en_demo.json", "messages", stage="kto")
    launch = Hosts(shared_process_hosts, tmp_path, job)
    try:
        output, first = launch.run("train.max_steps=5", "train.save=true", "train.save_steps=5")
        assert "48 answers (KTO) from 48 rows" in output and "24 desirable, 24 undesirable" in output
        resumed_output, events = launch.run("train.save=true", "train.save_steps=5", "train.resume=auto")
        _the_last_checkpoint_exports_as_the_end_model(launch, tmp_path / "exported", 10)  # ... and export accepts
    finally:
        shared_process_hosts.reset()
    assert f"resume from {launch.output_dir(0) / 'checkpoint-5'}" in resumed_output
    start = next(e for e in events[len(first) :] if e["event"] == "start")
    assert start["step"] == 5
    steps = _steps(events)
    assert [step["step"] for step in steps] == list(range(1, 11))
    assert all(isinstance(step["kl"], float) for step in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["reward_margin"] > 0


@pytest.mark.parametrize(("loss", "extra"), [("orpo", "log_odds_ratio"), ("simpo", "reward_margin")])
def test_orpo_and_simpo_run_ten_steps_with_their_metrics(tmp_path, loss, extra):
    job = _job(tmp_path, "dpo_en_demo.json", "sharegpt", stage="dpo", pref_loss=loss)
    result, events = _train(job, tmp_path / "out")
    assert "reference: none (the loss has no reference policy)" in result.stdout
    steps = _steps(events)
    assert len(steps) == 10
    for key in ("rewards_chosen", "rewards_rejected", "reward_accuracy", extra):
        assert all(isinstance(step[key], float) for step in steps), key
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_a_dpo_run_stopped_and_resumed_gives_the_same_losses(dpo_run, shared_process_hosts, tmp_path):
    # The uninterrupted run is the default set's (20 steps, constant learning rate); this one stops at 5
    # with its checkpoint on each node, and a relaunch resumes to 10 (the frozen reference is built again,
    # as at the start); the last checkpoint exports as the run's end model (the policy alone, not the copy).
    _, job, _, uninterrupted, _ = dpo_run
    launch = Hosts(shared_process_hosts, tmp_path, job)
    try:
        launch.run("train.max_steps=5", "train.save=true", "train.save_steps=5")
        output, events = launch.run("train.max_steps=10", "train.save=true", "train.save_steps=5", "train.resume=auto")
        _the_last_checkpoint_exports_as_the_end_model(launch, tmp_path / "exported", 10)
    finally:
        shared_process_hosts.reset()
    assert f"resume from {launch.output_dir(0) / 'checkpoint-5'}" in output
    resumed = [step for step in _steps(events) if step["step"] > 5]
    assert [step["step"] for step in resumed] == list(range(6, 11))
    straight = {step["step"]: step["loss"] for step in _steps(uninterrupted)}
    for step in resumed:
        assert step["loss"] == pytest.approx(straight[step["step"]], abs=1e-6), step["step"]


def test_precomputed_reference_log_probs_give_the_frozen_copys_losses(dpo_run, tmp_path):
    # The plan's choice reaches the ranks in the DeepSpeed config it generates: here "precomputed", as the
    # planner writes it where the copy does not fit beside the plan (test_preference_plan.py).
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.memory.fromjob import plan_for_job
    from orchestrator.planning.memory.preference import REFERENCE_KEY
    from orchestrator.spec.job import load_job

    _, job, _, frozen, _ = dpo_run
    _, ds = plan_for_job(read_inputs(load_job(job)), [2], gpu_mem_gib=None, host_mem_gib=None)
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({**ds, REFERENCE_KEY: "precomputed"}), encoding="utf-8")
    result, events = _train(job, tmp_path / "out", ds=config)
    assert "reference: log-probs computed once before training (TRL's precompute_ref_log_probs)" in result.stdout
    with_copy = {step["step"]: step["loss"] for step in _steps(frozen)}
    for step in _steps(events):
        assert step["loss"] == pytest.approx(with_copy[step["step"]], abs=1e-6), step["step"]
