"""Useful tokens per second through ``dzctl launch --runtime process`` on this machine (issue 12).

Three configurations of a Qwen3-8B-shaped, randomly initialised model at sequence
length 4096, ZeRO-3 on every GPU of the machine (``hostfiles/localhost.txt``),
each launched by the product itself (``python -m orchestrator launch JOB --hosts
hostfiles/localhost.txt --runtime process --follow --json``), side by side:

- ``today``: the path before issue 12: ``train.packing=false`` (one example a row,
  each micro-batch padded to its longest row), and ``train.fused_loss=none`` when
  this checkout's spec has that key;
- ``auto``: every choice left to dzctl (packing on for GPU jobs, the fused loss's
  ``auto`` where it exists, the planner's micro-batch);
- ``synthetic``: ``data.path: synthetic:random`` (full rows of random ids), auto plan.

``today`` and ``auto`` train on ``benchmarks/sft_data.py`` rows (log-normal lengths,
median 500, mean ~700 tokens of the byte-level tokenizer the job uses, capped at
``--seq``). Figures per configuration, from the run's ``progress.jsonl``: the median
over the steps after ``--warmup`` of useful (real, non-pad) tokens/s/GPU and processed
tokens/s/GPU, padding efficiency, MFU, the planner's predicted peak (``dzctl plan
--json``, per_gpu_gib) against every rank's measured ``max_memory_allocated``, the
attention kernel the trainer used (its ``start`` event), and the packing line of the
trainer's data summary.

MFU counts useful tokens only: FLOPs/token = 6 × (parameters − input embedding) + 12 ×
layers × heads × head_dim × L (benchmarks/zero3_h200.py's formula), where L is the
sequence length for full rows and, for the SFT rows, sum(n²)/sum(n) over the examples'
lengths n (a packed or padded example attends only within itself). 989 TFLOP/s peak.

    python3 benchmarks/useful_tokens_h200.py --out DIR                   # on the GPU machine (~6 min)
    python3 benchmarks/useful_tokens_h200.py --model tiny --seq 256 --rows 160 --steps 3 --warmup 1 \\
        --set train.packing=true --out /tmp/u                            # CPU smoke run

Outputs in ``--out``: ``summary.json`` (every figure, the step events, the plans) and
``runs.log`` (each launch's output, one after the other).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_data  # noqa: E402
from zero3_h200 import MODELS, PEAK_TFLOPS, flops_per_token  # noqa: E402

CONFIGS = ("today", "auto", "synthetic")
HOSTS = ROOT / "hostfiles" / "localhost.txt"
LAUNCH_TIMEOUT_S = 240
PLAN_KEYS = (
    "micro_batch_size", "gradient_checkpointing", "checkpointed_layers", "decoder_layers", "precision", "zero",
    "fused_loss", "per_gpu_gib", "ds_config", "fetch_unit",
)  # fmt: skip  # one configuration; a hung run is stopped and reported, the others still run


def spec_has(dotted: str) -> bool:
    """Whether this checkout's job spec knows a key (``train.fused_loss`` lands separately)."""
    from orchestrator.spec.job import JobSpec

    model = JobSpec
    for key in dotted.split("."):
        field = model.model_fields.get(key)
        if field is None:
            return False
        model = field.annotation
    return True


def model_config(args: argparse.Namespace) -> dict:
    """The model's shape; ``--layers`` keeps every layer's published shape and takes fewer of them."""
    config = dict(MODELS[args.model])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    return config


def job_spec(config: str, args: argparse.Namespace, accelerator: str, data_file: str, workdir: Path) -> dict:
    train = {
        "max_seq_len": args.seq,
        "max_steps": args.steps,
        "learning_rate": 1.0e-5,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "save_steps": 1_000_000,
    }
    if spec_has("train.save"):
        # A throughput run: no checkpoint and no consolidated model (an 8B model's ZeRO-3 states
        # are about 130 GB, more than the GPU machine's free disk; the first one-GPU run hit that).
        train["save"] = False
    if accelerator == "cpu":
        train.update(precision="fp32", gradient_checkpointing=False)
    spec = {
        "name": f"useful-{config}",
        "accelerator": accelerator,
        "runtime": "process",
        "model": {
            "name_or_path": f"{args.model}-shape",
            "init": "random",
            "tokenizer": "builtin:byte-level",
            "config": model_config(args),
        },
        "data": {"path": "synthetic:random" if config == "synthetic" else data_file, "format": "alpaca"},
        "train": train,
        "zero": {"stage": 3},
        "launch": {
            "python": sys.executable,
            "remote_dir": str(workdir / "remote"),
            "master_port": args.port,
            "env": dict(item.split("=", 1) for item in args.env),
        },
    }
    from orchestrator.spec.job import apply_override

    for item in args.set:
        apply_override(spec, item)
    if config == "today":  # last: what makes it today's path wins over --set
        apply_override(spec, "train.packing=false")
        if spec_has("train.fused_loss"):
            apply_override(spec, "train.fused_loss=none")
    return spec


