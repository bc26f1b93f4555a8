"""The offloaded optimizer's host step against the launches: fit its one constant on one card, check on the other.

    python3 benchmarks/offload_fit.py

The launches: the 18-layer Qwen3-8B shape with the optimizer offloaded, through ``dzctl launch``: on one H100
the auto plans of 2026-12-06 (``plans-h100x1-20261206/off-auto-3``: micro 8 x 4, 7 recomputed) and 2026-12-07
(``plans-h100x1-20261207c/off-auto-1``: micro 4 x 8, none recomputed) and the same job with DeepSpeed's partial
offload (``off-ratio-1``: ratio 0.5, sub_group_size 5e8); on one H200 the same job with ``zero.offload=optimizer``
forced (``plans-h200x1-20261207/off-auto-1``; its states fit, the offloaded step is measured all the same). Each is
re-predicted by today's step-time model on its own plan and with the host rates its own preflight measured
(the ``host AdamW`` note of its launch log), and compared with its measured step (the median of steps 4-7).

The model's host step (planning/speed/offload.py) is the AdamW over the node's partitions at the measured
rate, the weights' upload, and ``HOST_OTHER_PASSES`` more AdamW-equivalents for the rest of DeepSpeed's host
work (the fp32 gradient buffer, the norm and the clipping over it, the 16-bit weights written for the upload);
the gradients' trips of each micro-step run beside the backward. This script prints, per launch, the step
without that constant, the seconds it leaves unexplained, and the constant each launch alone implies; then the
constant fitted on each card (the median of its launches) and every launch of the other card predicted with it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

LAUNCHES = (  # (card, folder of the launch)
    ("H200", "benchmarks/results/plans-h200x1-20261207/off-auto-1"),
    ("H100", "benchmarks/results/plans-h100x1-20261206/off-auto-3"),
    ("H100", "benchmarks/results/plans-h100x1-20261207c/off-auto-1"),
    ("H100", "benchmarks/results/plans-h100x1-20261207c/off-ratio-1"),
)
RATE = re.compile(
    r"host AdamW ([0-9.]+) G params/s(?:, copy up ([0-9.]+) GB/s|, copies ([0-9.]+) GB/s up and ([0-9.]+) down)?"
)


def preflight_host(runs_log: str):
    """The host rates the launch's own preflight measured, as the planner read them."""
    from orchestrator.planning.speed.offload import HostOptimizer

    found = RATE.search(runs_log)
    if found is None:
        raise SystemExit("no 'host AdamW' note in the launch log")
    adam, up_only, up, down = found.groups()
    up_gb = float(up or up_only) if (up or up_only) else None
    return HostOptimizer(
        float(adam) * 1e9,
        up_gb * 1e9 if up_gb else None,
        "the launch's preflight",
        float(down) * 1e9 if down else None,
    )


def without_other_passes(card: str, folder: str) -> dict:
    """One launch re-predicted without ``HOST_OTHER_PASSES``, and the host's AdamW seconds it is a multiple of.

    The step is linear in the constant (``offloaded_optimizer_seconds``: (1 + passes) x the AdamW's seconds), and
    the launch's micro-batch and recomputed layers are fixed, so the step without it is today's step less the
    constant's share."""
    from plans_report import predicted

    from orchestrator.planning.speed.offload import HOST_OTHER_PASSES

    path = REPO / folder
    result = json.loads((path / "summary.json").read_text(encoding="utf-8"))["results"][0]
    host = preflight_host((path / "runs.log").read_text(encoding="utf-8"))
    plan, step_s = predicted(result, host, card)
    on_host = plan.estimate.trainable_params - plan.estimate.optimizer_on_gpu  # one rank: the node's partition
    adam_s = on_host / host.adam_params_per_s
    return {
        "card": card, "folder": folder, "plan": plan, "host": host, "without_s": step_s - HOST_OTHER_PASSES * adam_s,
        "adam_s": adam_s, "measured_s": result["median_step_s"],
    }  # fmt: skip


def main() -> int:
    import statistics

    from orchestrator.planning.speed.offload import HOST_OTHER_PASSES

    rows = [without_other_passes(card, folder) for card, folder in LAUNCHES]
    for row in rows:
        plan, layers = row["plan"], row["plan"].estimate.num_layers
        row["implied"] = (row["measured_s"] - row["without_s"]) / row["adam_s"]
        partial = (
            f", {plan.estimate.optimizer_on_gpu / 1e9:.2f} G stepped on the GPU"
            if plan.estimate.optimizer_on_gpu
            else ""
        )
        print(
            f"{row['card']} ({row['folder']}): micro {plan.choice.micro_batch_size} x "
            f"{plan.gradient_accumulation_steps}, "
            f"{plan.choice.layers_checkpointed(layers)}/{layers} recomputed{partial}; {row['host'].describe()}"
        )
        print(
            f"  measured step {row['measured_s']:.2f} s; predicted without the other passes {row['without_s']:.2f} s "
            f"({row['measured_s'] / row['without_s'] - 1:+.1%} slower measured); unexplained "
            f"{row['measured_s'] - row['without_s']:.2f} s = {row['implied']:.2f} x the host AdamW's "
            f"{row['adam_s']:.2f} s"
        )
    print(f"HOST_OTHER_PASSES in planning/speed/offload.py: {HOST_OTHER_PASSES:.2f}")
    for fit_card, check_card in (("H200", "H100"), ("H100", "H200")):
        passes = statistics.median(r["implied"] for r in rows if r["card"] == fit_card)
        for row in (r for r in rows if r["card"] == check_card):
            step = row["without_s"] + passes * row["adam_s"]
            print(
                f"fit on {fit_card} ({passes:.2f} passes), check on {check_card} ({row['folder'].split('/')[-2]}/"
                f"{row['folder'].split('/')[-1]}): predicted {step:.2f} s against {row['measured_s']:.2f} s measured: "
                f"predicted tokens/s {row['measured_s'] / step - 1:+.1%} of the measured"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
