"""One rank of the shaped-link step-time benchmark (benchmarks/steptime_shaped.py starts it under torchrun).

Real DeepSpeed ZeRO-3 on CPU (gloo), with the ds_config dzctl generates (planning/dsconfig.py) for
the tiny CPU job's spec, a small Qwen3-shaped model (random init, fixed seed) and random tokens
(the same on every run: seeded by step and rank). First it times the collectives ZeRO-3 runs
(all-gather and reduce-scatter through deepspeed.comm, at a tiny size and at the bucket size, over
all ranks and within each node), then trains and times each step. Rank 0 writes one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = {
    "model_type": "qwen3",
    "vocab_size": 4000,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": False,
}
SEQ = 64
MICRO = 1
# Configurations: the generated config as it is; the same with stage3_max_reuse_distance 0 (every
# weight released after each use, so the backward gathers again, as in models larger than the
# distance); and hpZ (zero_hpz_partition_size = ranks per node) on top of that.
CONFIGS = {
    "plain": {"hpz": 1, "reuse": None},
    "plain-release": {"hpz": 1, "reuse": 0},
    "hpz-release": {"hpz": 2, "reuse": 0},
}


def ds_config(config: str, world: int, ranks_per_node: int) -> dict:
    from orchestrator.planning.dsconfig import Resolved, bucket_sizes, build_ds_config, merge
    from orchestrator.spec.job import load_job

    spec = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["train.gradient_accumulation_steps=1"]).spec
    reduce, prefetch, persistence = bucket_sizes(MODEL["hidden_size"])
    chosen = CONFIGS[config]
    resolved = Resolved(
        micro_batch_size=MICRO,
        gradient_checkpointing=False,
        offload_optimizer=False,
        offload_param=False,
        reduce_bucket_size=reduce,
        prefetch_bucket_size=prefetch,
        param_persistence_threshold=persistence,
        precision="fp32",
        hpz_partition_size=ranks_per_node if chosen["hpz"] > 1 else 1,
    )
    ds = build_ds_config(spec, resolved, world)
    if chosen["reuse"] is not None:
        ds = merge(ds, {"zero_optimization": {"stage3_max_reuse_distance": chosen["reuse"]}})
    return ds


def timed(fn, iters: int) -> float:
    """Median seconds of one call, each call started together on every rank (the machine is shared: spikes)."""
    import statistics

    import deepspeed.comm as dist

    fn()  # warm-up
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# The probe's sizes: a tiny one for the per-call latency, and one large enough that its transfer
# stands well above that latency even on the unshaped link (16 buckets of hidden² elements).
PROBE_SMALL = 256
PROBE_BUCKETS = 16


def probe(world: int, ranks_per_node: int, bucket: int) -> dict:
    """Median seconds per all-gather and reduce-scatter (fp32) at PROBE_SMALL and at PROBE_BUCKETS buckets."""
    import deepspeed.comm as dist
    import torch

    rank = dist.get_rank()
    nodes = world // ranks_per_node
    node_groups = [dist.new_group(list(range(n * ranks_per_node, (n + 1) * ranks_per_node))) for n in range(nodes)]
    mine = node_groups[rank // ranks_per_node]
    out = {"small": PROBE_SMALL, "large": PROBE_BUCKETS * bucket}
    for scope, group, size in (("global", None, world), ("node", mine, ranks_per_node)):
        for label, elements in (("small", PROBE_SMALL), ("large", PROBE_BUCKETS * bucket)):
            part = -(-elements // size)
            shard = torch.ones(part)
            full = torch.empty(part * size)

            def gather(shard=shard, full=full, group=group):
                dist.allgather_fn(full, shard, group=group)

            def reduce(shard=shard, full=full, group=group):
                dist.reduce_scatter_fn(shard, full, group=group)

            iters = 7 if label == "large" else 15
            out[f"{scope}_all_gather_{label}"] = timed(gather, iters)
            out[f"{scope}_reduce_scatter_{label}"] = timed(reduce, iters)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    ds = ds_config(args.config, world, ranks_per_node)
    figures = probe(world, ranks_per_node, ds["zero_optimization"]["reduce_bucket_size"]) if args.probe else None
    torch.manual_seed(0)
    config = AutoConfig.for_model(**MODEL)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    steps = []
    for step in range(1, args.steps + 1):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=generator)
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        steps.append({"step": step, "time_s": round(elapsed, 4), "loss": float(mean) / world})
    if rank == 0:
        record = {
            "config": args.config,
            "world": world,
            "ranks_per_node": ranks_per_node,
            "model": MODEL,
            "params": sum(p.ds_numel for p in model.parameters()),
            "tokens_per_rank": MICRO * SEQ,
            "zero_optimization": ds["zero_optimization"],
            "probe_s": figures,
            "steps": steps,
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
