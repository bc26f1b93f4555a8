"""Predicted against measured step times of benchmarks/steptime_shaped.py's runs (reads its runs.json).

For every run the links are what that run's own probe measured on the shaped link (all-gather and
reduce-scatter at 256 elements, the latency, and at the bucket size, the bandwidth); the model's
compute rate (FLOP/s per rank) and overlap share are fitted on the unshaped runs only, then the
shaped runs are predicted. Also: the loss of plain ZeRO-3 against hpZ, step by step, where both ran.

    python3 benchmarks/steptime_shaped_report.py RESULTS_DIR [--loss-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.planning.shape import shape_from_config  # noqa: E402
from orchestrator.planning.speed.communication import Layout, Links, ZeroSettings  # noqa: E402
from orchestrator.planning.speed.steptime import predict  # noqa: E402

TOLERANCE = 0.20  # the target: predicted within ±20 % of measured
FIRST_TIMED_STEP = 3  # steps 1-2 build the trace and warm the allocator


def measured_s(record: dict) -> float:
    return statistics.median(s["time_s"] for s in record["steps"] if s["step"] >= FIRST_TIMED_STEP)


def links_from_probe(record: dict) -> Links:
    probe, world, per_node = record["probe_s"], record["world"], record["ranks_per_node"]

    def bandwidth(scope: str, kind: str, ranks: int) -> float:
        full = 4 * ranks * -(-probe["large"] // ranks)  # fp32 bytes of the whole tensor
        extra = probe[f"{scope}_{kind}_large"] - probe[f"{scope}_{kind}_small"]
        return (ranks - 1) / ranks * full / max(extra, 1e-6)

    return Links(
        inter_bytes_per_s=bandwidth("global", "all_gather", world),
        inter_reduce_bytes_per_s=bandwidth("global", "reduce_scatter", world),
        intra_bytes_per_s=bandwidth("node", "all_gather", per_node),
        inter_latency_s=(probe["global_all_gather_small"] + probe["global_reduce_scatter_small"]) / 2,
        intra_latency_s=(probe["node_all_gather_small"] + probe["node_reduce_scatter_small"]) / 2,
        source=f"probe at {record['rate_mbit'] or 'unshaped'} Mbit/s",
    )


def prediction(record: dict, flops_per_s: float, overlap: float):
    zero = record["zero_optimization"]
    shape = shape_from_config(record["model"], name="bench", source="benchmark")
    settings = ZeroSettings(
        reduce_bucket=zero["reduce_bucket_size"],
        prefetch_bucket=zero["stage3_prefetch_bucket_size"],
        persistence_threshold=zero["stage3_param_persistence_threshold"],
        hpz_partition_size=zero.get("zero_hpz_partition_size", 1),
        max_reuse_distance=zero["stage3_max_reuse_distance"],
    )
    return predict(
        shape,
        tokens=record["tokens_per_rank"],
        seq_len=record["tokens_per_rank"],
        layout=Layout(record["ranks_per_node"], record["world"] // record["ranks_per_node"]),
        zero=settings,
        links=links_from_probe(record),
        flops_per_s=flops_per_s,
        param_bytes=4,
        grad_bytes=4,
        overlap=overlap,
        checkpointing=False,
    )


def fit(records: list[dict]) -> tuple[float, float]:
    """Compute rate and overlap minimising the squared relative error over ``records`` (a grid: two parameters)."""
    shape = shape_from_config(records[0]["model"], name="bench", source="benchmark")
    flops_per_step = records[0]["tokens_per_rank"] * shape.flops_per_token(records[0]["tokens_per_rank"])
    best = None
    for compute_ms in range(20, 4001, 10):
        rate = flops_per_step / (compute_ms / 1000)
        for overlap_pct in range(0, 101, 5):
            err = sum((prediction(r, rate, overlap_pct / 100).step_s / measured_s(r) - 1) ** 2 for r in records)
            if best is None or err < best[0]:
                best = (err, rate, overlap_pct / 100)
    return best[1], best[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--loss-dir", type=Path, default=None)
    parser.add_argument("--fit-rate", type=int, default=None, help="Mbit/s of the runs to fit on (default: unshaped)")
    parser.add_argument("--name", default="report", help="file name of the report (.md) and summary (.json)")
    args = parser.parse_args()
    records = [r for r in json.loads((args.results / "runs.json").read_text()) if "steps" in r]
    calibration = [r for r in records if r["rate_mbit"] == args.fit_rate]
    rate, overlap = fit(calibration)
    where = f"{args.fit_rate} Mbit/s" if args.fit_rate else "unshaped"
    lines = [
        f"Fitted on the {len(calibration)} {where} runs: compute {rate / 1e9:.2f} GFLOP/s per rank, "
        f"overlap {overlap:.2f}.",
        "",
        "| rate Mbit/s | config | probe: all-gather / reduce-scatter MB/s, latency ms | compute s | comm s | "
        "predicted s | measured s (median of steps 3+) | error | bound | used for |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for r in records:
        step = prediction(r, rate, overlap)
        links = links_from_probe(r)
        measured = measured_s(r)
        error = step.step_s / measured - 1
        role = "fit" if r["rate_mbit"] == args.fit_rate else "prediction"
        rows.append({"rate_mbit": r["rate_mbit"], "config": r["config"], "predicted_s": round(step.step_s, 3),
                     "measured_s": round(measured, 3), "error": round(error, 3), "role": role,
                     "compute_s": round(step.compute_s, 3), "comm_s": round(step.comm_s, 3), "bound": step.bound,
                     "inter_node_mb": round(step.comm.inter_bytes / 1e6, 1)})  # fmt: skip
        lines.append(
            f"| {r['rate_mbit'] or 'unshaped'} | {r['config']} | {links.inter_bytes_per_s / 1e6:.1f} / "
            f"{links.inter_reduce_bytes_per_s / 1e6:.1f}, {links.inter_latency_s * 1e3:.1f} | {step.compute_s:.2f} | "
            f"{step.comm_s:.2f} | {step.step_s:.2f} | {measured:.2f} | {error:+.0%} | {step.bound} | {role} |"
        )
    lines += ["", *counted_lines(records, rate, overlap)]
    predicted = [row for row in rows if row["role"] == "prediction"]
    within = sum(abs(row["error"]) <= TOLERANCE for row in predicted)
    lines += ["", f"Predictions within ±{TOLERANCE:.0%}: {within} of {len(predicted)}."]
    summary = {"compute_flops_per_s": rate, "overlap": overlap, "rows": rows, "within": within}
    if args.loss_dir is not None:
        loss = compare_losses(args.loss_dir)
        summary["loss"] = loss
        lines += ["", loss["text"]]
    text = "\n".join(lines) + "\n"
    print(text)
    (args.results / f"{args.name}.md").write_text(text, encoding="utf-8")
    (args.results / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return 0


def counted_lines(records: list[dict], rate: float, overlap: float) -> list[str]:
    """What DeepSpeed really moved (the worker's counter) beside what the model says it moves, per config.

    Counted on rank 0 per timed step, by phase of the step (torch.distributed's all-gather and
    reduce-scatter calls while the engine ran forward, backward, step); the model's figures are its
    collectives for that config. Where they differ, the model's phase rule is what misses.
    """
    out = [
        "Bytes per step, counted on rank 0 (calls; MB of whole tensors) against the model's collectives:",
        "",
        "| config | counted forward all-gather | counted backward all-gather | counted reduce-scatter | "
        "model forward all-gather | model backward all-gather | model reduce-scatter |",
        "|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in records:
        counts = r.get("collectives_per_step")
        if not counts or r["config"] in seen:
            continue
        seen.add(r["config"])

        def cell(phase: str, op: str, counts: dict = counts) -> str:
            entry = counts.get(phase, {}).get(op)
            return f"{entry['calls']:.0f}; {entry['bytes'] / 1e6:.1f}" if entry else "0; 0.0"

        model = {c.name: c for c in prediction(r, rate, overlap).comm.collectives}

        def modelled(*names: str, model: dict = model) -> str:
            found = [model[n] for n in names if n in model]
            return f"{sum(c.calls for c in found):.0f}; {sum(c.total_bytes for c in found) / 1e6:.1f}"

        out.append(
            f"| {r['config']} | {cell('forward', 'all_gather_into_tensor')} | "
            f"{cell('backward', 'all_gather_into_tensor')} | {cell('backward', 'reduce_scatter_tensor')} | "
            f"{modelled('forward all-gather', 'forward all-gather (hpZ copy)')} | {modelled('backward all-gather')} | "
            f"{modelled('gradient reduce-scatter')} |"
        )
    return out if seen else []


LOSS_TOLERANCE = 1e-4  # relative, per step: fp32 on CPU, the same data and seed; only the gather's source differs


def compare_losses(loss_dir: Path) -> dict:
    runs = {r["config"]: r for r in json.loads((loss_dir / "runs.json").read_text()) if "steps" in r}
    plain, hpz = runs.get("plain-release"), runs.get("hpz-release")
    if plain is None or hpz is None:
        return {"text": "loss comparison: a run is missing", "ok": False}
    pairs = [(a["loss"], b["loss"]) for a, b in zip(plain["steps"], hpz["steps"], strict=True)]
    worst = max(abs(a - b) / abs(a) for a, b in pairs)
    ok = worst <= LOSS_TOLERANCE
    text = (
        f"Loss over {len(pairs)} steps, plain ZeRO-3 against hpZ (same seed and data): largest relative "
        f"difference {worst:.2e} (tolerance {LOSS_TOLERANCE:.0e}: {'within' if ok else 'outside'}); "
        f"first {pairs[0][0]:.4f} / {pairs[0][1]:.4f}, last {pairs[-1][0]:.4f} / {pairs[-1][1]:.4f}."
    )
    return {"text": text, "ok": ok, "worst_relative": worst, "pairs": pairs}


if __name__ == "__main__":
    raise SystemExit(main())
