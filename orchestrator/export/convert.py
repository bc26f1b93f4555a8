"""Run the consolidation (``python -m orchestrator.train.export``) as its own process, and read its answer.

torch, DeepSpeed, transformers and PEFT stay out of the controller's own process
(``docs/architecture.md``); the controller needs them installed (``pip install
'.[train]'``) only to export. The child prints JSON lines: progress events, then its
result or its error (``{"error", "fix", "exit_code"}``), which becomes the same
``DzError`` here. Anything else it prints (DeepSpeed's and transformers' own notes) is
kept for ``--debug`` and for a failure's message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import InputError, RuntimeFailure
from .plan import ExportPlan

NEEDED = ("torch", "deepspeed", "transformers", "safetensors")


def require_train_extra(plan_method: str) -> None:
    """Refuse before any host is asked when this Python cannot consolidate (the ``train`` extra)."""
    needed = [*NEEDED, "peft"] if plan_method == "lora" else list(NEEDED)
    # find_spec looks without importing: the controller's process stays torch-free.
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(
            f"dzctl export consolidates the shards here, with {', '.join(missing)}, which this Python "
            f"({sys.executable}) lacks",
            fix="pip install '.[train]' in the clone dzctl runs from (the CPU build of torch is enough)",
        )


def request_for(plan: ExportPlan, checkpoint_dir: Path, out: Path, base: str | None = None) -> dict:
    return {
        "base": base or plan.base,
        "checkpoint_dir": str(checkpoint_dir),
        "tag": plan.tag,
        "out": str(out),
        "method": plan.method,
        "adapter": plan.adapter,
        "dtype": plan.dtype,
    }


def consolidate(request: dict, work: Path, on_event: Callable[[dict], None], on_line: Callable[[str], None]) -> dict:
    """Run the child on ``request``; its result, or the DzError it reported."""
    path = work / "request.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    # DeepSpeed on the CPU: the controller has no GPU to look for (and needs none).
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    child = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.train.export", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    last: dict | None = None
    other: list[str] = []
    assert child.stdout is not None
    for line in child.stdout:
        event = _json(line)
        if event is None:
            other.append(line.rstrip())
            on_line(line.rstrip())
            continue
        if "error" in event or event.get("event") == "result":
            last = event
        else:
            on_event(event)
    code = child.wait()
    if last is not None and "error" in last:
        kind = InputError if last.get("exit_code") == 2 else RuntimeFailure
        raise kind(str(last["error"]), fix=last.get("fix"))
    if code != 0 or last is None:
        tail = " | ".join(x for x in other[-5:] if x.strip())
        raise RuntimeFailure(
            f"consolidating the checkpoint failed (exit {code}): {tail}",
            fix="run again with --debug to see its whole output",
        )
    return last


def _json(line: str) -> dict | None:
    text = line.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) and ("event" in value or "error" in value) else None
