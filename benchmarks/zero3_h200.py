"""ZeRO-3 throughput of dzctl's trainer (``python -m orchestrator.train``) on one node of GPUs.

Two configurations of a Qwen3-8B-shaped, randomly initialised model at sequence
length 4096 (issue 7; measured on ``nvidia-h200-x2``):

- ``auto``: what ``dzctl plan`` chooses for these GPUs (the memory planner,
  ``orchestrator.planning.memory.fromjob.plan_for_job``), bf16. Its ``ds_config.json`` is written
  beside the job file, as ``dzctl launch`` does.
- ``seed``: the seed article's config (``benchmarks/seed_ds_config.json``: fp16,
  optimizer and parameters offloaded to pinned CPU memory, "auto" values), with
  gradient checkpointing and micro-batch 2.

Data is ``data.path: synthetic:random`` (random token ids of full length, loss on
every token): throughput, not learning. Each run goes through the real entry point
under ``torchrun`` with ``--no-save``, reads the ``end`` event of ``progress.jsonl``
(per-step times: wall time from one step's end to the next, taken without a
``cuda.synchronize``, see ProgressCallback.on_step_end in orchestrator/train/run.py:
ZeRO-3's step waits for its reductions, so in steady state that is the step's time;
peak memory of every rank) and reports the median step after the warm-up steps.

FLOPs per token = 6 × (parameters − input embedding) + 12 × layers × heads × head_dim × seq
(the issue's formula: dense matmuls forward+backward, plus causal attention scores).
MFU is against 989 TFLOP/s (H200/H100 SXM dense bf16). Gradient checkpointing's
recomputation is not counted (as is usual for MFU).

    python3 benchmarks/zero3_h200.py run auto seed --out DIR      # on the GPU machine
    python3 benchmarks/zero3_h200.py table DIR/auto.json DIR/seed.json
    python3 benchmarks/zero3_h200.py run auto --model tiny --steps 4 --out /tmp/b   # CPU smoke run
    python3 benchmarks/zero3_h200.py run auto --tag _x --trainer-arg logging_nan_inf_filter=false --out DIR
        # an A/B of a Hugging Face TrainingArguments value (through benchmarks/trainer_args.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEAK_TFLOPS = 989.0  # H200 SXM dense bf16 (vendor datasheet), the reference

MODELS = {
    # Qwen3-8B's published config.json values (shape only; weights random).
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "rms_norm_eps": 1.0e-6,
        "tie_word_embeddings": False,
    },
    # For a CPU smoke run of this script itself.
    "tiny": {
        "model_type": "qwen3",
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
}

# Warm-up steps left out of the median: the first steps allocate, build caches, tune kernels.
RUNS = {
    "auto": {"label": "dzctl auto plan, bf16", "warmup": 3, "steps": 9},
    "seed": {"label": "seed article: fp16, offload optimizer+params (pinned)", "warmup": 1, "steps": 4},
}


def param_counts(cfg: dict) -> tuple[int, int]:
    """(all parameters, input embedding) of a Qwen3/Llama-style decoder."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter + 2 * h
    if cfg["model_type"] == "qwen3":
        per_layer += 2 * hd  # q_norm and k_norm
    embed = v * h
    lm_head = 0 if cfg.get("tie_word_embeddings") else v * h
    return embed + cfg["num_hidden_layers"] * per_layer + h + lm_head, embed


def flops_per_token(cfg: dict, seq: int) -> float:
    total, embed = param_counts(cfg)
    attention = 12 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * seq
    return 6 * (total - embed) + attention


