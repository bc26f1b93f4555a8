"""The planner's GPU peak for a preference stage against the measured one, on every committed GPU launch (issue 44).

    python3 benchmarks/preference_peak_check.py

Each launch (``benchmarks/useful_tokens_h200.py`` through ``dzctl launch --runtime process``, one GPU, DPO
sigmoid on ``jobs/data/dpo-pairs.jsonl`` at seq 2048, global batch 32) is planned again by today's planner on
its own plan (its micro-batch, recomputed layers and offload, read from its ``runs.log``), and the peak is set
beside the ``torch.cuda.max_memory_allocated`` it logged. No launch was fitted: the plan's terms are
counted from the modules (``planning/memory/estimate.py``); one layer's saved activations on this path were
measured apart, on 1 and 3 layers outside any launch (``preference_activation_probe.py``), and are printed
first.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

RESULTS = REPO / "benchmarks" / "results"
LAUNCHES = (  # (card, folder)
    ("H100", "plans-h100x1-20261207/dpo-lora-1"),
    ("H200", "plans-h200x1-20261207/dpo-full-1"),
    ("H200", "plans-h200x1-20261207b/dpo-lora-2"),
    ("H100", "plans-h100x1-20261207b/dpo-full-2"),
    ("H100", "plans-h100x1-20261207d/trace-dpo-full"),
)
# What was live at a launch's peak, by the code that allocated it (benchmarks/cuda_memory_peak.py).
TRACES = (
    "plans-h100x1-20261207b/trace-dpo-full/peak-live-rank0-693.json",
    # the same launch again, each backward marked: the highest moments inside the backward and outside it
    "plans-h100x1-20261207d/trace-dpo-full/peak-live-rank0-712.json",
)
PROBES = ("plans-h200x1-20261207b/preference-activations.json",)
MICRO = re.compile(r"dzctl-train: 1 ranks, micro-batch (\d+), accumulation \d+")
CHECKPOINTED = re.compile(r"activation checkpointing in (\d+) of (\d+) decoder layers")
GIB = 2**30


def launch_plan(folder: Path) -> tuple[dict, list[str]]:
    """The launch's result and the overrides that fix its own plan."""
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    result = summary["results"][0]
    log = (folder / "runs.log").read_text(encoding="utf-8")
    micro = int(MICRO.search(log).group(1))
    checkpointed = int(CHECKPOINTED.search(log).group(1))
    zero = result["plan"]["zero"]
    offload = "all" if zero["offload_param"] else "optimizer" if zero["offload_optimizer"] else "none"
    # The rows the launch read are this checkout's (the device's checkout path is not this one's).
    sets = [s for s in result["overrides"] if not s.startswith("data.path=")]
    sets += [f"data.path={REPO / 'jobs' / 'data' / 'dpo-pairs.jsonl'}", f"train.micro_batch_size={micro}"]
    sets += [f"train.gradient_checkpointing={checkpointed or 'false'}", f"zero.offload={offload}"]
    return {**result, "layers": summary["layers"], "micro": micro, "checkpointed": checkpointed}, sets


def planned(layers: int, sets: list[str]):
    import useful_tokens_h200 as launcher
    import yaml

    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.memory.fromjob import plan_for_job
    from orchestrator.spec.job import load_job

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args = argparse.Namespace(model="qwen3-8b", seq=2048, layers=layers, set=sets, env=[], port=29541, steps=7)
        spec = launcher.job_spec("auto", args, "gpu", "unused.jsonl", work)
        (work / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
        # The launch's plan is fixed by the overrides: room enough that nothing is chosen otherwise.
        plan, _ = plan_for_job(read_inputs(load_job(work / "job.yaml")), [1], gpu_mem_gib=1000.0, host_mem_gib=125.0)
    return plan


def probe_lines() -> list[str]:
    lines = ["## one layer's saved activations per token (preference_activation_probe.py)"]
    for name in PROBES:
        record = json.loads((RESULTS / name).read_text(encoding="utf-8"))
        for row in record["rows"]:
            what = "LoRA r16" if row["lora"] else "full FT"
            mask = "" if row.get("mask", True) else " (no attention mask: not the trainer's path)"
            lines.append(
                f"{record['device']}: {what}{mask}: measured {row['layer_bytes_per_token']:,} B, "
                f"planned {row['planned_layer_bytes_per_token']:,} B"
            )
    return lines


def main() -> int:
    print("\n".join(probe_lines()))
    print("\n## the planned peak against the measured one (no launch fitted)")
    # TRL pads each micro-batch's pairs to its longest sequence, and the plan counts max_seq_len: the peak of a
    # step rises while its micro-batches are shorter than that. The steps' own peaks show when it stopped rising.
    print("| card | launch | plan | planned GiB | measured GiB | planned / measured | peak after each step, GiB |")
    print("|---|---|---|---|---|---|---|")
    for card, name in LAUNCHES:
        result, sets = launch_plan(RESULTS / name)
        plan = planned(result["layers"], sets)
        peak = plan.estimate.gpu_peak / GIB
        measured = max(result["peak_allocated_gib"])
        words = f"{result['layers']} layers, micro {result['micro']} pairs, {result['checkpointed']} recomputed"
        steps = ", ".join(f"{s['gpu_mem_peak_gib']:.2f}" for s in result["steps"] if "gpu_mem_peak_gib" in s)
        print(f"| {card} | {name} | {words} | {peak:.2f} | {measured:.2f} | {peak / measured - 1:+.1%} | {steps} |")
    for name in TRACES:
        import cuda_memory_peak

        summary = json.loads((RESULTS / name).read_text(encoding="utf-8"))
        print(f"\n## what was live at the peak: {name}")
        print("\n".join(line for line in cuda_memory_peak.lines(summary) if not line.startswith("| 0.000 |")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
