"""Training data at scale: today's in-memory path against the per-node cache, 2 CPU ranks.

For each size (default 1k, 50k, 200k, 1M rows) a JSON array of alpaca rows is written
(log-normal lengths, median 500 / mean 700 characters of ASCII text: with the byte-level
tokenizer about 700 tokens a row once templated), and the trainer runs on it through
torchrun with 2 ranks: the tiny Qwen3-shaped model, ``max_steps`` 2, packing on at
``max_seq_len`` 4096, no saving. Each run records:

- ``first_step_s``: from starting torchrun to the first step event on its output;
- ``data_s``: from the trainer's line before the data (``loss ...``) to its ``data packed``
  line after it (both paths print both);
- each rank's peak private memory: ``Private_Clean + Private_Dirty`` of
  ``/proc/PID/smaps_rollup``, sampled every 0.2 s (pages of the mapped cache that other
  processes share are not private); and the builder's worker processes' peak (the
  ranks' children, summed, until the data is ready).

"today" is the trainer of ``--before`` (a git ref; default the commit before the cache),
checked out in a temporary worktree; "new" is this checkout's. Each path runs a first
launch and a relaunch on the same output folder (the new path's cache lives there);
today's path has no cache, so its relaunch repeats the first launch's work (run up to
``--today-relaunch-max-rows``). Rows of today's path above ``--today-max-rows`` are not
run (1 M rows would need about 14 GB per rank, two ranks more than this machine has).

``--storage-rows`` also compares the cache's storage: the same examples written as an
Arrow dataset (``datasets.Dataset.save_to_disk``, list<uint16> column) against the flat
NumPy memmaps, for write time, size and random reads of packed rows.

    python3 benchmarks/data_scale.py --out benchmarks/results/data-scale-YYYYMMDD
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_data  # noqa: E402

BEFORE = "1895551"  # main before the per-node cache: load_dataset reads, encodes and packs on every rank
GIB = 2**30

JOB = """\
name: data-scale
accelerator: cpu
runtime: process
model:
  name_or_path: tiny-qwen3
  init: random
  tokenizer: builtin:byte-level
  config: {{model_type: qwen3, vocab_size: 384, hidden_size: 64, intermediate_size: 192, num_hidden_layers: 2,
           num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, max_position_embeddings: 4096,
           tie_word_embeddings: false}}
data:
  path: {data}
  format: alpaca
train:
  max_seq_len: 4096
  micro_batch_size: 1
  max_steps: 2
  packing: true
  precision: fp32
  gradient_checkpointing: false
  learning_rate: 1.0e-3
  save: false
zero:
  offload: none
launch:
  env: {{OMP_NUM_THREADS: 1}}
"""


def write_rows(path: Path, rows: int, seed: int = 0) -> dict:
    """A JSON array of ``rows`` alpaca rows, written as a stream (fast: slices of one random text)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(sft_data.SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(200_000)]
    corpus = " ".join(words)
    lengths = sft_data.target_lengths(rows, seed)
    chars = 0
    with path.open("w", encoding="utf-8") as out:
        out.write("[\n")
        for number, total in enumerate(lengths):
            text = max(8, total - sft_data.TEMPLATE_TOKENS)
            prompt = max(4, round(text * rng.uniform(0.1, 0.5)))
            start = rng.randrange(0, len(corpus) - text - 1)
            row = {"instruction": corpus[start : start + prompt], "input": "",
                   "output": corpus[start + prompt : start + text]}  # fmt: skip
            out.write(("," if number else "") + json.dumps(row) + "\n")
            chars += text
        out.write("]\n")
    return {"rows": rows, "bytes": path.stat().st_size, "mean_chars": round(chars / rows, 1)}


