"""The offloaded optimizer's host step against the launches: fit its one constant on one card, check on the other.

    python3 benchmarks/offload_fit.py

The launches: the 18-layer Qwen3-8B shape with the optimizer offloaded, through ``dzctl launch``: on one H100
the auto plans of 2026-12-06 (``plans-h100x1-20261206/off-auto-3``: micro 8 x 4, 7 recomputed) and 2026-12-07
(``plans-h100x1-20261207c/off-auto-1``: micro 4 x 8, none recomputed), the same job with DeepSpeed's partial
offload (``off-ratio-1``: ratio 0.5, sub_group_size 5e8), the measured candidates of two ``dzctl tune`` runs
(``plans-h100x1-20261207e/tune-off``, ``plans-h100x1-20261208/tune-off``) and the second one's fourth candidate
launched alone (``plans-h100x1-20261208/off-auto-m32``); on one H200 the same job with ``zero.offload=optimizer``
forced (``plans-h200x1-20261207/off-auto-1``; its states fit, the offloaded step is measured all the same). Each is
re-predicted by today's step-time model on its own plan and with the host rates its own preflight measured
(the ``host AdamW`` note of its launch log), and compared with its measured step (a launch's median step after
its warm-up, steps 4-7 or, for ``off-auto-m32``, 2-3; a tune candidate's after the tune's warm-up, from its
progress events' times). Each launch is
marked with the preflight probe that read its rate: "old" (three fused AdamW steps timed together) before
2026-12-07e, "new" (the fastest of five single-timed steps) since.

The model's host step (planning/speed/offload.py) is the AdamW over the node's partitions at the measured
rate, the weights' upload, and ``HOST_OTHER_PASSES`` more AdamW-equivalents for the rest of DeepSpeed's host
work (the fp32 gradient buffer, the norm and the clipping over it, the 16-bit weights written for the upload);
the gradients' trips of each micro-step run beside the backward. This script prints, per launch, the step
without that constant, the seconds it leaves unexplained, and the constant each launch alone implies; then the
constant fitted on each card and probe (the median of its launches) and every launch of the other card predicted
with it. ``HOST_OTHER_PASSES`` is the H100's fit on the new probe, checked on the H200.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

LAUNCHES = (  # (card, folder of the launch, the preflight probe that read its host rate)
    ("H200", "benchmarks/results/plans-h200x1-20261207/off-auto-1", "old"),
    ("H100", "benchmarks/results/plans-h100x1-20261206/off-auto-3", "old"),
    ("H100", "benchmarks/results/plans-h100x1-20261207c/off-auto-1", "old"),
    ("H100", "benchmarks/results/plans-h100x1-20261207c/off-ratio-1", "old"),
    ("H100", "benchmarks/results/plans-h100x1-20261208/off-auto-m32", "new"),
)
# ``dzctl tune``'s offloaded candidates, each a launch with its own preflight (the probe of 2026-12-07e on: the
# fastest of five single-timed AdamW steps, where the old one timed three together).
TUNES = (
    ("H100", "benchmarks/results/plans-h100x1-20261207e/tune-off", "new"),
    ("H100", "benchmarks/results/plans-h100x1-20261208/tune-off", "new"),
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


def tune_candidates(card: str, folder: str, probe: str) -> list[tuple[str, str, str, dict, str]]:
    """Each measured candidate of a ``dzctl tune`` as a launch: its plan, its own preflight's host note, and its
    step time, the median of its steps after the tune's warm-up (from the times of its progress events)."""
    from plans_report import TUNE_CANDIDATE, candidate_events, tune_warmup

    path = REPO / folder
    summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))["results"][0]
    runs = (path / "runs.log").read_text(encoding="utf-8")
    warmup = tune_warmup(runs.splitlines())
    preamble, *segments = re.split(r"(?m)^(?=tune: candidate \d+/\d+:)", runs)
    segments[0] = preamble + segments[0]  # the first candidate's preflight ran before its line: the tune's own
    out = []
    for segment in segments:
        found = TUNE_CANDIDATE.search(segment)
        rank, micro, checkpointed = int(found[1]), int(found[2]), int(found[3] or 0)
        times = {e["step"]: e["time"] for e in candidate_events(path, rank) if e["event"] in ("start", "step")}
        steps = [times[k] - times[k - 1] for k in sorted(times) if k > warmup and k - 1 in times]
        if not steps:
            continue  # cut before a step after the warm-up
        plan = {**summary["plan"], "micro_batch_size": micro, "checkpointed_layers": checkpointed}
        result = {**summary, "plan": plan, "median_step_s": statistics.median(steps)}
        out.append((card, f"{folder}/c{rank}", probe, result, segment))
    return out


