"""Jobs of Qwen3-8B's layer shapes with random weights, for the tests that plan them with ``dzctl plan`` (no GPU,
no download): the model section and the job file, written once here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY_ALPACA = {"path": str(ROOT / "jobs/data/tiny-alpaca-zh.jsonl"), "format": "alpaca"}


def qwen3_8b_shape(layers: int = 36) -> dict[str, Any]:
    """The job's model section: Qwen3-8B's layer sizes (benchmarks/zero3_h200.py), ``layers`` decoder layers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from zero3_h200 import MODELS

    return {
        "name_or_path": "qwen3-8b-shape",
        "init": "random",
        "config": {**MODELS["qwen3-8b"], "num_hidden_layers": layers},
    }


def write_shape_job(
    path: Path, name: str, train: dict[str, Any], *, layers: int, data: dict[str, Any] = TINY_ALPACA, **sections: Any
) -> Path:
    """``path``: a process-runtime job of the shape with ``train`` (and any other sections, e.g. ``zero``)."""
    spec = {"name": name, "runtime": "process", "model": qwen3_8b_shape(layers), "data": data, "train": train}
    path.write_text(yaml.safe_dump({**spec, **sections}, sort_keys=False), encoding="utf-8")
    return path
