"""Whether a job packs its examples into full rows: ``train.packing`` made concrete (pure, no torch).

``auto`` is on for GPU jobs with a data file, off on CPU (small test runs, exact
per-row behaviour) and for ``synthetic:random`` (its rows are already full); on everywhere for
``data.format: text`` (continued pretraining packs its documents, as LLaMA-Factory's pt stage does).
``dzctl launch`` writes the resolved value into the job file; a trainer started on
a job file by hand resolves it the same way. How rows are packed is the trainer's
(``orchestrator/train/data/packing.py``).
"""

from __future__ import annotations

from ..spec.job import SYNTHETIC_DATA, JobSpec


def resolve_packing(spec: JobSpec) -> bool:
    chosen = spec.train.packing
    if chosen != "auto":
        return bool(chosen)
    if spec.data.path != SYNTHETIC_DATA and all(s.format == "text" for s in spec.data.all_sources()):
        return True  # continued pretraining (data.format text): documents packed, as LLaMA-Factory's pt stage does
    return spec.accelerator == "gpu" and spec.data.path != SYNTHETIC_DATA
