"""The one-GPU speed prediction against the measured rate, for every committed one-H200 launch.

Issue 30's one-GPU check, two ways:
- ``--kept FOLDER...``: the prediction ``dzctl launch`` kept with the job (``plan.speed``) when it ran.
  ``status --json`` prints it; ``useful_tokens_h200.py`` writes that status line into each launch's
  ``runs.log`` and the measured rate into ``summary.json``.
- otherwise: today's model re-predicts every committed launch with its plan recorded
  (``ONE_GPU_FOLDERS``), as launch would (compute alone on one GPU, attention at seq_len), against the
  measured median optimizer step. In-sample: the model was fitted and revised on these launches, so the
  table is a regression guard (``tests/test_steptime.py`` asserts on the same rows), not a measure of
  accuracy; that takes launches left out of the fit (issue 42).

    python3 benchmarks/speed_vs_measured.py                  # today's model (anywhere: recorded files only)
    python3 benchmarks/speed_vs_measured.py --kept benchmarks/results/steady-h200x1-20261204-g32 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

TOLERANCE = 0.15
REPO = Path(__file__).resolve().parents[1]
# Every committed one-H200 launch with its plan recorded, and the zero.fetch_unit its launches ran with
# when they set none: before the key existed DeepSpeed's own (module); at 8459aaa the key's default was
# layer; since, auto (layer for LoRA, module for full fine-tuning). A launch's own --set wins.
ONE_GPU_FOLDERS = {
    "steady-h200x1-20261204": "module",
    "steady-h200x1-20261204-g32": "module",
    "fetchunit-h200x1-20261204": "layer",
    "speedcheck-h200x1-20261204": "module",
    "fetchunit2-h200x1-20261204": "auto",
}
SEQ = 4096


def one_h200_launches(results: Path) -> list[tuple[str, dict]]:
    """(name, result) of each launch: useful-tokens' full-row Liger runs, then the steady folders'."""
    summary = json.loads((results / "useful-tokens-h200x1-20261201/summary.json").read_text(encoding="utf-8"))
    found = [(f"useful-tokens-h200x1-20261201/{r['config']}", r) for r in summary["results"]]
    found = [(name, r) for name, r in found if r["config"] in ("synthetic", "auto")]  # 'today': no fused loss
    for folder, unit in ONE_GPU_FOLDERS.items():
        for path in sorted((results / folder).glob("*/summary.json")):
            result = json.loads(path.read_text(encoding="utf-8"))["results"][0]
            if "error" not in result:
                found.append((f"{folder}/{path.parent.name}", {**result, "default_fetch_unit": unit}))
    return found


class RecordedPlan(NamedTuple):
    """What a launch's summary recorded of its plan (the 20261201 runs predate the layer counts: 18, all or none)."""

    method: str
    micro: int
    accumulation: int
    checkpointed: int
    layers: int
    fetch_unit: str

    @classmethod
    def of(cls, run: dict) -> RecordedPlan:
        from orchestrator.planning.speed.fetchunit import resolve_fetch_unit

        plan = run["plan"]
        layers = plan.get("decoder_layers", 18)
        overrides = run.get("overrides", [])
        method = "lora" if "train.method=lora" in overrides else "full"
        unit = plan.get("fetch_unit") or next(
            (o.split("=", 1)[1] for o in overrides if o.startswith("zero.fetch_unit=")),
            run.get("default_fetch_unit", "module"),
        )
        return cls(
            method=method,
            micro=plan["micro_batch_size"],
            accumulation=plan.get("ds_config", {}).get("gradient_accumulation_steps", 1),
            checkpointed=plan.get("checkpointed_layers", layers if plan["gradient_checkpointing"] else 0),
            layers=layers,
            fetch_unit=resolve_fetch_unit(unit, method),
        )

    def words(self) -> str:
        return f"micro {self.micro} × {self.accumulation}, {self.checkpointed}/{self.layers} ckpt, {self.fetch_unit}"


def predicted_and_measured(run: dict) -> tuple[float, float, str]:
    """(predicted, measured) seconds of one optimizer step, and the method: today's model, as launch predicts."""
    from orchestrator.planning.dsconfig import bucket_sizes
    from orchestrator.planning.memory.estimate import LoraShape
    from orchestrator.planning.shape import CATALOGUE, shape_from_config
    from orchestrator.planning.speed.communication import Layout, Links, ZeroSettings
    from orchestrator.planning.speed.steptime import GPU_KINDS, ComputePlan, compute_rate, optimizer_seconds, predict
    from orchestrator.spec.job import LORA_DEFAULT_TARGETS

    plan = RecordedPlan.of(run)
    config = {**CATALOGUE["Qwen/Qwen3-8B"], "num_hidden_layers": plan.layers}
    shape = shape_from_config(config, name=f"Qwen3-8B-{plan.layers}", source="catalogue")
    h200 = GPU_KINDS["H200"]
    compute = ComputePlan(plan.method, plan.micro, plan.checkpointed, plan.layers, SEQ, plan.fetch_unit)
    # Every launch's LoRA was r 16 on the 7 projections (useful_tokens_h200.py's job, the spec's defaults).
    lora = LoraShape(16, LORA_DEFAULT_TARGETS, 0.0)
    trained = lora.adapter_params(shape) if plan.method == "lora" else shape.total_params
    step = predict(
        shape,
        tokens=plan.micro * SEQ,
        seq_len=SEQ,
        layout=Layout(1, 1),
        zero=ZeroSettings(*bucket_sizes(config["hidden_size"])),
        links=Links(None, h200.intra_bytes_per_s, "none"),
        flops_per_s=compute_rate(h200, run["plan"]["fused_loss"], compute),
        param_bytes=2,
        grad_bytes=2,
        accumulation=plan.accumulation,
        optimizer_s=optimizer_seconds(h200, trained),
    )
    assert step.comm_s == 0.0 and step.bound == "compute"
    measured = run.get("median_step_s") or statistics.median(
        s["step_time_s"] for s in run["steps"] if s["event"] == "step" and s["step"] >= 3
    )
    return step.optimizer_step_s, measured, plan.method


