"""Full fine-tuning's floor (``planning/speed/recompute.py::FULL_FLOOR_TOKENS``): its fit and its check, from the
committed raw outputs of one H100 80GB.

    python3 benchmarks/full_floor_fit.py > benchmarks/results/plans-h100x1-20261207e/full-floor-fit.txt

Fit set: ``dzctl tune --top 4`` of the 12-layer Qwen3-8B shape (``plans-h100x1-20261207d/tune-full12``). Each
candidate is re-planned by today's planner on one H100 with its own micro-batch and recomputed layers, once without
the floor. A candidate measured more than ``BAND`` below that prediction (beyond the model's error elsewhere) is
one the floor binds; each gives the floor its step implies, in token-times of the layer the floors are measured on:

    F_i = (predicted without floor / measured) · work_i / (1 + N_i / 2L)

and the fit is their mean. Check set: the launches of another call (``plans-h100x1-20261207e``: micro 1, micro 2
and the auto plan), predicted with the committed constant. Both sets are printed with and without the floor.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from plans_report import predicted  # noqa: E402

from orchestrator.planning.speed import recompute  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
FIT = RESULTS / "plans-h100x1-20261207d" / "tune-full12" / "tune.json"
CHECK = RESULTS / "plans-h100x1-20261207e"
LAYERS = 12
SEQ = 4096
NO_FLOOR = replace(recompute.FULL, floor_tokens=0.0)  # full fine-tuning's constants before the floor
BAND = 0.10  # the largest error of the model at micro-batches 4 and up on this card (+3.9 %, -2.2 %, +3.1 %)


def fit_points() -> list[dict]:
    """The tune's candidates as launch results that plans_report.predicted re-plans."""
    tuned = json.loads(FIT.read_text(encoding="utf-8"))
    return [
        {
            "name": f"tune-full12 rank {c['model_rank']}",
            "config": "auto",
            "overrides": ["train.global_batch_size=32"],
            "plan": {
                "micro_batch_size": c["micro_batch_size"],
                "checkpointed_layers": c["checkpointed_layers"],
                "zero": {"offload_optimizer": False, "offload_param": False},
            },
            "measured": c["tokens_per_s"],
        }
        for c in tuned["candidates"]
    ]


def check_points() -> list[dict]:
    points = []
    for name in ("full12-m1-1", "full12-m2-1", "full12-1"):
        result = json.loads((CHECK / name / "summary.json").read_text(encoding="utf-8"))["results"][0]
        # useful tokens/s: the processed rate too here (packed rows, no padding)
        points.append({**result, "name": name, "measured": result["useful_tokens_per_s_per_gpu"]})
    return points


def tokens_per_s(point: dict) -> float:
    plan, _ = predicted(point, None, "H100", layers=LAYERS)
    return plan.speed.step.tokens_per_s


def work(point: dict) -> float:
    """The micro-step's work in token-times without the floor: recompute.py's cost per token times the tokens."""
    micro, checkpointed = point["plan"]["micro_batch_size"], point["plan"]["checkpointed_layers"]
    return recompute.cost_per_token(micro, SEQ, checkpointed, LAYERS, NO_FLOOR) * micro * SEQ


def main() -> int:
    with_floor = recompute.FULL
    rows = []
    for label, points in (("fit", fit_points()), ("check", check_points())):
        for point in points:
            recompute.FULL = NO_FLOOR
            bare = tokens_per_s(point)
            recompute.FULL = with_floor
            floored = tokens_per_s(point)
            rows.append((label, point, bare, floored))
    recompute.FULL = with_floor
    implied = []
    print(f"full fine-tuning, {LAYERS} layers of Qwen3-8B, seq {SEQ}, one H100 80GB (predicted: today's planner)")
    print(
        "| set | launch | micro | recomputed | measured tokens/s | predicted, no floor | predicted, floor | F implied |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, point, bare, floored in rows:
        measured = point["measured"]
        binds = measured < bare / (1 + BAND)
        checkpointed = point["plan"]["checkpointed_layers"]
        floor_i = bare / measured * work(point) / (1 + checkpointed / (2 * LAYERS)) if binds else None
        if label == "fit" and floor_i is not None:
            implied.append(floor_i)
        print(
            f"| {label} | {point['name']} | {point['plan']['micro_batch_size']} | {checkpointed} | {measured:,.0f} | "
            f"{bare:,.0f} ({bare / measured - 1:+.1%}) | {floored:,.0f} ({floored / measured - 1:+.1%}) | "
            f"{f'{floor_i:,.0f}' if floor_i else '-'} |"
        )
    fitted = sum(implied) / len(implied)
    print(f"floor fitted on the fit set's binding points ({len(implied)}): {fitted:,.0f} token-times; "
          f"committed FULL_FLOOR_TOKENS {recompute.FULL_FLOOR_TOKENS:,.0f}")  # fmt: skip
    checks = [floored / point["measured"] - 1 for label, point, _, floored in rows if label == "check"]
    print(f"check set with the floor: worst {max(checks, key=abs):+.1%} ({len(checks)} launches)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
