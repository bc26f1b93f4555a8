"""The launch-time speed prediction against the measured rate, for every launch of steady-benchmark folders.

Issue 30's one-GPU check: ``dzctl launch`` keeps its step-time prediction with the job (``plan.speed``),
and ``status --json`` prints it. ``useful_tokens_h200.py`` writes that status line into each launch's
``runs.log`` and the measured rate into ``summary.json``; this sets the two side by side.

    python3 benchmarks/speed_vs_measured.py benchmarks/results/steady-h200x1-20261204-g32 ...

Anywhere (reads recorded files only). Prints one row per launch and how many are within ±15 %.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOLERANCE = 0.15


def predicted_speed(runs_log: Path) -> dict | None:
    """The last ``speed`` object of a status line in the launch's log (None before launches kept one)."""
    speed = None
    for line in runs_log.read_text(encoding="utf-8").splitlines():
        if line.startswith("{") and '"speed"' in line:
            try:
                speed = json.loads(line).get("speed") or speed
            except json.JSONDecodeError:
                continue
    return speed


def rows(folder: Path) -> list[dict]:
    found = []
    for summary in sorted(folder.glob("*/summary.json")):
        result = json.loads(summary.read_text(encoding="utf-8"))["results"][0]
        log = summary.parent / "runs.log"
        speed = predicted_speed(log) if log.exists() else None
        if "error" in result or not speed or not speed.get("predicted"):
            continue
        plan = result["plan"]
        found.append(
            {
                "folder": folder.name, "run": summary.parent.name,
                "plan": f"micro {plan['micro_batch_size']} × {plan['ds_config']['gradient_accumulation_steps']}, "
                f"{plan['checkpointed_layers']}/{plan['decoder_layers']} ckpt",
                "predicted": speed["tokens_per_s_per_gpu"], "mfu_used": speed["mfu"],
                "measured": result["processed_tokens_per_s_per_gpu"], "measured_mfu": result["mfu"],
            }
        )  # fmt: skip
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args()
    table = [r for folder in args.folders for r in rows(folder)]
    print("| folder | run | plan | predicted tok/s/GPU (MFU used) | measured tok/s/GPU (MFU) | predicted vs measured |")
    print("|---|---|---|---|---|---|")
    for r in table:
        error = r["predicted"] / r["measured"] - 1
        print(
            f"| {r['folder']} | {r['run']} | {r['plan']} | {r['predicted']:,.0f} ({100 * r['mfu_used']:.1f}%) | "
            f"{r['measured']:,.0f} ({100 * r['measured_mfu']:.1f}%) | {100 * error:+.1f}% |"
        )
    within = sum(abs(r["predicted"] / r["measured"] - 1) <= TOLERANCE for r in table)
    print(f"\n{within} of {len(table)} launches predicted within ±{100 * TOLERANCE:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
