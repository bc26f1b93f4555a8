"""The recompute cost model's inputs (issue 29): step time against micro-batch and layers checkpointed, one GPU.

One process, one model: Qwen3-8B layer shapes (``--layers`` of them), random init, bf16, ZeRO-3
through ``deepspeed.initialize`` with the DeepSpeed config dzctl generates for the job
(``planning/dsconfig.py``), Liger's kernels as the trainer applies them (``train/model/loss.py``),
torch's fused AdamW, full rows of random ids at ``--seq``. For every (micro, N) of the grid the first
N decoder layers are checkpointed (``train/model/checkpointing.py::checkpoint_first``, what a job with
``train.gradient_checkpointing: N`` runs), one warm-up step, then the median of ``--steps`` timed
steps (``cuda.synchronize`` around each) and the peak allocated memory. An OOM is recorded and skipped.

``planning/speed/recompute.py`` takes its constants from a least-squares fit of these times to
``t/token = a · (1 + rho · N/L) + a · C / tokens`` (``fit`` below, run again on the committed JSON by
``--refit``). With ``--lora``: the same over a PEFT LoRA model (r 16, the 7 projections, ``--lora-dropout``, default 0).
``--profile`` then profiles one more step of the first point that fitted (``profile_step``).

    python3 benchmarks/recompute_h200.py --layers 18 --out DIR            # GPU machine, about 3 min
    python3 benchmarks/recompute_h200.py --refit DIR/recompute.json       # the fit again, anywhere
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


def fit(points: list[dict], layers: int) -> dict:
    """Least squares of seconds per token on (1, N/L, 1/tokens): t = a + b·N/L + c/tokens; rho = b/a, C = c/a."""
    rows = [(1.0, p["checkpointed"] / layers, 1.0 / p["tokens"]) for p in points]
    ys = [p["median_step_s"] / p["tokens"] for p in points]
    # Normal equations for three unknowns, solved by Cramer's rule (no numpy needed to refit).
    m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]

    def det(a):
        return (
            a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
            - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
        )

    d = det(m)
    coef = []
    for k in range(3):
        mk = [row[:] for row in m]
        for i in range(3):
            mk[i][k] = v[i]
        coef.append(det(mk) / d)
    a, b, c = coef
    worst = max(abs((a + b * r[1] + c * r[2]) / y - 1) for r, y in zip(rows, ys, strict=True))
    return {"a_s_per_token": a, "rho": b / a, "fixed_tokens": c / a, "worst_relative_error": worst}


def build(args):
    import deepspeed
    import torch
    import transformers
    from zero3_h200 import MODELS

    from orchestrator.planning import dsconfig
    from orchestrator.spec.job import JobSpec
    from orchestrator.train.model import loss

    cfg = dict(MODELS["qwen3-8b"], num_hidden_layers=args.layers)
    spec = JobSpec.model_validate(
        {"name": "recompute", "model": {"name_or_path": "x", "init": "random", "config": cfg}, "data": {"path": "x"}}
    )
    reduce, prefetch, persistence = dsconfig.bucket_sizes(cfg["hidden_size"])
    resolved = dsconfig.Resolved(1, True, False, False, reduce, prefetch, persistence, "bf16", fused_loss="liger")
    ds = dsconfig.build_ds_config(spec, resolved, 1)
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1)
    if args.persistence is not None:
        # Parameters below this many elements stay gathered on the GPU: no fetch, no release, every step.
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = args.persistence
    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    loss.apply_fused_loss(model, "liger")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )  # fmt: skip
        model = get_peft_model(model, lora)
        model.enable_input_require_grads()
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if args.fetch_unit == "layer":  # as the trainer does for zero.fetch_unit: layer
        from orchestrator.train.model import fetchunit

        print(f"fetch unit: layer ({fetchunit.fetch_by_layer(model)} leaf modules)", flush=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, model_parameters=trainable)
    return engine, cfg


def time_steps(engine, cfg, micro: int, n: int, args) -> dict:
    import torch

    from orchestrator.train.model import checkpointing

    checkpointing.checkpoint_first(engine.module, n)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, cfg["vocab_size"], (micro, args.seq), device="cuda")
    times = []
    for step in range(1 + args.steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - began)
    median = statistics.median(times)
    return {
        "micro": micro,
        "checkpointed": n,
        "tokens": micro * args.seq,
        "step_s": [round(t, 4) for t in times],
        "median_step_s": round(median, 4),
        "tokens_per_s": round(micro * args.seq / median, 1),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro", default="2,4,8,16")
    parser.add_argument("--checkpointed", default="0,half,all", help="N values: numbers, 'half', 'all'")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--budget-s", type=float, default=400)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--refit", type=Path, help="fit a recorded recompute.json again")
    parser.add_argument("--persistence", type=int, default=None, help="stage3_param_persistence_threshold")
    parser.add_argument("--profile", action="store_true", help="after the grid, profile one step of its first fit")
    parser.add_argument(
        "--fetch-unit", choices=("module", "layer"), default="module", help="zero.fetch_unit (module: DeepSpeed's own)"
    )
    parser.add_argument(
        "--first-fit", action="store_true", help="stop at the first point that fits (--micro 45,32: 45, else 32)"
    )
    parser.add_argument("--tag", default="", help="suffix of the output files")
    args = parser.parse_args()
    if args.refit:
        recorded = json.loads(args.refit.read_text())
        print(json.dumps(fit([p for p in recorded["points"] if "median_step_s" in p], recorded["layers"]), indent=2))
        return 0
    import deepspeed
    import torch

    began = time.monotonic()
    engine, cfg = build(args)
    names = {"half": args.layers // 2, "all": args.layers}
    ns = [names[x] if x in names else int(x) for x in args.checkpointed.split(",")]
    points: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for micro in (int(x) for x in args.micro.split(",")):
        for n in ns:
            if args.first_fit and any("median_step_s" in p for p in points):
                break
            if time.monotonic() - began > args.budget_s:
                points.append({"micro": micro, "checkpointed": n, "skipped": "budget"})
                continue
            try:
                point = time_steps(engine, cfg, micro, n, args)
            except torch.OutOfMemoryError:
                point = {"micro": micro, "checkpointed": n, "oom": True}
                torch.cuda.empty_cache()
            points.append(point)
            print(json.dumps(point), flush=True)
            summary = {
                "layers": args.layers, "seq": args.seq, "lora": args.lora, "lora_dropout": args.lora_dropout,
                "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                "device": torch.cuda.get_device_name(), "points": points,
            }  # fmt: skip
            timed = [p for p in points if "median_step_s" in p]
            if len({p["checkpointed"] for p in timed}) >= 2 and len({p["micro"] for p in timed}) >= 2:
                summary["fit"] = fit(timed, args.layers)
            name = ("recompute-lora" if args.lora else "recompute") + args.tag + ".json"
            (args.out / name).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary.get("fit")), flush=True)
    fitted = [p for p in points if "median_step_s" in p]
    if args.profile and fitted:
        profile_step(engine, cfg, fitted[0], args)
    return 0


# Kernel names -> the cost they belong to, first match wins (lower-case substrings). Liger's Triton kernels
# (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy) and LoRA's dropout (its mask kernel forward, the
# masked scale backward) are named before the generic element-wise ones.
CATEGORIES = (
    ("ZeRO-3 collectives (NCCL)", ("nccl",)),
    ("LoRA dropout", ("dropout", "masked_scale")),
    ("attention (cuDNN/flash SDPA)", ("sdpa", "fmha", "flash", "attention")),
    ("matmuls (GEMM)", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "wgmma")),
    ("optimizer + grad norm (multi-tensor)", ("adam", "multi_tensor")),
    ("Liger kernels (norm, SwiGLU, RoPE, loss)", ("rms_norm", "swiglu", "rope", "cross_entropy", "element_mul")),
    ("copies, casts, fills", ("memcpy", "memset", "copy", "fill")),
    ("element-wise + reductions (aten)", ("elementwise", "reduce", "unrolled", "vectorized")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((label for label, keys in CATEGORIES if any(k in name for k in keys)), "other kernels")


def profile_step(engine, cfg, point: dict, args) -> None:
    """One step under torch.profiler: the top costs by GPU and by CPU time, as text, and per cost as JSON.

    The JSON has every kernel's time grouped by CATEGORIES, the GPU's idle time (the step's wall time
    less the union of kernel intervals: where the GPU waits for the CPU) and the top kernels and ops, so
    ``steady_report.py`` can give each cost's share of the step. The trace itself is too large to keep.
    """
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from orchestrator.train.model import checkpointing

    micro, n = point["micro"], point["checkpointed"]
    checkpointing.checkpoint_first(engine.module, n)  # the grid's last point may have left another count
    ids = torch.randint(0, cfg["vocab_size"], (micro, args.seq), device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - began
    averages = prof.key_averages()
    head = (
        f"# one step, micro {micro}, {n} of {args.layers} layers checkpointed, lora {args.lora}, "
        f"dropout {args.lora_dropout}, persistence {args.persistence}; wall {wall_s:.3f} s under the profiler, "
        f"{point['median_step_s']} s unprofiled (median of the timed steps)"
    )
    text = [head]
    text.append(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    text.append(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    name = ("profile-lora" if args.lora else "profile") + args.tag
    (args.out / f"{name}.txt").write_text("\n\n".join(text) + "\n", encoding="utf-8")

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy_us, end_us = 0.0, float("-inf")
    for start, end in spans:  # the union of kernel intervals, every stream together
        if end > end_us:
            busy_us += end - max(start, end_us)
            end_us = end
    by_category: dict[str, float] = {}
    by_kernel: dict[str, list] = {}
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_category[category(e.name)] = by_category.get(category(e.name), 0.0) + us
        entry = by_kernel.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ops = [a for a in averages if a.device_type != DeviceType.CUDA]

    def self_device_us(a) -> float:
        return getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0.0)

    ops.sort(key=self_device_us, reverse=True)
    summary = {
        "micro": micro, "checkpointed": n, "layers": args.layers, "seq": args.seq, "tokens": micro * args.seq,
        "lora": args.lora, "lora_dropout": args.lora_dropout, "persistence": args.persistence,
        "unprofiled_median_step_s": point["median_step_s"], "profiled_step_s": round(wall_s, 4),
        "kernel_time_s": round(sum(e.time_range.end - e.time_range.start for e in kernels) / 1e6, 4),
        "gpu_busy_s": round(busy_us / 1e6, 4), "gpu_idle_s": round(max(wall_s - busy_us / 1e6, 0.0), 4),
        "categories_s": {k: round(v / 1e6, 4) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": k, "count": c, "s": round(us / 1e6, 4)}
            for k, (c, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:30]
        ],
        "top_ops_by_self_gpu": [
            {"name": a.key, "count": a.count, "self_gpu_s": round(self_device_us(a) / 1e6, 4),
             "self_cpu_s": round(a.self_cpu_time_total / 1e6, 4)}
            for a in ops[:30]
        ],
        "top_ops_by_self_cpu": [
            {"name": a.key, "count": a.count, "self_cpu_s": round(a.self_cpu_time_total / 1e6, 4)}
            for a in sorted(ops, key=lambda a: -a.self_cpu_time_total)[:30]
        ],
    }  # fmt: skip
    (args.out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
