"""GPU clusters, planned: ``dzctl plan`` for Qwen3-8B and Qwen2.5-72B full fine-tuning on 8-GPU H100 nodes.

Pure planning (no GPU, no host touched): for 2, 4 and 16 nodes of 8 × H100-80GB (2 TiB RAM each,
a DGX H100's) at 25, 100 and 400 GB/s per node (200, 800, 3200 Gbit/s of NICs), two batch settings:

* ``auto``: the planner's own micro-batch (the largest that fits), accumulation 1;
* ``2M``: a global batch of about 2 M tokens (the issue's example): micro-batch 2M / (4096 · GPUs),
  accumulation 1, so the tokens per GPU per micro-step shrink as nodes are added.

Writes a Markdown table and the plans' JSON (``step_time``, ``ds_config``'s ZeRO section, memory).

    python3 benchmarks/plan_clusters.py --out benchmarks/results/plan-clusters-YYYYMMDD
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"Qwen3-8B": "Qwen/Qwen3-8B", "Qwen2.5-72B": "Qwen/Qwen2.5-72B"}
NODES = (2, 4, 16)
LINKS_GBYTE_S = (25, 100, 400)
GPUS_PER_NODE = 8
SEQ = 4096
GLOBAL_TOKENS = 2 * 1024 * 1024


def plan(model: str, nodes: int, gbyte_s: int, batch: str, hosts_dir: Path) -> dict:
    hosts = hosts_dir / f"{nodes}x{GPUS_PER_NODE}.txt"
    hosts.write_text("".join(f"node{i} slots={GPUS_PER_NODE}\n" for i in range(nodes)), encoding="utf-8")
    sets = [f"model.name_or_path={MODELS[model]}", "train.gradient_accumulation_steps=1", f"train.max_seq_len={SEQ}"]
    if batch == "2M":
        sets.append(f"train.micro_batch_size={max(1, GLOBAL_TOKENS // (SEQ * nodes * GPUS_PER_NODE))}")
    argv = [sys.executable, "-m", "orchestrator", "plan", "jobs/qwen3-8b.yaml", "--hosts", str(hosts), "--json"]
    argv += ["--gpu-mem-gib", "80", "--host-mem-gib", "2048", "--gpu-kind", "H100", "--link-gbps", str(gbyte_s * 8)]
    for item in sets:
        argv += ["--set", item]
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = json.loads(run.stdout)
    out["exit_code"] = run.returncode
    out["argv"] = ["dzctl", *argv[3:4], "jobs/qwen3-8b.yaml", "--hosts", hosts.name, *argv[7:]]
    return out


def row(model: str, nodes: int, gbyte_s: int, batch: str, out: dict) -> str:
    step = out.get("step_time") or {}
    zero = (out.get("ds_config") or {}).get("zero_optimization", {})
    settings = f"hpZ {zero['zero_hpz_partition_size']}" if zero.get("zero_hpz_partition_size") else "plain"
    if zero:
        settings += (
            f", buckets {zero['reduce_bucket_size'] / 1e6:.0f}M/{zero['stage3_prefetch_bucket_size'] / 1e6:.0f}M"
        )
    if not out["fits"]:
        return f"| {model} | {nodes} | {gbyte_s} | {batch} | does not fit: {out['reason']} | | | | | |"
    plain = step.get("plain_zero3_micro_step_s")
    # Offload's PCIe traffic and CPU optimizer step are outside the model: its figures are an upper bound.
    mark = "" if step.get("offload_modelled", True) else " †"

    return (
        f"| {model} | {nodes} | {gbyte_s} | {batch} | {out['micro_batch_size']} ({out['offload']}) | "
        f"{step.get('tokens_per_s_per_gpu', 0):,.0f}{mark} | {step.get('bound')} ({step.get('loss_vs_compute', 0):.0%} "
        f"below compute) | {settings} | {plain if plain is not None else '-'} / {step.get('micro_step_s')} | "
        f"{out['per_gpu_required_gib']} GiB GPU, {out['host_per_node_gib']} GiB host |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plans, lines = [], []
    header = (
        "| model | nodes × 8 H100 | GB/s per node | batch | micro-batch (offload) | tokens/s/GPU | bound | "
        "ZeRO settings chosen | micro-step s plain / chosen | memory needed |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            for nodes in NODES:
                for gbyte_s in LINKS_GBYTE_S:
                    for batch in ("auto", "2M"):
                        out = plan(model, nodes, gbyte_s, batch, Path(tmp))
                        plans.append({"model": model, "nodes": nodes, "gbyte_s": gbyte_s, "batch": batch, **out})
                        lines.append(row(model, nodes, gbyte_s, batch, out))
                        print(lines[-1], flush=True)
    (args.out / "plans.json").write_text(json.dumps(plans, indent=1) + "\n", encoding="utf-8")
    (args.out / "table.md").write_text(header + "\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
