"""Issue 42's ceiling: the same model trained by plain PyTorch on one GPU, no DeepSpeed, no dzctl.

What "full fine-tuning without offload reaches at least 92 % of plain PyTorch's tokens/s on the same card
and model" is measured against. The model is the one the launches train: the Qwen3-8B layer shapes
(``--layers`` of them), random init, bf16, SDPA attention, Liger's kernels and fused loss as the trainer
applies them (``train/model/loss.py``). What plain PyTorch does without ZeRO-3: the weights, their
gradients and torch's fused AdamW states all bf16 on the GPU (no fp32 master: the fastest a single GPU can
step, and less memory than the launch's fp32 master and moments), no gathers, hooks or partitions. The
rows are full rows of random ids at ``--seq``, as ``data.path: synthetic:random`` gives a launch. For each
(micro, checkpointed layers) the global batch is ``--global-batch`` rows: ``global / micro`` micro-steps,
then one optimizer step; one warm-up step, then the median of ``--steps``.

    python3 benchmarks/plain_pytorch_ceiling.py --layers 18 --micro 2,4 --checkpointed 0 --out DIR   # GPU
    python3 benchmarks/plain_pytorch_ceiling.py --model tiny --seq 64 --micro 2 --loss none --steps 1  # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def build(args):
    import torch
    import transformers
    from zero3_h200 import MODELS

    from orchestrator.train.model import loss

    cfg = dict(MODELS[args.model])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if args.loss != "none":
        loss.apply_fused_loss(model, args.loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    fused = args.device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    return model, optimizer, cfg


def time_point(model, optimizer, cfg, micro: int, checkpointed: int, args) -> dict:
    import torch

    from orchestrator.train.model import checkpointing

    checkpointing.checkpoint_first(model, checkpointed)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, cfg["vocab_size"], (micro, args.seq), device=args.device)
    accumulation = args.global_batch // micro
    times = []
    for step in range(1 + args.steps):
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(accumulation):
            out = model(input_ids=ids, labels=ids)
            (out.loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the launch clips at 1.0 too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - began)
    median = statistics.median(times)
    tokens = args.global_batch * args.seq
    return {
        "micro": micro,
        "accumulation": accumulation,
        "checkpointed": checkpointed,
        "step_s": [round(t, 4) for t in times],
        "median_step_s": round(median, 4),
        "tokens_per_s": round(tokens / median, 1),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro", default="2,4")
    parser.add_argument("--checkpointed", default="0", help="layers recomputed: numbers or 'all'")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss", default="liger", choices=("liger", "chunked", "none"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    began = time.monotonic()
    model, optimizer, cfg = build(args)
    layers = cfg["num_hidden_layers"]
    points: list[dict] = []
    for micro in (int(x) for x in args.micro.split(",")):
        for checkpointed in (layers if x == "all" else int(x) for x in args.checkpointed.split(",")):
            if time.monotonic() - began > args.budget_s:
                points.append({"micro": micro, "checkpointed": checkpointed, "skipped": "budget"})
                continue
            try:
                point = time_point(model, optimizer, cfg, micro, checkpointed, args)
            except torch.OutOfMemoryError:
                point = {"micro": micro, "checkpointed": checkpointed, "oom": True}
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            points.append(point)
            print(json.dumps(point), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    summary = {
        "model": args.model, "layers": layers, "seq": args.seq, "global_batch": args.global_batch,
        "loss": args.loss, "torch": torch.__version__, "device": device, "points": points,
    }  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"plain-pytorch-{layers}.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    timed = [p for p in points if "tokens_per_s" in p]
    if timed:
        best = max(timed, key=lambda p: p["tokens_per_s"])
        words = f"micro {best['micro']}, {best['checkpointed']} recomputed"
        print(f"fastest: {words}: {best['tokens_per_s']:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
