"""LoRA at 72B and NVMe offload at 8B, through ``dzctl launch --runtime process`` on this machine (issue 14).

Two runs, each a job file written here and launched by the product itself
(``python -m orchestrator launch JOB --hosts hostfiles/localhost.txt --runtime
process --follow --json``: preflight, the memory planner, the job files, one launcher):

- ``lora72b``: a Qwen2.5-72B-shaped model (the published config.json: 80 layers,
  hidden 8,192, MLP 29,568, vocab 152,064, 64 heads / 8 KV; random weights, bf16)
  with ``train.method: lora`` (r 16 on q, k, v, o, gate, up, down) under ZeRO-3 on
  the GPUs here: the frozen bf16 base is partitioned (72.7 B × 2 bytes / 2 GPUs ≈ 68
  GiB a GPU), only the adapters train.
- ``nvme8b``: a Qwen3-8B-shaped model (its published layer shapes) trained in full
  with ``zero.offload: nvme`` (ZeRO-Infinity: parameters and optimizer states on
  the local disk at ``--nvme-dir``). First the disk is measured with preflight's own
  direct-I/O probe; then the planner (with that reading) says how many bytes the
  disk must hold and how long each step spends in disk I/O. Where the whole model
  does not fit the disk's free space (with a margin) or the run's time budget, the
  script keeps the published layer shapes and takes fewer layers, and says so.

Data is ``synthetic:random`` (full rows, throughput only); ``train.save: false``.
Reported per run: tokens/s/GPU (median step after warm-up), the planner's predicted
peak GPU memory against the measured ``max_memory_allocated`` of every rank, and for
NVMe the predicted disk-I/O time per step against the measured step time.

If ``dzctl launch`` refuses before any rank starts (e.g. this machine lacks a tool
preflight needs), the same planned job runs under ``torchrun -m orchestrator.train``
and the result says so (``ran_via``).

    python3 benchmarks/lora_nvme_h200.py --out DIR                 # on the GPU machine
    python3 benchmarks/lora_nvme_h200.py --model tiny --out /tmp/b --steps 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HOSTS = ROOT / "hostfiles" / "localhost.txt"

# Published config.json values (huggingface.co/Qwen/Qwen2.5-72B, Qwen/Qwen3-8B); weights random.
QWEN25_72B = {
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1.0e-5,
    "tie_word_embeddings": False,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1.0e-6,
    "tie_word_embeddings": False,
}
TINY = {
    "model_type": "qwen3",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# NVMe run: layer counts tried, most first; the disk may hold at most this share of its free space.
NVME_LAYER_CHOICES = (36, 30, 24, 18, 12, 8, 4, 2, 1)
NVME_DISK_SHARE = 0.6


def spec_for(run: str, args: argparse.Namespace, accelerator: str, workdir: Path, layers: int | None = None) -> dict:
    gpu = accelerator == "gpu"
    if run == "lora72b":
        config = dict(QWEN25_72B if gpu and args.model == "real" else TINY)
    else:
        config = dict(QWEN3_8B if gpu and args.model == "real" else TINY)
        if layers is not None:
            config["num_hidden_layers"] = layers
    train: dict = {
        "max_seq_len": args.seq if gpu else 128,
        "micro_batch_size": args.micro if run == "lora72b" else 1,
        "gradient_accumulation_steps": 1,
        "max_steps": args.steps or (8 if run == "lora72b" else 3),
        "learning_rate": 1.0e-4,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "save": False,
        "gradient_checkpointing": gpu,
        "precision": "bf16" if gpu else "fp32",
    }
    zero: dict = {"stage": 3, "offload": "none"}
    if run == "lora72b":
        train["method"] = "lora"
    else:
        zero.update(offload="nvme", nvme_path=str(Path(args.nvme_dir).resolve()))
    return {
        "name": f"bench-{run}",
        "accelerator": accelerator,
        "runtime": "process",
        "model": {
            "name_or_path": f"{run}-shape",
            "init": "random",
            "tokenizer": "builtin:byte-level",
            "config": config,
        },
        "data": {"path": "synthetic:random"},
        "train": train,
        "zero": zero,
        "launch": {
            "python": sys.executable,
            "remote_dir": str(workdir / "remote"),
            "master_port": args.port,
            "env": {"OMP_NUM_THREADS": "1"} if not gpu else {},
        },
    }


def gpu_mem_gib() -> float | None:
    """What ``dzctl launch`` reads: nvidia-smi memory.total / 1024."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        return round(float(out.split()[0]) / 1024, 1)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def host_mem_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    raise SystemExit("no MemTotal in /proc/meminfo")


