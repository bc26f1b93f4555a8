"""Recompute a recorded preference run's numbers with TRL's own DPOTrainer, in one plain process (no DeepSpeed).

``python tests/preferencecheck.py loss RECORD JOB PROGRESS`` prints, as JSON, for each recorded step
from 2 on: the loss dzctl logged, and TRL's ``DPOTrainer.compute_loss`` on that step's micro-batches
(one per rank, averaged as the Trainer logs them) with the policy's gathered weights at that step and
the recorded reference copy's.

``python tests/preferencecheck.py lora-ref RECORD JOB STEP`` prints the reference log-probs the LoRA
run computed (its adapters switched off) at STEP, and TRL's ``compute_ref_log_probs`` of an explicit
frozen copy of the base (the base weights gathered before step 1) on the same batches.

Its own process: TRL's trainer sets accelerate's process-wide state, which a test process must not keep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _trainer(record: Path, job: Path, policy, reference):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from orchestrator.spec.job import load_job
    from orchestrator.train.data.tokenizer import load_tokenizer

    spec = load_job(job).spec

    class Checker(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already token ids: TRL's loss is what is checked, not its tokenization

    args = DPOConfig(
        output_dir=str(record / "checker"),
        beta=spec.train.pref_beta,
        loss_type=["sigmoid"],
        report_to="none",
        use_cpu=True,
        max_length=spec.train.max_seq_len,
    )
    rows = Dataset.from_list([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}])
    tokenizer = load_tokenizer(spec.model.tokenizer, spec.model.name_or_path)
    return Checker(model=policy, ref_model=reference, args=args, train_dataset=rows, processing_class=tokenizer)


def _model(job: Path, weights: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrator.spec.job import load_job

    config = dict(load_job(job).spec.model.config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    model.load_state_dict(weights, strict=True)
    return model.to(torch.float32).eval()


def _batches(record: Path, step: int) -> list[dict]:
    return [torch.load(path) for path in sorted(record.glob(f"batch-{step}-rank*.pt"))]


def check_loss(record: Path, job: Path, progress: Path) -> dict:
    logged = {}
    for line in progress.read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event["event"] == "step":
            logged[event["step"]] = event["loss"]
    reference = _model(job, torch.load(record / "reference.pt"))
    policy = _model(job, torch.load(record / "policy-1.pt"))
    trainer = _trainer(record, job, policy, reference)
    out = {}
    for path in sorted(record.glob("policy-*.pt"), key=lambda p: int(p.stem.split("-")[1])):
        step = int(path.stem.split("-")[1])
        if step < 2:
            continue
        trainer.model.load_state_dict(torch.load(path))
        with torch.no_grad():
            losses = [float(trainer.compute_loss(trainer.model, batch)) for batch in _batches(record, step)]
        out[step] = {"logged": logged[step], "trl": sum(losses) / len(losses)}
    return out


def check_lora_reference(record: Path, job: Path, step: int) -> dict:
    first = torch.load(record / "policy-1.pt")
    base = {}
    for name, value in first.items():
        if "lora_" in name:
            continue
        base[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = value
    frozen = _model(job, base)
    trainer = _trainer(record, job, _model(job, base), frozen)
    out = {"dzctl": [], "frozen_copy": []}
    for rank, batch in enumerate(_batches(record, step)):
        chosen, rejected = torch.load(record / f"ref-logps-{step}-rank{rank}.pt")
        with torch.no_grad():
            ref_chosen, ref_rejected = trainer.compute_ref_log_probs(frozen, batch)
        out["dzctl"] += chosen.tolist() + rejected.tolist()
        out["frozen_copy"] += ref_chosen.tolist() + ref_rejected.tolist()
    return out


if __name__ == "__main__":
    mode, record, job = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode == "loss":
        result = check_loss(record, job, Path(sys.argv[4]))
    else:
        result = check_lora_reference(record, job, int(sys.argv[4]))
    print("RESULT " + json.dumps(result), flush=True)
