"""The offloaded optimizer's host step against two launches: fit its one constant on one card, check it on the other.

    python3 benchmarks/offload_fit.py

The launches: the auto offload plan of the 18-layer Qwen3-8B shape through ``dzctl launch`` on one H100
(``plans-h100x1-20261206/off-auto-3``) and the same job with ``zero.offload=optimizer`` forced on one H200
(``plans-h200x1-20261207/off-auto-1``; its states fit, the offloaded step is measured all the same). Each is
re-predicted by today's step-time model on its own plan and with the host rates its own preflight measured
(the ``host AdamW`` note of its launch log), and compared with its measured step (the median of steps 4-7).

The model's host step (planning/speed/offload.py) is the AdamW over the node's partitions at the measured
rate, the copies, and ``HOST_OTHER_PASSES`` more AdamW-equivalents for the rest of DeepSpeed's host work
(the fp32 gradient buffer, the norm and the clipping over it, the 16-bit weights written for the upload).
This script prints, per launch, the step without that term, the seconds it leaves unexplained, and the
constant each launch alone implies; then each launch predicted with the constant fitted on the other.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

LAUNCHES = (  # (card, folder of the launch) in the order: fit on the first, check on the second
    ("H100", "benchmarks/results/plans-h100x1-20261206/off-auto-3"),
    ("H200", "benchmarks/results/plans-h200x1-20261207/off-auto-1"),
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


def main() -> int:
    from plans_report import predicted

    from orchestrator.planning.speed.offload import HOST_OTHER_PASSES

    rows = []
    for card, folder in LAUNCHES:
        path = REPO / folder
        result = json.loads((path / "summary.json").read_text(encoding="utf-8"))["results"][0]
        host = preflight_host((path / "runs.log").read_text(encoding="utf-8"))
        plan, step_s = predicted(result, host, card)
        adam_s = plan.estimate.trainable_params / host.adam_params_per_s  # one rank: the node's partition
        without = step_s - HOST_OTHER_PASSES * adam_s
        measured = result["median_step_s"]
        rows.append((card, folder, plan, host, adam_s, without, measured))
        print(
            f"{card} ({folder}): micro {plan.choice.micro_batch_size} x {plan.gradient_accumulation_steps}, "
            f"{plan.choice.layers_checkpointed(plan.estimate.num_layers)}/{plan.estimate.num_layers} recomputed; "
            f"{host.describe()}"
        )
        print(
            f"  measured step {measured:.2f} s; predicted without the other passes {without:.2f} s "
            f"({measured / without - 1:+.1%} slower measured); unexplained {measured - without:.2f} s = "
            f"{(measured - without) / adam_s:.2f} x the AdamW's {adam_s:.2f} s"
        )
    print(f"HOST_OTHER_PASSES in planning/speed/offload.py: {HOST_OTHER_PASSES:.2f}")
    for fit, check in ((rows[0], rows[1]), (rows[1], rows[0])):
        passes = (fit[6] - fit[5]) / fit[4]
        card, _, _, _, adam_s, without, measured = check
        step = without + passes * adam_s
        print(
            f"fit on {fit[0]} ({passes:.2f} passes), check on {card}: predicted {step:.2f} s against {measured:.2f} s "
            f"measured: predicted tokens/s {measured / step - 1:+.1%} of the measured"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