def plan(spec: dict, workdir: Path, nproc: int, gpu_gib: float | None, nvme_reading=None):
    """The planner on this job, with what launch's preflight would read here."""
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.memory.fromjob import plan_for_job
    from orchestrator.spec.job import load_job

    job_file = workdir / "job.yaml"
    job_file.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    job = load_job(job_file)
    return plan_for_job(read_inputs(job), [nproc], gpu_mem_gib=gpu_gib, host_mem_gib=host_mem_gib(), nvme=nvme_reading)


def probe_disk(path: Path):
    """Preflight's own NVMe probe (direct I/O), run here; the planner's reading."""
    from orchestrator.planning.memory.estimate import NvmeReading
    from orchestrator.preflight.nvme import probe
    from orchestrator.transport.local import LocalConnection

    path.mkdir(parents=True, exist_ok=True)
    found = probe(LocalConnection(), sys.executable, str(path))
    if getattr(found, "problem", "x") is not None:
        raise SystemExit(f"{path}: NVMe probe failed: {found}")
    return found, NvmeReading(found.free_bytes, found.read_bytes_per_s, found.write_bytes_per_s)


def choose_nvme_layers(args, workdir: Path, accelerator: str, gpu_gib, reading) -> tuple[int | None, dict, object]:
    """The most Qwen3-8B layers whose NVMe bytes fit the disk and whose predicted steps fit the time budget."""
    tried = []
    fallback = None  # the smallest layer count that fits the disk, if none fits the time budget
    for layers in NVME_LAYER_CHOICES if accelerator == "gpu" and args.model == "real" else (None,):
        spec = spec_for("nvme8b", args, accelerator, workdir, layers)
        memory_plan, ds_config = plan(spec, workdir, args.nproc, gpu_gib, reading)
        nvme = memory_plan.to_dict(None)["nvme"] or {}
        need = nvme.get("per_node_gib", 0) * 2**30
        io_s = memory_plan.nvme_step_s or 0.0
        steps = spec["train"]["max_steps"]
        # Start-up writes every partition once; then each step reads and writes its share.
        predicted_run_s = io_s * (steps + 1)
        ok = memory_plan.fits and need <= NVME_DISK_SHARE * reading.free_bytes and predicted_run_s <= args.nvme_budget_s
        tried.append(
            {"layers": layers, "disk_gib": nvme.get("per_node_gib"), "io_s_per_step": round(io_s, 1), "ok": ok}
        )
        if ok:
            return layers, {"tried": tried}, (spec, memory_plan, ds_config)
        if memory_plan.fits and need <= NVME_DISK_SHARE * reading.free_bytes:
            fallback = (layers, spec, memory_plan, ds_config)
    if fallback is not None:
        # The disk is too slow for the time budget at every size: run the smallest that fits, 2 steps, and say so.
        layers, spec, memory_plan, ds_config = fallback
        spec["train"]["max_steps"] = 2
        return layers, {"tried": tried, "over_time_budget": True}, (spec, memory_plan, ds_config)
    return None, {"tried": tried}, None


def dzctl(*argv: str, env: dict, timeout: float) -> tuple[int | str, str, str]:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return "timeout", out, err


