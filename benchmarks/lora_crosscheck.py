"""LoRA's recompute constants, fitted on one GPU kind and checked on the other's launches (issue 42).

    python3 benchmarks/lora_crosscheck.py

The planner's LoRA-by-layer constants (planning/speed/recompute.py): the H200's (rho 0.61, C 6,720) were fitted
on a raw ZeRO-3 grid on one H200 (fetchunit2-h200x1-20261204), the H100's (rho 0.37, C 2,030) on the same grid
on one H100 (plans-h100x1-20261207/recompute-lora-grid-lora.json). Neither grid is a dzctl launch. The check
sets are launches through ``dzctl launch`` of the LoRA r16 job (36 Qwen3-8B layers, SFT rows packed at 4,096,
global batch 32):

- on one H200: the four candidates of ``dzctl tune --top 4`` (plans-h200x1-20261207/tune-lora/tune.json);
- on one H100: the launch before issue 42's constants (micro 16, 33 of 36 recomputed) and after (micro 2,
  none), plans-h100x1-20261207/before-lora-1 and lora-2.

Each launch is re-predicted by today's step-time model on its own plan, once with each kind's constants. The
MFU both start from is the H200's 72.0 % at micro 4 with none recomputed (planning/speed/steptime.py): one H200
candidate is that very plan, so its row checks the anchor, not the constants. Predicted tokens/s are per GPU
of processed tokens times the run's packing efficiency (measured tokens/s are useful ones).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

H200_TUNE = REPO / "benchmarks/results/plans-h200x1-20261207/tune-lora"
H100_LAUNCHES = [REPO / "benchmarks/results/plans-h100x1-20261207" / name for name in ("before-lora-1", "lora-2")]
MICRO = re.compile(r"dzctl-train: 1 ranks, micro-batch (\d+), accumulation \d+, \w+, gradient checkpointing (\w+)")


def launches() -> list[tuple[str, str, dict, float, float]]:
    """(card, name, the result with the launch's own plan, measured tokens/s, packing efficiency)."""
    out = []
    summary = json.loads((H200_TUNE / "summary.json").read_text(encoding="utf-8"))["results"][0]
    tuned = json.loads((H200_TUNE / "tune.json").read_text(encoding="utf-8"))
    for c in tuned["candidates"]:
        plan = {**summary["plan"], "micro_batch_size": c["micro_batch_size"]}
        plan["checkpointed_layers"] = c["checkpointed_layers"]
        name = f"tune c{c['model_rank']}"
        out.append(("H200", name, {**summary, "plan": plan}, c["tokens_per_s"], 0.996))
    for folder in H100_LAUNCHES:
        result = json.loads((folder / "summary.json").read_text(encoding="utf-8"))["results"][0]
        micro, checkpointing = MICRO.search((folder / "runs.log").read_text(encoding="utf-8")).groups()
        plan = {**result["plan"], "micro_batch_size": int(micro)}
        if checkpointing == "False":
            plan["checkpointed_layers"] = 0  # else the launch's layers, as its offline plan made them
        out.append(("H100", folder.name, {**result, "plan": plan}, result["useful_tokens_per_s_per_gpu"],
                    result["data_packing_efficiency"]))  # fmt: skip
    return out


def main() -> int:
    from plans_report import predicted

    from orchestrator.planning.speed import recompute

    h100 = recompute.BY_KIND[("H100", "lora", "layer")]
    h200 = recompute.LORA_BY_LAYER
    print("| card | launch | plan | measured tokens/s | H200's constants | H100's constants |")
    print("|---|---|---|---|---|---|")
    worst = {}
    for card, name, result, measured, packing in launches():
        cells = []
        for fitted_on, costs in (("H200", h200), ("H100", h100)):
            recompute.BY_KIND[(card, "lora", "layer")] = costs  # this card planned with those constants
            plan, _ = predicted(result, None, card, layers=36)
            tokens = plan.speed.step.tokens_per_s * packing
            error = tokens / measured - 1
            cells.append(f"{tokens:,.0f} ({error:+.1%})")
            if fitted_on != card:
                worst[fitted_on] = max(worst.get(fitted_on, 0.0), abs(error))
        recompute.BY_KIND.pop(("H200", "lora", "layer"), None)
        recompute.BY_KIND[("H100", "lora", "layer")] = h100
        micro, ckpt = result["plan"]["micro_batch_size"], result["plan"]["checkpointed_layers"]
        print(f"| {card} | {name} | micro {micro}, {ckpt}/36 recomputed | {measured:,.0f} | {cells[0]} | {cells[1]} |")
    for fitted_on, error in worst.items():
        other = "H100" if fitted_on == "H200" else "H200"
        print(f"fitted on {fitted_on}, checked on the {other}'s launches: worst {error:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
