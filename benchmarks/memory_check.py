"""Predicted vs measured memory of ZeRO-3 setups on one GPU: the planner's end-to-end check.

For each case: a job spec (random-init model of a catalogue shape, explicit
micro-batch, checkpointing and offload) goes through ``plan_for_job`` exactly as
``dzctl plan`` does; its ``ds_config`` then drives a raw DeepSpeed engine for a few
steps on random tokens. Recorded: peak ``torch.cuda.max_memory_allocated`` against
the predicted GPU peak, and the process's peak resident memory (VmHWM, which
includes pinned host buffers) against the predicted host RAM per rank.

    python3 benchmarks/memory_check.py --out DIR [CASE ...]    # on the GPU machine
    python3 benchmarks/memory_check.py --list

One process per case (a fresh CUDA context and host heap each), world size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.planning.inputs import read_inputs  # noqa: E402
from orchestrator.planning.memory.estimate import GIB  # noqa: E402
from orchestrator.planning.memory.fromjob import plan_for_job  # noqa: E402
from orchestrator.planning.shape import CATALOGUE  # noqa: E402
from orchestrator.spec.job import load_job  # noqa: E402

# name: (catalogue model, seq, micro, checkpointing, offload, precision)
CASES = {
    "qwen3-4b-m2-ckpt": ("Qwen/Qwen3-4B", 4096, 2, True, "none", "bf16"),
    "qwen3-4b-m1-nockpt": ("Qwen/Qwen3-4B", 4096, 1, False, "none", "bf16"),
    "qwen3-1.7b-m4-ckpt": ("Qwen/Qwen3-1.7B", 4096, 4, True, "none", "bf16"),
    "qwen3-1.7b-m2-ckpt-offopt": ("Qwen/Qwen3-1.7B", 4096, 2, True, "optimizer", "bf16"),
    "qwen3-4b-m2-ckpt-offall": ("Qwen/Qwen3-4B", 4096, 2, True, "all", "bf16"),
    "qwen3-1.7b-m2-ckpt-offall": ("Qwen/Qwen3-1.7B", 4096, 2, True, "all", "bf16"),
}
STEPS = 3


def job_yaml(case: str) -> str:
    model, seq, micro, ckpt, offload, precision = CASES[case]
    config = dict(CATALOGUE[model], max_position_embeddings=max(seq, 4096))
    lines = [
        f"name: {case.replace('.', '-')}",
        "model:",
        f"  name_or_path: {model}",
        "  init: random",
        "  config:",
        *[f"    {k}: {json.dumps(v)}" for k, v in config.items()],
        "data:",
        "  path: synthetic:random",
        "train:",
        f"  max_seq_len: {seq}",
        f"  micro_batch_size: {micro}",
        f"  gradient_checkpointing: {'true' if ckpt else 'false'}",
        f"  precision: {precision}",
        "zero:",
        f"  offload: {offload}",
    ]
    return "\n".join(lines) + "\n"


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_case(case: str, gpu_mem_gib: float, host_mem_gib: float) -> dict:
    """Runs inside the child process: plan, then train a few steps, then measure."""
    import deepspeed
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(job_yaml(case), encoding="utf-8")
        job = load_job(path)
        plan, ds = plan_for_job(read_inputs(job), [1], gpu_mem_gib=gpu_mem_gib, host_mem_gib=host_mem_gib)
    _, seq, micro, ckpt, _, _ = CASES[case]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(0)
    config = transformers.AutoConfig.for_model(**job.spec.model.config)
    config._attn_implementation = "sdpa"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.precision]
    started = time.time()
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    optimizer = None
    if "optimizer" not in ds:
        # dsconfig leaves the optimizer to the HF Trainer when nothing is offloaded: it
        # hands DeepSpeed torch's fused AdamW, as here.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        ds = dict(ds, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer, config=ds)
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (micro, seq), device="cuda")
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss))
    torch.cuda.synchronize()
    est = plan.estimate
    return {
        "case": case,
        "setup": dict(
            zip(("model", "seq", "micro", "checkpointing", "offload", "precision"), CASES[case], strict=True)
        ),
        "fits_predicted": plan.fits,
        "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "gpu_predicted_gib": est.gpu_peak / GIB,
        "gpu_terms_gib": {k: round(v / GIB, 3) for k, v in est.gpu_terms.items()},
        "host_vmhwm_gib": status_kib("VmHWM") / 2**20,
        "host_rss_gib": status_kib("VmRSS") / 2**20,
        "host_rss_shmem_gib": status_kib("RssShmem") / 2**20,
        "host_predicted_gib": est.host_per_rank / GIB,
        "host_terms_gib": {k: round(v / GIB, 3) for k, v in est.host_terms_per_rank.items()},
        "losses": losses,
        "seconds": time.time() - started,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-mem-gib", type=float, default=139.0)
    parser.add_argument("--host-mem-gib", type=float, default=128.0)
    args = parser.parse_args()
    if args.list:
        print("\n".join(CASES))
        return 0
    if args.child:
        print("RESULT " + json.dumps(run_case(args.child, args.gpu_mem_gib, args.host_mem_gib)), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases or list(CASES):
        argv = [sys.executable, __file__, "--child", case, "--gpu-mem-gib", str(args.gpu_mem_gib)]
        argv += ["--host-mem-gib", str(args.host_mem_gib)]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        (args.out / f"{case}.log").write_text(proc.stdout[-20000:] + proc.stderr[-40000:], encoding="utf-8")
        found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(found[-1]) if found else {"case": case, "error": f"exit {proc.returncode}"}
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("terms_gib")}), flush=True)
    (args.out / "memory_check.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
