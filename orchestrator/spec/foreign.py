"""Another tool's training YAML as the job: which tool wrote it (``detect``), and the dzctl job it becomes.

``spec/job.py::load_job`` converts a LLaMA-Factory or axolotl YAML before validation (``--set``
applies after), so ``dzctl launch FILE``, ``plan``, ``preflight`` and ``--dry-run`` take it as it
is; ``dzctl convert FILE`` prints the job and the table of every key (commands/convert.py). Each
tool's key map is its own module (``llamafactory``, ``axolotl``); the rows and the builder they
share are in ``keymap``. No key that changes training is dropped silently: a key neither map knows
is refused, not ignored. Pure: no file is read here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import SpecError
from . import axolotl, llamafactory
from .keymap import Builder, Conversion, KeyRow, job_name
from .yamlsource import LineMap

# The keys a dzctl job has at its top: a YAML holding any of them as a section is dzctl's own.
DZCTL_SECTIONS = ("model", "data", "train", "zero", "launch")
# What LLaMA-Factory and axolotl write and dzctl never does (and each other rarely): two of them name the tool.
MARKERS: dict[str, frozenset[str]] = {
    "LLaMA-Factory": frozenset(
        {
            "model_name_or_path",
            "finetuning_type",
            "cutoff_len",
            "per_device_train_batch_size",
            "stage",
            "dataset",
            "template",
            "num_train_epochs",
            "lr_scheduler_type",
            "lora_target",
            "lora_rank",
        }
    ),
    "axolotl": frozenset(
        {
            "base_model",
            "datasets",
            "sequence_len",
            "micro_batch_size",
            "adapter",
            "num_epochs",
            "lora_r",
            "val_set_size",
            "chat_template",
            "sample_packing",
            "lora_target_linear",
        }
    ),
}
# --- recognising and converting -------------------------------------------------------------------


def detect(data: Any) -> str | None:
    """The tool that wrote ``data`` (a YAML mapping), or None for a dzctl job (or anything else)."""
    if not isinstance(data, dict) or any(isinstance(data.get(key), dict) for key in DZCTL_SECTIONS):
        return None
    keys = {str(key) for key in data}
    scores = {tool: len(keys & markers) for tool, markers in MARKERS.items()}
    tool, score = max(scores.items(), key=lambda item: item[1])
    if score < 2 or list(scores.values()).count(score) > 1:
        return None
    return tool


def convert(data: dict[str, Any], lines: LineMap, path: Path) -> Conversion:
    """The dzctl job ``data`` becomes, and a row for every key (``detect`` said which tool)."""
    tool = detect(data)
    converters: dict[str, Callable[[Builder, Path], None]] = {
        "LLaMA-Factory": llamafactory.convert,
        "axolotl": axolotl.convert,
    }
    if tool is None:
        raise ValueError("not a LLaMA-Factory or axolotl YAML")
    builder = Builder(tool, lines.source, data, lines)
    builder.default("name", job_name(path), "dzctl names every job; taken from the file name (--set name=...)")
    builder.default("runtime", "docker", "dzctl's default: one container per node (--runtime process: none)")
    converters[tool](builder, path)
    builder.rows.sort(key=lambda row: (row.line is None, row.line or 0))
    return builder.conversion()


def refusal_error(conversion: Conversion, refused: list[KeyRow]) -> SpecError:
    """One error line per refused key, at its line in the user's file."""
    lines = [
        f"{conversion.source}:{row.line}: {row.key}: {row.reason}"
        if row.line
        else f"{conversion.source}: {row.key}: {row.reason}"
        for row in refused
    ]
    lines.insert(0, f"{conversion.source} is a {conversion.tool} YAML; {len(refused)} of its keys cannot be run:")
    lifted = sorted({row.lifted_by for row in refused if row.lifted_by})
    fix = "remove those keys, or give the dzctl key with --set" + (f" ({', '.join(lifted)})" if lifted else "")
    return SpecError("\n".join(lines), fix=fix + f"; `dzctl convert {conversion.source}` shows every key")
