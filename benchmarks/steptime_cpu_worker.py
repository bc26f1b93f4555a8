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
from typing import ClassVar

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


class CollectiveCounter:
    """Counts the collectives ZeRO-3 issues per phase (forward, backward, step): calls and bytes of each.

    DeepSpeed's gathers and reduce-scatters reach torch.distributed's functions at call time
    (deepspeed/comm/torch.py), so wrapping those attributes sees every one, whatever path
    (coalesced, sequential, hpZ's node group) DeepSpeed takes. This says what the model's
    collectives really were, beside the time: the bytes are the output tensor's (all-gather)
    or input's (reduce-scatter), as the model counts them.
    """

    # Which argument holds the whole (gathered, or to-be-reduced) tensor: (position, keyword).
    OPS: ClassVar[dict[str, tuple[int, str]]] = {
        "all_gather_into_tensor": (0, "output_tensor"),
        "reduce_scatter_tensor": (1, "input"),
        "all_reduce": (0, "tensor"),
    }

    def __init__(self) -> None:
        self.phase: str | None = None
        self.counts: dict[str, dict[str, dict[str, float]]] = {}

    def install(self) -> None:
        import torch.distributed as tdist

        for name, where in self.OPS.items():
            original = getattr(tdist, name, None)
            if original is not None:
                setattr(tdist, name, self._wrap(name, where, original))

    def _wrap(self, name, where, original):
        position, keyword = where

        def counted(*args, **kwargs):
            if self.phase is not None:
                tensor = args[position] if len(args) > position else kwargs.get(keyword)
                numbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
                entry = self.counts.setdefault(self.phase, {}).setdefault(name, {"calls": 0, "bytes": 0})
                entry["calls"] += 1
                entry["bytes"] += numbytes
            return original(*args, **kwargs)

        return counted

    def per_step(self, steps: int) -> dict:
        return {
            phase: {op: {k: v / steps for k, v in entry.items()} for op, entry in ops.items()}
            for phase, ops in self.counts.items()
        }


COUNTED_FROM_STEP = 3  # as the report's timed steps: the first ones trace the module order


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

    counter = CollectiveCounter()
    counter.install()  # before DeepSpeed's backend binds torch.distributed's functions (comm/torch.py)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    ds = ds_config(args.config, world, ranks_per_node)
    figures = probe(world, ranks_per_node, ds["zero_optimization"]["reduce_bucket_size"]) if args.probe else None
    torch.manual_seed(0)
    config = AutoConfig.for_model(**MODEL)
    # Built inside zero.Init, as the trainer builds it (train/run.py): weights partitioned as they
    # are made, and F.linear replaced by ZeRO-3's own, whose autograd keeps the parameter rather
    # than its gathered data. Built outside, autograd holds each layer's gathered weight until the
    # backward, and a released weight is never gathered again there (counted: 7.6 of 20.8 MB).
    from transformers.integrations import HfDeepSpeedConfig

    zero3 = HfDeepSpeedConfig(ds)  # noqa: F841 (kept alive: from_config reads it, as under the trainer's TrainingArguments)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    steps = []
    for step in range(1, args.steps + 1):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=generator)
        counted = step >= COUNTED_FROM_STEP
        start = time.perf_counter()
        counter.phase = "forward" if counted else None
        loss = engine(input_ids=ids, labels=ids).loss
        counter.phase = "backward" if counted else None
        engine.backward(loss)
        counter.phase = "step" if counted else None
        engine.step()
        counter.phase = None
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
            "collectives_per_step": counter.per_step(max(1, args.steps - COUNTED_FROM_STEP + 1)),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