def launch(card: str, folder: str, probe: str) -> tuple[str, str, str, dict, str]:
    """A launch of ``LAUNCHES`` as ``tune_candidates`` gives each candidate: its result and its log."""
    path = REPO / folder
    result = json.loads((path / "summary.json").read_text(encoding="utf-8"))["results"][0]
    return card, folder, probe, result, (path / "runs.log").read_text(encoding="utf-8")


def without_other_passes(card: str, folder: str, probe: str, result: dict, log: str) -> dict:
    """One launch re-predicted without ``HOST_OTHER_PASSES``, and the host's AdamW seconds it is a multiple of.

    The step is linear in the constant (``offloaded_optimizer_seconds``: (1 + passes) x the AdamW's seconds), and
    the launch's micro-batch and recomputed layers are fixed, so the step without it is today's step less the
    constant's share."""
    from plans_report import predicted

    from orchestrator.planning.speed.offload import HOST_OTHER_PASSES

    host = preflight_host(log)
    plan, step_s = predicted(result, host, card)
    on_host = plan.estimate.trainable_params - plan.estimate.optimizer_on_gpu  # one rank: the node's partition
    adam_s = on_host / host.adam_params_per_s
    return {
        "card": card, "folder": folder, "probe": probe, "plan": plan, "host": host,
        "without_s": step_s - HOST_OTHER_PASSES * adam_s, "adam_s": adam_s, "measured_s": result["median_step_s"],
    }  # fmt: skip


def all_launches() -> list[dict]:
    """Every launch and tune candidate above, re-predicted, with the constant it alone implies (``implied``)."""
    rows = [without_other_passes(*launch(*given)) for given in LAUNCHES]
    rows += [without_other_passes(*c) for card, folder, probe in TUNES for c in tune_candidates(card, folder, probe)]
    for row in rows:
        row["implied"] = (row["measured_s"] - row["without_s"]) / row["adam_s"]
    return rows


def main() -> int:
    from orchestrator.planning.speed.offload import HOST_OTHER_PASSES

    rows = all_launches()
    for row in rows:
        plan, layers = row["plan"], row["plan"].estimate.num_layers
        partial = (
            f", {plan.estimate.optimizer_on_gpu / 1e9:.2f} G stepped on the GPU"
            if plan.estimate.optimizer_on_gpu
            else ""
        )
        print(
            f"{row['card']} ({row['folder']}, {row['probe']} probe): micro {plan.choice.micro_batch_size} x "
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
    groups = sorted({(r["card"], r["probe"]) for r in rows}, key=lambda g: (g[1] == "new", g[0] == "H100"))
    for fit_card, fit_probe in groups:
        fit = [r for r in rows if (r["card"], r["probe"]) == (fit_card, fit_probe)]
        passes = statistics.median(r["implied"] for r in fit)
        errors = []
        for row in (r for r in rows if r["card"] != fit_card):
            step = row["without_s"] + passes * row["adam_s"]
            errors.append(row["measured_s"] / step - 1)
            print(
                f"fit on {fit_card}, {fit_probe} probe ({len(fit)} launch(es), {passes:.2f} passes), check on "
                f"{row['card']} ({row['folder'].removeprefix('benchmarks/results/')}, {row['probe']} probe): predicted "
                f"{step:.2f} s against {row['measured_s']:.2f} s measured: predicted tokens/s {errors[-1]:+.1%} of "
                "the measured"
            )
        print(f"  fit on {fit_card}, {fit_probe} probe: worst {max(map(abs, errors)):.1%} on {len(errors)} launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