def private_bytes(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = dict(re.findall(r"^(Private_Clean|Private_Dirty):\s+(\d+) kB", text, re.M))
    return (int(fields.get("Private_Clean", 0)) + int(fields.get("Private_Dirty", 0))) * 1024


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def local_rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


class Sampler(threading.Thread):
    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.peaks: dict[int, int] = {}  # local rank -> peak private bytes
        self.workers_peak = 0
        self.in_data = True  # the ranks' children count only until the data is ready (the builder's pool)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            workers_now = 0
            for pid in children(self.root):
                rank = local_rank_of(pid)
                if rank is None:
                    continue
                size = private_bytes(pid)
                if size is not None:
                    self.peaks[rank] = max(self.peaks.get(rank, 0), size)
                for worker in children(pid) if self.in_data else ():
                    workers_now += private_bytes(worker) or 0
            self.workers_peak = max(self.workers_peak, workers_now)
            self.stop.wait(0.2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_trainer(checkout: Path, job: Path, output: Path, log: Path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    argv += ["--master_port", str(free_port()), "-m", "orchestrator.train", str(job), "--output-dir", str(output)]
    marks: dict[str, float] = {}
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    with log.open("w", encoding="utf-8") as out:
        for line in proc.stdout:  # type: ignore[union-attr]
            now = time.monotonic() - started
            out.write(f"{now:9.2f} {line}")
            if "dzctl-train: loss " in line:
                marks.setdefault("before_data", now)
            elif "dzctl-train: data packed:" in line:
                marks.setdefault("data_ready", now)
                sampler.in_data = False
            elif '"event": "step"' in line:
                marks.setdefault("first_step", now)
            elif "dzctl-train: data: cached" in line:
                marks.setdefault("cached", now)
    code = proc.wait()
    sampler.stop.set()
    sampler.join()
    data_marked = {"data_ready", "before_data"} <= set(marks)
    return {
        "exit_code": code,
        "first_step_s": round(marks["first_step"], 2) if "first_step" in marks else None,
        "data_s": round(marks["data_ready"] - marks["before_data"], 2) if data_marked else None,
        "cached": "cached" in marks,
        "peak_private_gib": {str(r): round(b / GIB, 3) for r, b in sorted(sampler.peaks.items())},
        "builder_workers_peak_gib": round(sampler.workers_peak / GIB, 3),
        "wall_s": round(time.monotonic() - started, 2),
    }


def storage_probe(cache_folder: Path, reads: int = 2000) -> dict:
    """The same examples as Arrow (datasets) and as the flat memmaps: write, size, random packed-row reads."""
    import datasets
    import numpy as np
    import pyarrow as pa

    from orchestrator.train.data.mapped import MappedData

    data = MappedData(cache_folder)
    out: dict = {"examples": data.examples, "tokens": int(data.offsets[-1])}
    arrow_dir = cache_folder.parent / "arrow-probe"
    shutil.rmtree(arrow_dir, ignore_errors=True)
    started = time.perf_counter()
    values = pa.array(np.asarray(data.tokens), type=pa.uint16())
    column = pa.LargeListArray.from_arrays(pa.array(np.asarray(data.offsets), type=pa.int64()), values)
    datasets.Dataset(datasets.table.InMemoryTable(pa.table({"tokens": column}))).save_to_disk(str(arrow_dir))
    out["arrow_write_s"] = round(time.perf_counter() - started, 2)
    out["arrow_bytes"] = sum(p.stat().st_size for p in arrow_dir.rglob("*") if p.is_file())
    out["numpy_bytes"] = sum(p.stat().st_size for p in cache_folder.glob("*.bin"))
    arrow = datasets.load_from_disk(str(arrow_dir))
    rng = random.Random(0)
    rows = [rng.randrange(data.rows) for _ in range(reads)]
    started = time.perf_counter()
    for row in rows:
        data.packed_row(row)
    out["numpy_row_read_ms"] = round((time.perf_counter() - started) * 1000 / reads, 3)
    started = time.perf_counter()
    for row in rows:
        members = data.row_examples[data.row_offsets[row] : data.row_offsets[row + 1]].tolist()
        batch = arrow[members]["tokens"]
        [t for example in batch for t in example]
    out["arrow_row_read_ms"] = round((time.perf_counter() - started) * 1000 / reads, 3)
    shutil.rmtree(arrow_dir, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000,50000,200000,1000000")
    parser.add_argument("--paths", default="today,new")
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--today-max-rows", type=int, default=200_000)
    parser.add_argument("--today-relaunch-max-rows", type=int, default=50_000)
    parser.add_argument("--storage-rows", type=int, default=200_000)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, required=True, help="results prefix: writes OUT.json and OUT.txt")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    paths = args.paths.split(",")
    checkouts = {"new": ROOT}
    if "today" in paths:
        before = work / "before"
        if not before.exists():
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True
            )
        checkouts["today"] = before
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results: dict = {"machine": {"cpus": os.cpu_count(), "before": args.before, "new": commit}, "runs": []}
    lines = []

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        Path(f"{args.out}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")

    for rows in [int(r) for r in args.rows.split(",")]:
        data = work / f"alpaca-{rows}.json"
        exists = data.exists()
        described = {"rows": rows, "bytes": data.stat().st_size} if exists else write_rows(data, rows)
        job = work / f"job-{rows}.yaml"
        job.write_text(JOB.format(data=data), encoding="utf-8")
        for path in paths:
            if path == "today" and rows > args.today_max_rows:
                continue
            output = work / f"out-{path}-{rows}"
            shutil.rmtree(output, ignore_errors=True)
            launches = ["first", "relaunch"]
            if path == "today" and rows > args.today_relaunch_max_rows:
                launches = ["first"]
            for launch in launches:
                record = {"path": path, "rows": rows, "launch": launch, **described}
                record.update(run_trainer(checkouts[path], job, output, work / f"log-{path}-{rows}-{launch}.txt"))
                results["runs"].append(record)
                line = (
                    f"{path:5s} {rows:>9,} rows {launch:8s} exit {record['exit_code']} first step "
                    f"{record['first_step_s']} s, data {record['data_s']} s, peak private GiB per rank "
                    f"{record['peak_private_gib']}, builder workers {record['builder_workers_peak_gib']} GiB"
                    f"{', cached' if record['cached'] else ''}"
                )
                print(line, flush=True)
                lines.append(line)
                save()
            if path == "new" and rows == args.storage_rows:
                folder = next(p for p in (output / "data-cache").iterdir() if (p / "manifest.json").exists())
                results["storage"] = storage_probe(folder)
                line = f"storage at {rows:,} rows: {json.dumps(results['storage'])}"
                print(line, flush=True)
                lines.append(line)
                save()
            if path == "today" or rows != max(int(r) for r in args.rows.split(",")):
                shutil.rmtree(output, ignore_errors=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
