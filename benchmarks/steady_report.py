"""The tables of ``run_steady_h200.sh``'s raw outputs (issue 29): every launch, each plan's spread, the bars,
and each profile's three largest costs before and after.

    python3 benchmarks/steady_report.py benchmarks/results/steady-h200x1-20261204

Launches: ``NAME/summary.json`` (``useful_tokens_h200.py``'s output; NAME is ``full-sft-R``, ``full-syn-R``
or ``lora-R``, R the round, or the same with ``-gN`` before ``-R`` when the global batch was fixed at N rows).
The call each ran in comes from ``console-callK.log``. Profiles:
``profile*-prof-*.json`` (``recompute_h200.py --profile``): each cost's kernel time, and the GPU's idle
time, as a share of the profiled step's wall time. Kernels on different streams can overlap, so the
shares may add up to more than 100%.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

# What each plan is measured against (issue 29's Done-when): (key, bar, how it is printed).
PLANS = {
    "full-sft": ("full FT, 18 layers, SFT rows, auto", "mfu", 0.50),
    "full-syn": ("full FT, 18 layers, synthetic:random, auto", "mfu", 0.54),
    "lora": ("LoRA r16, 36 layers, synthetic:random, auto", "tokens_per_s", 12_500),
}
PEAK_TOLERANCE = 0.05
PROFILES = (
    ("full FT", "profile-prof-full-before.json", "profile-prof-full-after.json"),
    ("LoRA", "profile-lora-prof-lora-before.json", "profile-lora-prof-lora-after.json"),
)
# Profiles recorded before recompute_h200.py named the dropout's kernels count them as element-wise or
# other kernels; they are moved to their own cost here, from the top-kernel list (where they all are).
DROPOUT = ("dropout", "masked_scale")


def calls(folder: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for log in sorted(folder.glob("console-call*.log")):
        number = int(re.sub(r"\D", "", log.stem))
        for line in log.read_text(encoding="utf-8").splitlines():
            match = re.match(r"(\S+): exit 0", line)
            if match:
                found[match.group(1)] = number
    return found


# A plan name's suffixes: -g32 when the global batch was fixed (32 rows), -nockpt when it set
# train.gradient_checkpointing=false, -module or -layer when it set zero.fetch_unit (the launches of
# results/fetchunit-h200x1-20261204 without a suffix ran the key's default then, layer).
VARIANT = re.compile(r"(?:-g(?P<rows>\d+))?(?:-(?P<ckpt>nockpt))?(?:-(?P<unit>module|layer))?$")


def plan_label(plan: str) -> tuple[str, str, str, float]:
    """(base plan, label, bar key, bar) of a launch's plan name: ``full-sft``, ``full-sft-g32``, ``lora-g32-module``."""
    variant = VARIANT.search(plan)
    base = plan[: variant.start()]
    label, key, bar = PLANS[base]
    if variant["rows"]:
        label += f", global batch {variant['rows']} rows"
    if variant["ckpt"]:
        label += ", gradient_checkpointing false"
    if variant["unit"]:
        label += f", zero.fetch_unit {variant['unit']}"
    return base, label, key, bar


def launches(folder: Path) -> list[dict]:
    call_of = calls(folder)
    rows = []
    for summary in folder.glob("*/summary.json"):
        name = summary.parent.name
        plan, _, repeat = name.rpartition("-")
        if VARIANT.sub("", plan) not in PLANS:
            continue
        result = json.loads(summary.read_text(encoding="utf-8"))["results"][0]
        if "error" in result:
            rows.append({"name": name, "plan": plan, "repeat": int(repeat), "error": result["error"]})
            continue
        steps = [s["step_time_s"] for s in result["steps"] if s["step"] in result["measured_steps"]]
        peak = max(result["peak_allocated_gib"])
        rows.append(
            {
                "name": name, "plan": plan, "repeat": int(repeat), "call": call_of.get(name),
                "micro": result["plan"]["micro_batch_size"], "checkpointed": result["plan"]["checkpointed_layers"],
                "layers": result["plan"]["decoder_layers"],
                "accumulation": result["plan"]["ds_config"]["gradient_accumulation_steps"],
                "tokens_per_s": result["useful_tokens_per_s_per_gpu"],
                "mfu": result["mfu"], "predicted": result["predicted_peak_gib"], "peak": peak,
                "steps": f"{result['measured_steps'][0]}-{result['measured_steps'][-1]}",
                "step_min": min(steps), "step_max": max(steps), "median_step_s": result["median_step_s"],
            }
        )  # fmt: skip
    order = list(PLANS)
    return sorted(rows, key=lambda r: (r["repeat"], order.index(plan_label(r["plan"])[0]), r["plan"]))


