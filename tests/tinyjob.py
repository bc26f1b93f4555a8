"""The tiny CPU job (``jobs/tiny-cpu.yaml``) with another ``data:`` block, written and loaded (test helper)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.spec.job import LoadedJob, load_job

JOB = Path(__file__).resolve().parents[1] / "jobs" / "tiny-cpu.yaml"


def tiny_job_with_data(folder: Path, data: dict, *sets: str) -> LoadedJob:
    """``folder/job.yaml``: the tiny job, its ``data:`` block replaced by ``data``; loaded with ``sets``."""
    head, _, rest = JOB.read_text(encoding="utf-8").partition("data:\n")
    rest = rest[rest.index("train:") :]
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    job.write_text(head + "data: " + json.dumps(data) + "\n" + rest, encoding="utf-8")
    return load_job(job, list(sets))