def gpu_mem_gib() -> float | None:
    """What ``dzctl launch`` reads: nvidia-smi memory.total / 1024 (H200: 140.4)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        return round(float(out.split()[0]) / 1024, 1)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def dzctl(*argv: str, env: dict[str, str], timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def run_config(config: str, args, accelerator: str, data_file: Path, gpu_gib: float | None, env, log) -> dict:
    workdir = Path(args.work) / config
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    local_data = workdir / data_file.name
    shutil.copy(data_file, local_data)  # beside the job file: launch ships it with the job
    spec = job_spec(config, args, accelerator, local_data.name, workdir)
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    result: dict = {"config": config, "overrides": args.set, "env": args.env}
    plan_argv = ["plan", str(job), "--hosts", str(args.hosts), "--runtime", "process", "--json"]
    if gpu_gib:
        plan_argv += ["--gpu-mem-gib", str(gpu_gib)]
    planned = dzctl(*plan_argv, env=env, timeout=120)
    try:
        plan = json.loads(planned.stdout)
    except json.JSONDecodeError:
        plan = {"error": planned.stderr[-2000:]}
    result["plan"] = {k: plan.get(k) for k in PLAN_KEYS}
    result["predicted_peak_gib"] = plan.get("per_gpu_gib")
    started = time.monotonic()
    if args.tune:
        return result | run_tune(job, args, env, log)
    launch_argv = ["launch", str(job), "--hosts", str(args.hosts), "--runtime", "process", "--follow", "--json"]
    try:
        launched = dzctl(*launch_argv, env=env, timeout=LAUNCH_TIMEOUT_S)
        stdout, stderr, code = launched.stdout, launched.stderr, launched.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        code = "timeout"
        dzctl("stop", spec["name"], env=env, timeout=60)
    result["launch_exit_code"] = code
    result["launch_wall_s"] = round(time.monotonic() - started, 1)
    log.write(f"===== {config}: {' '.join(launch_argv)}\n{stderr}\n{stdout}\n")
    log.flush()
    progress = workdir / "remote" / "output" / spec["name"] / "progress.jsonl"
    if code not in (0, "timeout") and not progress.exists() and "ds_config" in plan:
        # Launch refused before any rank started: this checkout's launch refusing
        # synthetic:random (issue 12's last item, done elsewhere), or preflight failing on a
        # machine without `ip` (issue 13). Run the same planned job through the trainer
        # under torchrun, and say so in the result.
        result["ran_via"] = "torchrun: dzctl launch refused: " + " / ".join(stderr.strip().splitlines()[-2:])
        stderr = run_trainer_directly(spec, plan, workdir, args, env, log)
    events = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()] if progress.exists() else []
    result.update(measure(events, args, config, stderr))
    if "error" in result and code != 0:
        result["launch_error"] = stderr.strip().splitlines()[-3:]  # e.g. launch refusing the spec
    return result


def run_tune(job: Path, args, env: dict, log) -> dict:
    """``dzctl tune``: the planner's top candidates (its own choice first), each a launch of --steps steps on this
    node, measured in one call; its JSON is the result (tune.json in --out)."""
    argv = ["tune", str(job), "--hosts", str(args.hosts), "--runtime", "process", "--top", str(args.tune)]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(LAUNCH_TIMEOUT_S), "--json"]
    started = time.monotonic()
    try:
        done = dzctl(*argv, env=env, timeout=args.budget_s)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:  # what it printed so far (its candidate lines) is kept
        partial = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        stdout, stderr, code = "", f"{partial}\n{exc}", "timeout"
        dzctl("stop", f"{yaml.safe_load(job.read_text(encoding='utf-8'))['name']}-tune", env=env, timeout=60)
    log.write(f"===== tune: {' '.join(argv)}\n{stderr}\n{stdout}\n")
    log.flush()
    (args.out / "tune.json").write_text(stdout, encoding="utf-8")
    # Each candidate's own progress events, so a tune cut by the time limit still leaves its finished candidates.
    tunes = job.parent / "remote" / "tune"
    for progress in sorted(tunes.rglob("progress.jsonl")):  # tune/ID/LABEL[/...]/progress.jsonl
        shutil.copy(progress, args.out / f"progress-{'-'.join(progress.relative_to(tunes).parts[1:-1])}.jsonl")
    try:
        tuned = json.loads(stdout)
    except json.JSONDecodeError:
        tuned = {"error": stderr.strip().splitlines()[-3:] if stderr.strip() else "no output"}
    return {"tune": tuned, "tune_exit_code": code, "tune_wall_s": round(time.monotonic() - started, 1)}


def run_trainer_directly(spec: dict, plan: dict, workdir: Path, args, env: dict, log) -> str:
    """The planned job (autos resolved as launch would) through ``torchrun -m orchestrator.train``."""
    spec["train"].update(
        micro_batch_size=plan["micro_batch_size"],
        gradient_checkpointing=plan["gradient_checkpointing"],
        precision=plan["precision"],
    )
    zero = plan["zero"]
    spec["zero"]["offload"] = "all" if zero["offload_param"] else "optimizer" if zero["offload_optimizer"] else "none"
    job = workdir / "job-direct.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    (workdir / "ds_config.json").write_text(json.dumps(plan["ds_config"], indent=2) + "\n", encoding="utf-8")
    output = workdir / "remote" / "output" / spec["name"]
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        "--master_port", str(args.port), "-m", "orchestrator.train", str(job), "--output-dir", str(output), "--no-save",
    ]  # fmt: skip
    run_env = {**env, **dict(item.split("=", 1) for item in args.env)}
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False
        )
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        text = "timed out"
    log.write(f"===== synthetic (direct): {' '.join(argv)}\n{text}\n")
    log.flush()
    return text


def measure(events: list[dict], args, config: str, trainer_output: str) -> dict:
    start = next((e for e in events if e["event"] == "start"), {})
    end = next((e for e in events if e["event"] == "end"), None)
    steps = [e for e in events if e["event"] == "step" and e.get("step_time_s")]
    out: dict = {"attention": start.get("attention"), "packing": start.get("packing"), "steps": steps}
    packed = re.search(r"packing efficiency ([0-9.]+)% \(.*?\)", trainer_output)
    rows = re.search(r"into (\d+) rows of", trainer_output)
    out["data_packing_efficiency"] = float(packed.group(1)) / 100 if packed else None
    out["packed_rows"] = int(rows.group(1)) if rows else None
    loss = re.search(r"dzctl-train: loss (\S+)", trainer_output)  # the fused loss's line, where the trainer has one
    out["loss_path"] = loss.group(1) if loss else None
    if end is None:
        out["error"] = next((e.get("reason") for e in events if e["event"] == "error"), "no end event")
        return out
    measured = [e for e in steps if e["step"] > args.warmup] or steps
    useful = statistics.median(e["tokens_per_s"] for e in measured) / args.nproc
    processed = statistics.median((e.get("processed_tokens_per_s") or e["tokens_per_s"]) for e in measured)
    efficiency = [e["padding_efficiency"] for e in measured if e.get("padding_efficiency") is not None]
    attention_len = args.seq if config == "synthetic" else args.attention_len
    tflops = useful * flops_per_token(model_config(args), attention_len) / 1e12
    peaks = end.get("gpu_mem_peak_gib_per_rank") or []
    out.update(
        measured_steps=[e["step"] for e in measured],
        median_step_s=statistics.median(e["step_time_s"] for e in measured),
        useful_tokens_per_s_per_gpu=round(useful, 1),
        processed_tokens_per_s_per_gpu=round(processed / args.nproc, 1),
        padding_efficiency=round(statistics.median(efficiency), 4) if efficiency else None,
        attention_len=attention_len,
        tflops_per_gpu=round(tflops, 1),
        mfu=round(tflops / PEAK_TFLOPS, 4),
        peak_allocated_gib=[p[0] for p in peaks],
        peak_reserved_gib=[p[1] for p in peaks],
        final_loss=end.get("loss"),
    )
    return out


def table(results: list[dict]) -> str:
    head = (
        "| config | attention | loss | micro | useful tok/s/GPU | processed tok/s/GPU | padding eff. | "
        "data packing eff. (rows) | MFU | predicted GiB | measured peak alloc GiB |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in results:
        if "tune" in r:  # dzctl tune's candidates: tune.json, benchmarks/plans_report.py
            lines.append(f"| {r['config']} | dzctl tune, exit {r['tune_exit_code']}: see tune.json |")
            continue
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error']} (launch exit {r.get('launch_exit_code')}) |")
            continue
        packing = (
            f"{100 * r['data_packing_efficiency']:.1f}% ({r['packed_rows']})" if r["data_packing_efficiency"] else "-"
        )
        peaks = ", ".join(f"{p:.1f}" for p in r["peak_allocated_gib"]) or "-"
        eff = f"{100 * r['padding_efficiency']:.1f}%" if r["padding_efficiency"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['attention']} | {r.get('loss_path') or 'plain'} | "
            f"{r['plan'].get('micro_batch_size')} | "
            f"{r['useful_tokens_per_s_per_gpu']:,.0f} | {r['processed_tokens_per_s_per_gpu']:,.0f} | {eff} | "
            f"{packing} | {100 * r['mfu']:.1f}% | {r['predicted_peak_gib']} | {peaks} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=list(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8, help="steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    # 3,000 rows pack into ~510 full rows: one epoch covers 8 steps at micro-batches up to 32 on 2 GPUs, so
    # no short end-of-epoch step falls among the measured ones.
    parser.add_argument("--rows", type=int, default=3000, help="SFT rows generated (enough for --steps)")
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the same shape (one GPU)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", default="/tmp/dzctl-useful")
    parser.add_argument(
        "--tune", type=int, default=0, metavar="TOP", help="run `dzctl tune --top TOP` instead of one launch"
    )
    parser.add_argument("--budget-s", type=float, default=560, help="skip configurations that would overrun this")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override, every config")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="trainer environment (launch.env)"
    )
    args = parser.parse_args()
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configuration(s): {', '.join(sorted(unknown))}")
    import torch

    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    args.nproc = torch.cuda.device_count() if accelerator == "gpu" else 2  # hostfiles/localhost.txt: slots=2
    args.hosts = HOSTS
    if args.nproc != 2:  # a machine with another GPU count: this machine alone, every GPU
        args.hosts = Path(args.work) / f"localhost-{args.nproc}.txt"
    gpu_gib = gpu_mem_gib() if accelerator == "gpu" else None
    args.out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.hosts != HOSTS:
        args.hosts.write_text(f"localhost slots={args.nproc}\n", encoding="utf-8")
    data_file = Path(args.work) / "sft-lognormal.jsonl"
    rows = sft_data.alpaca_rows(args.rows, seed=0, max_len=args.seq)
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    lengths = sft_data.describe(sft_data.measured_lengths(rows, args.seq))
    args.attention_len = lengths["attention_len"]
    print(f"data {data_file}: {json.dumps(lengths)}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("DZCTL_HOME", str(Path(args.work) / "dzctl-home"))  # the job records, away from ~
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    results: list[dict] = []
    began = time.monotonic()
    summary: dict = {}
    with open(args.out / "runs.log", "w", encoding="utf-8") as log:
        for config in args.configs:
            if time.monotonic() - began > args.budget_s - LAUNCH_TIMEOUT_S:
                # A device command has a hard limit: better two finished runs than three cut short.
                results.append({"config": config, "error": f"skipped: under {LAUNCH_TIMEOUT_S} s of --budget-s left"})
                continue
            result = run_config(config, args, accelerator, data_file, gpu_gib, env, log)
            results.append(result)
            shown = {k: v for k, v in result.items() if k != "steps"}
            print(f"== {config}: {json.dumps(shown)}", flush=True)
            summary = {
                "model": args.model,
                "layers": model_config(args)["num_hidden_layers"],
                "seq": args.seq,
                "nproc": args.nproc,
                "gpu_mem_gib": gpu_gib,
                "steps": args.steps,
                "warmup": args.warmup,
                "data": lengths,
                "torch": torch.__version__,
                "results": results,
                "table": table(results),
            }
            # Written after every configuration: a run cut off by the device's limit keeps what it measured.
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(table(results), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