def job_spec(name: str, model: str, seq: int, steps: int, accelerator: str, logging_steps: int = 1) -> dict:
    spec = {
        "name": f"bench-{name}",
        "accelerator": accelerator,
        "runtime": "process",
        "model": {
            "name_or_path": f"{model}-shape",
            "init": "random",
            "tokenizer": "builtin:byte-level",
            "config": MODELS[model],
        },
        "data": {"path": "synthetic:random"},
        "train": {
            "max_seq_len": seq,
            "max_steps": steps,
            "learning_rate": 1.0e-5,
            "lr_scheduler": "constant",
            "logging_steps": logging_steps,
            "save_steps": 1_000_000,
        },
        "zero": {"stage": 3},
    }
    if name == "auto":
        spec["train"].update(micro_batch_size="auto", gradient_checkpointing="auto", precision="auto")
        spec["zero"]["offload"] = "auto"
    else:
        spec["train"].update(micro_batch_size=2, gradient_checkpointing=True, precision="fp16")
        spec["zero"]["config"] = str(ROOT / "benchmarks" / "seed_ds_config.json")
    if accelerator == "cpu":
        spec["train"]["precision"] = "fp32"
        spec["train"]["gradient_checkpointing"] = False
    return spec


def plan_and_write(name: str, spec: dict, workdir: Path, nproc: int, gpu_mem_gib: float | None) -> dict:
    """Plan like ``dzctl launch``: resolve every auto, write job.yaml and ds_config.json."""
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.memory.estimate import GIB
    from orchestrator.planning.memory.fromjob import plan_for_job
    from orchestrator.spec.job import load_job

    workdir.mkdir(parents=True, exist_ok=True)
    draft = workdir / "draft.yaml"
    draft.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    job = load_job(draft)
    plan, ds_config = plan_for_job(read_inputs(job), [nproc], gpu_mem_gib=gpu_mem_gib, host_mem_gib=None)
    if not plan.fits:
        raise SystemExit(f"{name}: the planner says it does not fit: {plan.reason}")
    resolved = plan.resolved()
    spec["train"].update(
        micro_batch_size=resolved.micro_batch_size,
        gradient_checkpointing=resolved.gradient_checkpointing,
        precision=resolved.precision,
    )
    spec["zero"]["offload"] = "all" if resolved.offload_param else "optimizer" if resolved.offload_optimizer else "none"
    spec["zero"].pop("config", None)  # merged into ds_config.json, which is authoritative
    (workdir / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    (workdir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n", encoding="utf-8")
    return {
        "micro_batch_size": resolved.micro_batch_size,
        "gradient_checkpointing": resolved.gradient_checkpointing,
        "offload_optimizer": resolved.offload_optimizer,
        "offload_param": resolved.offload_param,
        "precision": resolved.precision,
        "predicted_peak_gib": round(plan.estimate.gpu_peak / GIB, 1),
    }


def run_one(name: str, args: argparse.Namespace, gpu_mem_gib: float | None, accelerator: str) -> dict:
    cfg = RUNS[name]
    steps = args.steps or cfg["steps"]
    tag = name + args.tag
    workdir = Path(args.work) / tag
    shutil.rmtree(workdir, ignore_errors=True)
    spec = job_spec(name, args.model, args.seq, steps, accelerator, args.logging_steps)
    from orchestrator.spec.job import apply_override

    for item in args.set:
        apply_override(spec, item)
    choice = plan_and_write(name, spec, workdir, args.nproc, gpu_mem_gib)
    print(f"== {tag}: {cfg['label']}: {json.dumps(choice)}", flush=True)
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.update(item.split("=", 1) for item in args.env)
    trainer_args = trainer_overrides(args.trainer_arg)
    # NVLink multicast stays off on shared hosts (it can wedge the host's GPUs for everyone).
    for var in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # With Trainer overrides: the same entry point through benchmarks/trainer_args.py.
    entry = ["-m", "orchestrator.train"]
    if trainer_args:
        env["DZCTL_BENCH_TRAINER_ARGS"] = json.dumps(trainer_args)
        entry = [str(ROOT / "benchmarks" / "trainer_args.py")]
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        "--master_port", str(args.port), *entry, str(workdir / "job.yaml"),
        "--output-dir", str(workdir / "output"), "--no-save",
    ]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{tag}.log", "w", encoding="utf-8") as log:
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    events = [json.loads(x) for x in (workdir / "output" / "progress.jsonl").read_text().splitlines() if x.strip()]
    end = next((e for e in events if e["event"] == "end"), None)
    result = {"name": tag, "label": cfg["label"] + args.tag, "model": args.model, "seq": args.seq, "nproc": args.nproc}
    result.update(logging_steps=args.logging_steps, env=args.env, overrides=args.set, trainer_args=trainer_args)
    result.update(choice, exit_code=code, warmup=cfg["warmup"])
    # DeepSpeed warns once a step when PyTorch's allocator had to free its cache to
    # satisfy an allocation (memory pressure): a fitting plan should never see one.
    log_text = (out / f"{tag}.log").read_text(encoding="utf-8", errors="replace")
    result["allocator_cache_flush_warnings"] = log_text.count("allocator cache flushes")
    if end is None:
        result["error"] = next((e.get("reason") for e in events if e["event"] == "error"), "no end event")
    else:
        times = end["step_times_s"]
        measured = times[cfg["warmup"] :] or times
        median = statistics.median(measured)
        tokens_per_gpu = (
            choice["micro_batch_size"]
            * args.seq
            * json.loads((workdir / "ds_config.json").read_text())["gradient_accumulation_steps"]
        )
        tps = tokens_per_gpu / median
        fpt = flops_per_token(MODELS[args.model], args.seq)
        peaks = end.get("gpu_mem_peak_gib_per_rank") or []
        result.update(
            step_times_s=times,
            median_step_s=round(median, 3),
            tokens_per_s_per_gpu=round(tps, 1),
            tflops_per_gpu=round(tps * fpt / 1e12, 1),
            mfu=round(tps * fpt / 1e12 / PEAK_TFLOPS, 4),
            peak_allocated_gib=[p[0] for p in peaks],
            peak_reserved_gib=[p[1] for p in peaks],
            final_loss=end.get("loss"),
        )
    (out / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def trainer_overrides(items: list[str]) -> dict:
    """``KEY=VALUE`` pairs of ``TrainingArguments`` overrides; a VALUE is JSON (``false``, ``10``, ``{...}``)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--trainer-arg {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare string
    return out


def table(results: list[dict]) -> str:
    head = (
        "| config | micro-batch | ckpt | offload | tokens/s/GPU | TFLOP/s/GPU | MFU | "
        "peak alloc / reserved GiB per GPU | predicted GiB | median step s |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} |")
            continue
        offload = "opt+param" if r["offload_param"] else "opt" if r["offload_optimizer"] else "none"
        mem = ", ".join(
            f"{a:.1f} / {b:.1f}" for a, b in zip(r["peak_allocated_gib"], r["peak_reserved_gib"], strict=True)
        )
        ckpt = r["gradient_checkpointing"]
        head = f"| {r['label']} ({r['precision']}) | {r['micro_batch_size']} | {ckpt} | {offload} | "
        lines.append(
            head + f"{r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.1f} | {100 * r['mfu']:.1f}% | {mem} | "
            f"{r['predicted_peak_gib']} | {r['median_step_s']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("configs", nargs="+", choices=sorted(RUNS))
    run.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    run.add_argument("--seq", type=int, default=4096)
    run.add_argument("--nproc", type=int, default=2)
    run.add_argument("--steps", type=int, default=None, help="steps per run (default: per config)")
    run.add_argument("--port", type=int, default=29531)
    run.add_argument("--out", default="benchmarks/results/latest")
    run.add_argument("--work", default="/tmp/dzctl-bench")
    run.add_argument("--logging-steps", type=int, default=1, help="train.logging_steps (each log syncs the GPU)")
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra trainer environment")
    run.add_argument("--tag", default="", help="suffix for this run's output names")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job spec override")
    run.add_argument(
        "--trainer-arg", action="append", default=[], metavar="KEY=JSON", help="HF TrainingArguments override"
    )
    show = sub.add_parser("table")
    show.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args()
    if args.command == "table":
        print(table([json.loads(p.read_text()) for p in args.results]))
        return 0
    import torch

    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    gpu_mem = torch.cuda.get_device_properties(0).total_memory / 2**30 if accelerator == "gpu" else None
    results = [run_one(name, args, gpu_mem, accelerator) for name in args.configs]
    print(table(results), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
