"""``progress.jsonl``: the one record of a run that ``dzctl status`` reads (no torch here).

One JSON object a line, appended and flushed at once so a reader on the host sees
each event as it happens, and printed to stdout too. Every event has all of
these keys (``null`` where a value does not apply, e.g. ``gpu_mem_peak_gib`` on
CPU): ``event`` (start|step|eval|checkpoint|end|error), ``time`` (Unix seconds),
``step``, ``max_steps``, ``epoch``, ``loss``, ``learning_rate``, ``tokens_per_s``
(the whole job: all ranks, real tokens, padding left out), ``samples_per_s`` (whole
job, examples), ``gpu_mem_peak_gib`` (this rank's ``max_memory_allocated``), ``eta_s``.
Extra keys: ``reason`` (one line, its fix included), ``message``, ``fix``, ``rank`` and
``exit_code`` (the rank's own) on ``error``, ``path`` on ``checkpoint`` and
``end`` (the consolidated model), ``already_complete`` on the ``end`` of a relaunch
that found its run finished and trained nothing, ``step_time_s`` on ``step``;
``processed_tokens_per_s`` (every position computed, padding included) and
``padding_efficiency`` (real / processed) on ``step`` and ``end``; ``packing`` and
``attention`` (the kernel, e.g. ``dzctl_packed/varlen`` or ``sdpa``) on ``start``;
``grad_norm`` (the global gradient norm before clipping, as HF logs it) on ``step``.
Evaluation (docs/evaluation.md): ``eval`` events carry ``eval_loss`` (per token, over
every eval row and rank), ``eval_tokens``, ``eval_rows``, ``best_eval_loss`` and
``best_step``, plus ``best_checkpoint`` when ``train.save_best`` keeps this step's
checkpoint and ``stopped_early: true`` on the eval that ends the run; ``checkpoint``
events ``best: true`` for that checkpoint; ``end`` the last ``eval_loss`` and
``eval_tokens``, ``best_eval_loss``, ``best_step``, ``stopped_early`` and
``best_checkpoint``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EVENTS = ("start", "step", "eval", "checkpoint", "end", "error")
KEYS = (
    "event",
    "time",
    "step",
    "max_steps",
    "epoch",
    "loss",
    "learning_rate",
    "tokens_per_s",
    "samples_per_s",
    "gpu_mem_peak_gib",
    "eta_s",
)


def make_event(event: str, **values: Any) -> dict[str, Any]:
    """An event with every contract key present, extra keys after them."""
    if event not in EVENTS:
        raise ValueError(f"unknown progress event {event!r}")
    record: dict[str, Any] = dict.fromkeys(KEYS)
    record["event"] = event
    record["time"] = round(time.time(), 3)
    if os.environ.get("DZCTL_JOB_ID"):
        # A relaunch appends to the same file: status keeps only its own job's lines.
        record["job_id"] = os.environ["DZCTL_JOB_ID"]
    record.update(values)
    return record


class ProgressLog:
    """Appends events to ``<output_dir>/progress.jsonl`` and echoes them to stdout."""

    def __init__(self, path: Path, *, echo: bool = True) -> None:
        self.path = path
        self.echo = echo

    def write(self, event: str, **values: Any) -> dict[str, Any]:
        record = make_event(event, **values)
        line = json.dumps(record, ensure_ascii=False, allow_nan=False, default=_plain)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write() of a whole line with O_APPEND: concurrent writers (an error
        # event from another rank) never interleave inside a line.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode("utf-8"))
        finally:
            os.close(fd)
        if self.echo:
            print(f"dzctl-progress {line}", file=sys.stdout, flush=True)
        return record


def _plain(value: Any) -> Any:
    # Tensors/NumPy scalars reach us from the Trainer's logs; JSON needs plain numbers.
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def finite(value: Any) -> float | None:
    """A float for JSON, or ``None`` for NaN/inf/missing (JSON has no NaN)."""
    if value is None:
        return None
    number = float(value)
    return number if number == number and abs(number) != float("inf") else None


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of a progress file (for tests and status)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