class Prediction(NamedTuple):
    """One committed launch, re-predicted: its plan in words, and today's model against the measured step."""

    name: str
    method: str
    plan: str
    predicted: float
    measured: float


def predictions(results: Path) -> list[Prediction]:
    found = []
    for name, run in one_h200_launches(results):
        predicted, measured, method = predicted_and_measured(run)
        found.append(Prediction(name, method, RecordedPlan.of(run).words(), predicted, measured))
    return found


def grouped(rows: list[Prediction]) -> dict[tuple[str, str], tuple[float, list[float]]]:
    """(method, plan words) -> (predicted step s, the measured step s of each launch of that configuration)."""
    found: dict[tuple[str, str], tuple[float, list[float]]] = {}
    for row in rows:
        found.setdefault((row.method, row.plan), (row.predicted, []))[1].append(row.measured)
    return found


IN_SAMPLE = (
    "In-sample: the model was fitted and revised on these launches, so this is a regression guard (it "
    "reproduces the launches it was fitted on), not a measure of accuracy (issue 42 measures that on "
    "launches left out of the fit)."
)


def print_model_table(results: Path) -> None:
    print(f"{IN_SAMPLE}\n")
    print("| launch | method | plan | predicted step s | measured median step s | predicted vs measured |")
    print("|---|---|---|---|---|---|")
    rows = predictions(results)
    errors = []
    for row in rows:
        errors.append((row.method, row.predicted / row.measured - 1))
        print(
            f"| {row.name} | {row.method} | {row.plan} | "
            f"{row.predicted:.3f} | {row.measured:.3f} | {100 * errors[-1][1]:+.1f}% |"
        )
    for method in ("full", "lora"):
        mine = [e for m, e in errors if m == method]
        if not mine:
            continue
        within = sum(abs(e) <= TOLERANCE for e in mine)
        worst = max(mine, key=abs)
        print(
            f"\n{method}, in-sample: {within} of {len(mine)} launches reproduced within ±{100 * TOLERANCE:.0f}% "
            f"(worst {worst:+.1%})"
        )
    # A configuration launched several times: its measured step is the median of its launches' (the
    # launches of one LoRA plan by module spread by up to 36 % between device calls).
    print("\n| method | plan | launches | predicted step s | measured step s, median (min-max) | predicted vs median |")
    print("|---|---|---|---|---|---|")
    within = total = 0
    for (method, words), (predicted, measured) in grouped(rows).items():
        median = statistics.median(measured)
        error = predicted / median - 1
        total += 1
        within += abs(error) <= TOLERANCE
        print(
            f"| {method} | {words} | {len(measured)} | {predicted:.3f} | "
            f"{median:.3f} ({min(measured):.3f}-{max(measured):.3f}) | {100 * error:+.1f}% |"
        )
    print(
        f"\nin-sample: {within} of {total} configurations reproduced within ±{100 * TOLERANCE:.0f}% of their "
        "launches' median step"
    )


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
        found.append(
            {
                "folder": folder.name, "run": summary.parent.name, "plan": RecordedPlan.of(result).words(),
                "predicted": speed["tokens_per_s_per_gpu"], "mfu_used": speed["mfu"],
                "measured": result["processed_tokens_per_s_per_gpu"], "measured_mfu": result["mfu"],
            }
        )  # fmt: skip
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kept", nargs="+", type=Path, metavar="FOLDER", help="the predictions launch kept")
    args = parser.parse_args()
    if not args.kept:
        print_model_table(REPO / "benchmarks" / "results")
        return 0
    table = [r for folder in args.kept for r in rows(folder)]
    print(
        "| folder | run | plan | predicted tok/s/GPU (MFU used) | measured tok/s/GPU (MFU) | "
        "predicted vs measured tok/s | predicted vs measured step |"
    )
    print("|---|---|---|---|---|---|---|")
    within = 0
    for r in table:
        error = r["predicted"] / r["measured"] - 1
        step_error = r["measured"] / r["predicted"] - 1  # a step takes tokens / rate
        within += abs(step_error) <= TOLERANCE
        print(
            f"| {r['folder']} | {r['run']} | {r['plan']} | {r['predicted']:,.0f} ({100 * r['mfu_used']:.1f}%) | "
            f"{r['measured']:,.0f} ({100 * r['measured_mfu']:.1f}%) | {100 * error:+.1f}% | {100 * step_error:+.1f}% |"
        )
    print(f"\n{within} of {len(table)} launches' predicted step within ±{100 * TOLERANCE:.0f}% of the measured one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