def run_direct(spec: dict, ds_config: dict, memory_plan, workdir: Path, args, env: dict, timeout: float) -> str:
    """The same planned job through torchrun, for a machine where launch refused before starting."""
    resolved = memory_plan.resolved()
    spec = json.loads(json.dumps(spec))
    spec["train"].update(micro_batch_size=resolved.micro_batch_size, precision=resolved.precision)
    spec["train"]["gradient_checkpointing"] = resolved.gradient_checkpointing
    direct = workdir / "direct"
    direct.mkdir(parents=True, exist_ok=True)
    (direct / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    (direct / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n", encoding="utf-8")
    output = workdir / "remote" / "output" / spec["name"]
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        "--master_port", str(args.port), "-m", "orchestrator.train", str(direct / "job.yaml"),
        "--output-dir", str(output),
    ]  # fmt: skip
    return run_bounded(argv, env, timeout)


def run_bounded(argv: list[str], env: dict, timeout: float) -> str:
    """Run in its own process group; past ``timeout`` the whole group (torchrun and its ranks) is ended."""
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            text = proc.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text = proc.communicate()[0]
        return (text or "") + f"\ntimed out after {timeout:.0f} s"


def measure(events: list[dict], spec: dict, nproc: int, warmup: int) -> dict:
    end = next((e for e in events if e["event"] == "end"), None)
    steps = [e for e in events if e["event"] == "step"]
    error = next((e.get("reason") for e in events if e["event"] == "error"), None)
    out: dict = {"steps_done": len(steps), "losses": [e.get("loss") for e in steps]}
    if end is None:
        out["error"] = error or "no end event"
        times = [e.get("step_time_s") for e in steps if e.get("step_time_s")]
    else:
        times = end["step_times_s"]
        peaks = end.get("gpu_mem_peak_gib_per_rank") or []
        out.update(peak_allocated_gib=[p[0] for p in peaks], peak_reserved_gib=[p[1] for p in peaks])
    if times:
        measured = times[warmup:] or times
        median = statistics.median(measured)
        train = spec["train"]
        tokens = train["micro_batch_size"] * train["max_seq_len"] * train["gradient_accumulation_steps"]
        out.update(step_times_s=times, median_step_s=round(median, 3), tokens_per_s_per_gpu=round(tokens / median, 1))
    return out


def run_one(name: str, args, accelerator: str, gpu_gib, env: dict, log) -> dict:
    workdir = Path(args.work) / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    result: dict = {"run": name, "nproc": args.nproc}
    if name == "nvme8b":
        nvme_dir = Path(args.nvme_dir)
        shutil.rmtree(nvme_dir, ignore_errors=True)
        found, reading = probe_disk(nvme_dir)
        result["disk"] = {
            "path": str(nvme_dir),
            "free_gib": round(found.free_bytes / 2**30, 1),
            "direct_write_mib_s": round(found.write_bytes_per_s / 2**20, 1),
            "direct_read_mib_s": round(found.read_bytes_per_s / 2**20, 1),
        }
        _, why, chosen = choose_nvme_layers(args, workdir, accelerator, gpu_gib, reading)
        result["layer_choice"] = why
        if chosen is None:
            result["error"] = "no layer count fits the disk and the time budget (see layer_choice)"
            return result
        spec, memory_plan, ds_config = chosen
        result["layers"] = spec["model"]["config"]["num_hidden_layers"]
        result["predicted_io_s_per_step"] = round(memory_plan.nvme_step_s or 0.0, 2)
        result["nvme_plan"] = memory_plan.to_dict(None)["nvme"]
    else:
        spec = spec_for(name, args, accelerator, workdir)
        memory_plan, ds_config = plan(spec, workdir, args.nproc, gpu_gib)
        result["layers"] = spec["model"]["config"]["num_hidden_layers"]
    result["fits"] = memory_plan.fits
    result["predicted_peak_gib"] = round(memory_plan.estimate.gpu_peak / 2**30, 2)
    result["predicted_gpu_terms_gib"] = {k: round(v / 2**30, 2) for k, v in memory_plan.estimate.gpu_terms.items()}
    result["trainable_params"] = memory_plan.estimate.trainable_params
    result["plan_reason"] = memory_plan.reason or None
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    started = time.monotonic()
    argv = ["launch", str(job), "--hosts", str(args.hosts), "--runtime", "process", "--follow", "--json"]
    budget = args.lora_budget_s if name == "lora72b" else args.nvme_budget_s + args.startup_s
    code, stdout, stderr = dzctl(*argv, env=env, timeout=budget)
    if code == "timeout":
        dzctl("stop", spec["name"], env=env, timeout=60)
    result.update(launch_exit_code=code, launch_wall_s=round(time.monotonic() - started, 1))
    log.write(f"===== {name}: dzctl {' '.join(argv)}\n{stderr[-20000:]}\n{stdout[-5000:]}\n")
    log.flush()
    progress = workdir / "remote" / "output" / spec["name"] / "progress.jsonl"
    if code not in (0, "timeout") and not progress.exists() and ds_config is not None:
        result["ran_via"] = "torchrun: dzctl launch refused: " + " / ".join(stderr.strip().splitlines()[-2:])
        remaining = max(60.0, budget - (time.monotonic() - started))
        text = run_direct(spec, ds_config, memory_plan, workdir, args, env, remaining)
        log.write(f"===== {name} (direct)\n{text[-20000:]}\n")
        log.flush()
    events = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()] if progress.exists() else []
    result.update(measure(events, spec, args.nproc, warmup=2 if name == "lora72b" else 1))
    if "error" in result and code != 0:
        result["launch_error"] = stderr.strip().splitlines()[-3:]
    peaks = result.get("peak_allocated_gib") or []
    if peaks:
        result["peak_error_vs_predicted"] = round(max(peaks) / result["predicted_peak_gib"] - 1, 3)
    if name == "nvme8b":
        shutil.rmtree(args.nvme_dir, ignore_errors=True)  # the swap files: tens of GB
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| run | layers | tokens/s/GPU | median step s | predicted peak GiB | measured peak alloc GiB per GPU | "
        "predicted NVMe I/O s/step | notes |",
        "|" + "---|" * 8,
    ]
    for r in results:
        peaks = ", ".join(f"{p:.1f}" for p in r.get("peak_allocated_gib") or []) or "-"
        notes = r.get("error", "") + (f" ran via {r['ran_via']}" if r.get("ran_via") else "")
        lines.append(
            f"| {r['run']} | {r.get('layers')} | {r.get('tokens_per_s_per_gpu', '-')} | "
            f"{r.get('median_step_s', '-')} | "
            f"{r.get('predicted_peak_gib', '-')} | {peaks} | {r.get('predicted_io_s_per_step', '-')} | {notes} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", metavar="RUN", help="lora72b and/or nvme8b (default: both)")
    parser.add_argument("--model", default="real", choices=["real", "tiny"], help="tiny: the CPU smoke run")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=2, help="micro-batch of the LoRA run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--out", default="benchmarks/results/latest")
    parser.add_argument("--work", default="/tmp/dzctl-lora-bench")
    parser.add_argument("--nvme-dir", default="/tmp/dzctl-lora-bench-nvme", help="a folder on the local disk")
    parser.add_argument("--lora-budget-s", type=float, default=220.0, help="wall-clock limit of the LoRA launch")
    parser.add_argument("--nvme-budget-s", type=float, default=80.0, help="predicted disk I/O the NVMe run may take")
    parser.add_argument("--startup-s", type=float, default=170.0, help="added to the NVMe run's limit")
    args = parser.parse_args()
    args.runs = args.runs or ["lora72b", "nvme8b"]
    if set(args.runs) - {"lora72b", "nvme8b"}:
        parser.error(f"unknown run in {args.runs}: lora72b, nvme8b")
    import torch

    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator == "cpu":
        args.model = "tiny"
    gpu_gib = gpu_mem_gib() if accelerator == "gpu" else None
    args.hosts = HOSTS  # slots=2
    if args.nproc != 2:  # another GPU count: this machine alone, --nproc ranks
        args.hosts = Path(args.work) / f"localhost-{args.nproc}.txt"
        args.hosts.parent.mkdir(parents=True, exist_ok=True)
        args.hosts.write_text(f"localhost slots={args.nproc}\n", encoding="utf-8")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("DZCTL_HOME", str(Path(args.work) / "dzctl-home"))  # job records away from ~
    results = []
    with open(out / "lora_nvme_runs.log", "w", encoding="utf-8") as log:
        for name in args.runs:
            result = run_one(name, args, accelerator, gpu_gib, env, log)
            results.append(result)
            (out / f"lora_nvme_{name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
            print(json.dumps(result), flush=True)
    text = table(results)
    (out / "lora_nvme_table.md").write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
