"""A preference stage's data at scale (issue 44): the node's cache build, and each rank's memory when it maps it.

For each size (default 10k, 100k, 1M rows) a JSONL file of DPO pairs in LLaMA-Factory's sharegpt
ranking layout is written by ``dpo_data.py``'s generator (prompt median 200 bytes, each answer
median 400, log-normal; with the ``builtin:byte-level`` tokenizer a byte is a token), and:

- **build**: one process, local rank 0 of a launch, runs ``stage.load_data`` on an empty cache
  folder: the key, the pooled encoding (one worker per core), the Arrow files, the manifest's
  hashes. Recorded: wall seconds, the process's peak RSS (``ru_maxrss``) and its workers' (the
  largest of them: ``RUSAGE_CHILDREN``), the cache's bytes on disk.
- **map**: a second process of the same launch (local rank 1) once the cache is built, as every
  other rank: its RSS split into private (``RssAnon``) and file-backed pages (``RssFile``: the
  page cache's, shared by every rank of the node) after mapping, after one micro-batch of 8
  rows, and after reading every row's ids once in Arrow batches.
- **today** (up to ``--today-max-rows``): the in-memory path every rank ran before (``encode_job``
  then ``Dataset.from_list``), one process: wall seconds and peak RSS.

The machine's cores are shared with other work: times are upper bounds. Run:

    .venv/bin/python benchmarks/preference_cache_scale.py --out benchmarks/results/preference-cache-YYYYMMDD
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from dpo_data import length, words  # noqa: E402

RANK = r"""
import json, os, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[5])
from orchestrator.spec.job import load_job
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer
from orchestrator.train.preference import encode, stage
import pyarrow.compute as pc

def memory():
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = lambda key: int(status[key].split()[0])
    return {"rss_mib": kib("VmRSS") / 1024, "anon_mib": kib("RssAnon") / 1024, "file_mib": kib("RssFile") / 1024}

job, output, local_rank, mode = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
loaded = load_job(job, [])
tokenizer = build_byte_level_tokenizer()
ranks = type("Ranks", (), {"rank": local_rank, "local_rank": local_rank, "world_size": 2})()
out = {"before": memory()}
started = time.perf_counter()
if mode == "today":
    from datasets import Dataset
    examples = encode.encode_job(loaded, tokenizer).examples
    data = Dataset.from_list(examples)
    out["seconds"] = time.perf_counter() - started
    out["rows"] = len(data)
else:
    train, _ = stage.load_data(loaded, tokenizer, ranks, output)
    out["seconds"] = time.perf_counter() - started
    out["rows"] = len(train)
    out["mapped"] = memory()
    if mode == "map":
        train[:8]
        out["one_batch"] = memory()
        tokens = checksum = 0
        for batch in train.with_format("arrow").iter(batch_size=8192):
            for column in batch.columns:
                for chunk in column.chunks:
                    ids = chunk.flatten()
                    checksum += pc.sum(ids).as_py() or 0  # every id read: each page of the file touched
                    tokens += len(ids)
        out["tokens"] = tokens
        out["all_rows_read"] = memory()
        out["read_s"] = time.perf_counter() - started - out["seconds"]
out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out["workers_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print("RESULT " + json.dumps(out))
"""


def job_text(data: Path) -> str:
    """jobs/tiny-cpu.yaml on the pairs: train.stage dpo at max_seq_len 2048."""
    text = (ROOT / "jobs" / "tiny-cpu.yaml").read_text(encoding="utf-8")
    text = text.replace(
        "  path: data/tiny-alpaca-zh.jsonl\n  format: alpaca\n", f"  path: {data}\n  format: sharegpt\n"
    )
    text = text.replace("max_position_embeddings: 512", "max_position_embeddings: 4096")
    return text.replace("  max_seq_len: 128\n", "  stage: dpo\n  max_seq_len: 2048\n")


def write_rows(path: Path, rows: int, seed: int = 44) -> None:
    """``dpo_data.py``'s pairs (its lengths: prompt median 200, answers 400, capped to fit 2048).

    The texts are slices at random places of 4 MiB of its pseudo-words (its ``words`` for every
    text would take 15 minutes at 1 M rows): every row is still its own (the content keys differ)."""
    rng = random.Random(seed)
    corpus = words(rng, 4 << 20)

    def text(size: int) -> str:
        start = rng.randrange(len(corpus) - size)
        return corpus[start : start + size]

    with path.open("w", encoding="utf-8") as out:
        for _ in range(rows):
            prompt = text(length(rng, 200, 512))
            room = 2048 - len(prompt) - 64
            row = {
                "conversations": [{"from": "human", "value": prompt}],
                "chosen": {"from": "gpt", "value": "Glad to help. " + text(length(rng, 400, room - 14))},
                "rejected": {"from": "gpt", "value": "No. " + text(length(rng, 400, room - 4))},
            }
            out.write(json.dumps(row) + "\n")


def run_rank(job: Path, output: Path, local_rank: int, mode: str) -> dict:
    """One rank process (a child of this one, so every rank of a size shares its launch token)."""
    argv = [sys.executable, "-c", RANK, str(job), str(output), str(local_rank), mode, str(ROOT)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"rank {local_rank} ({mode}) failed:\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines()[::-1] if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,100000,1000000")
    parser.add_argument("--today-max-rows", type=int, default=100_000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="dzctl-pref-scale-") as scratch:
        work = Path(scratch)
        for rows in [int(x) for x in args.rows.split(",")]:
            data, job, output = work / f"pairs-{rows}.jsonl", work / f"job-{rows}.yaml", work / f"out-{rows}"
            started = time.perf_counter()
            write_rows(data, rows)
            generate_s = time.perf_counter() - started
            job.write_text(job_text(data), encoding="utf-8")
            build = run_rank(job, output, 0, "build")
            mapped = run_rank(job, output, 1, "map")  # the builder's note is there: this rank maps its cache
            entry = {
                "rows": rows,
                "cores": len(os.sched_getaffinity(0)),
                "data_file_mib": round(data.stat().st_size / 2**20, 1),
                "generate_s": round(generate_s, 1),
                "build": build,
                "map": mapped,
                "cache_mib": round(folder_bytes(output / "data-cache") / 2**20, 1),
            }
            if rows <= args.today_max_rows:
                entry["today"] = run_rank(job, output, 0, "today")
            results.append(entry)
            print(json.dumps(entry), flush=True)
            data.unlink()
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    lines = ["| rows | build s | rows/s | builder peak RSS MiB | worker peak MiB | cache MiB | mapped rank private MiB "
             "(mapped / read all) | its file pages MiB (read all) | today's s | today's peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in results:
        today = e.get("today") or {}
        lines.append(
            f"| {e['rows']:,} | {e['build']['seconds']:.1f} | {e['rows'] / e['build']['seconds']:,.0f} "
            f"| {e['build']['peak_rss_mib']:,.0f} | {e['build']['workers_peak_rss_mib']:,.0f} | {e['cache_mib']:,.0f} "
            f"| {e['map']['mapped']['anon_mib']:,.0f} / {e['map']['all_rows_read']['anon_mib']:,.0f} "
            f"| {e['map']['all_rows_read']['file_mib']:,.0f} "
            f"| {today.get('seconds', math.nan):.1f} | {today.get('peak_rss_mib', math.nan):,.0f} |"
        )
    (args.out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