def launch_tables(rows: list[dict]) -> str:
    out = [
        "| run | call | plan | tokens/s/GPU | MFU | predicted GiB | measured peak GiB | predicted vs measured | "
        "median step s (min-max, steps) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['name']} | | failed: {r['error']} |")
            continue
        lora = plan_label(r["plan"])[0] == "lora"
        mfu = f"({100 * r['mfu']:.1f}%)" if lora else f"{100 * r['mfu']:.1f}%"
        out.append(
            f"| {r['name']} | {r['call']} | micro {r['micro']} × {r['accumulation']}, "
            f"{r['checkpointed']}/{r['layers']} ckpt | "
            f"{r['tokens_per_s']:,.0f} | {mfu} | {r['predicted']:.2f} | {r['peak']:.2f} | "
            f"{100 * (r['predicted'] / r['peak'] - 1):+.1f}% | "
            f"{r['median_step_s']:.3f} ({r['step_min']:.3f}-{r['step_max']:.3f}, {r['steps']}) |"
        )
    out += [
        "",
        "| plan | launches | tokens/s mean (min-max) | spread max/min | MFU mean (min-max) | bar | "
        "met by mean | met by worst | peak within ±5% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    plans = sorted({r["plan"] for r in rows}, key=lambda p: (list(PLANS).index(plan_label(p)[0]), p))
    for plan in plans:
        _, label, key, bar = plan_label(plan)
        ok = [r for r in rows if r["plan"] == plan and "error" not in r]
        if not ok:
            out.append(f"| {label} | 0 |")
            continue
        tps = [r["tokens_per_s"] for r in ok]
        mfu = [r["mfu"] for r in ok]
        values = [r[key] for r in ok]
        shown = f"{100 * bar:.0f}% MFU" if key == "mfu" else f"{bar:,} tokens/s"
        within = all(abs(r["predicted"] / r["peak"] - 1) <= PEAK_TOLERANCE for r in ok)
        out.append(
            f"| {label} | {len(ok)} | {statistics.mean(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f}) | "
            f"{100 * (max(tps) / min(tps) - 1):+.1f}% | {100 * statistics.mean(mfu):.1f}% "
            f"({100 * min(mfu):.1f}-{100 * max(mfu):.1f}%) | {shown} | "
            f"{'yes' if statistics.mean(values) >= bar else 'no'} | {'yes' if min(values) >= bar else 'no'} | "
            f"{'yes' if within else 'no'} |"
        )
    return "\n".join(out)


def costs(profile: dict) -> list[tuple[str, float]]:
    """Each cost in seconds: the recorded categories, dropout split out, and the GPU's idle time."""
    seconds = dict(profile["categories_s"])
    if "LoRA dropout" not in seconds:
        from recompute_h200 import CATEGORIES

        before = [(label, keys) for label, keys in CATEGORIES if label != "LoRA dropout"]  # as it was recorded
        for kernel in profile["top_kernels"]:
            name = kernel["name"].lower()
            if any(k in name for k in DROPOUT):
                old = next((label for label, keys in before if any(k in name for k in keys)), "other kernels")
                seconds[old] -= kernel["s"]
                seconds["LoRA dropout"] = seconds.get("LoRA dropout", 0.0) + kernel["s"]
    seconds["GPU idle (waiting on the CPU)"] = profile["gpu_idle_s"]
    return sorted(seconds.items(), key=lambda kv: -kv[1])


def profile_tables(folder: Path) -> str:
    out = []
    for label, *names in PROFILES:
        out += [
            f"{label}:",
            "",
            "| profile | plan | step s (profiled / unprofiled) | tokens/s (unprofiled) | largest | 2nd | 3rd | "
            "GPU idle, dropout |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for when, name in zip(("before", "after"), names, strict=True):
            path = folder / name
            if not path.exists():
                out.append(f"| {when} | missing: {name} |")
                continue
            p = json.loads(path.read_text(encoding="utf-8"))
            wall = p["profiled_step_s"]
            ranked = costs(p)
            top = [f"{cost} {seconds:.3f} s ({100 * seconds / wall:.1f}%)" for cost, seconds in ranked[:3]]
            named = dict(ranked)
            top.append(
                f"{100 * named['GPU idle (waiting on the CPU)'] / wall:.1f}%, "
                f"{100 * named.get('LoRA dropout', 0.0) / wall:.1f}%"
            )
            dropout = f", dropout {p['lora_dropout']}" if p["lora"] else ""
            out.append(
                f"| {when} | micro {p['micro']}, {p['checkpointed']}/{p['layers']} ckpt{dropout} | "
                f"{wall:.3f} / {p['unprofiled_median_step_s']:.3f} | "
                f"{p['tokens'] / p['unprofiled_median_step_s']:,.0f} | " + " | ".join(top) + " |"
            )
        out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(launch_tables(launches(args.folder)))
    print()
    print(profile_tables(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
