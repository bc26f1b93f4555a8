"""Issue 42's tables from the committed raw outputs of ``benchmarks/run_plans_gpu.sh`` (one GPU node).

    python3 benchmarks/plans_report.py benchmarks/results/plans-h100x1-20261206

1. The node's offload rates (``offload-rates.json``): DeepSpeed's CPU Adam against torch's fused AdamW (the
   proxy preflight measures on every node), in interleaved rounds, and the pinned copies.
2. Each offload launch that ran (``off-*/summary.json``): its plan, the measured tokens/s and step, and
   today's step-time model re-predicting the same plan on the same node, without a host rate (the plan
   before issue 42: the host's part not timed) and with the rates of table 1. Nothing of the offload term
   is fitted to these launches: its inputs are table 1's rates and DeepSpeed's source (planning/speed/
   offload.py), so each row is out of sample.
3. The NCCL flight recorder of issue 45's one-rank check (``hang-flight-recorder/``), if present.
4. The recompute grids (``recompute-*.json``: ``benchmarks/recompute_h200.py``) and their fit.
5. The other launches (``lora-*``, ``before-lora-*``, ``dpo-*``, ``sftpairs-*``, ``full12-*``, ``synth-*``, and
   ``off-*`` where table 2 is not made): the plan the launch itself made (its ``dzctl-train`` line), its
   predicted tokens/s (its ``predicted step`` line), measured tokens/s and step, and the measured peak.
6. The plain-PyTorch ceiling (``plain-pytorch-L.json``) against dzctl's launch of the same rows.
7. ``dzctl tune``'s candidates (``tune-*/tune.json``, or their progress events where the tune was cut).

A table whose files are not in the folder is left out.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def rates_table(folder: Path) -> list[str]:
    if not (folder / "offload-rates.json").is_file():
        return []
    rates = json.loads((folder / "offload-rates.json").read_text(encoding="utf-8"))
    lines = [
        f"node: {rates.get('gpu')}, {rates['cores']} cores, {rates['params'] / 1e9:.1f} G fp32 parameters stepped",
        "| optimizer | rounds (G params/s) | median |",
        "|---|---|---|",
    ]
    for name in ("cpu_adam", "torch_fused_adamw"):
        rounds = ", ".join(f"{r / 1e9:.2f}" for r in rates[f"{name}_params_per_s_by_round"])
        lines.append(f"| {name} | {rounds} | {rates[f'{name}_params_per_s'] / 1e9:.2f} |")
    lines.append(f"torch fused / CPU Adam: {rates['torch_fused_over_cpu_adam']:.3f}")
    lines.append(
        f"pinned copies: {rates['h2d_bytes_per_s'] / 1e9:.1f} GB/s up, {rates['d2h_bytes_per_s'] / 1e9:.1f} GB/s "
        f"down; cpu_adam built and loaded in {rates['cpu_adam_load_s']} s"
    )
    return lines


def predicted(result: dict, host, kind_name: str = "H100", layers: int = 18) -> tuple[object, float]:
    """Today's model on the launch's own job and plan, on one GPU of ``kind_name`` and 125 GiB of RAM (the node's)."""
    import argparse as ap
    import tempfile

    import sft_data
    import useful_tokens_h200 as launcher
    import yaml

    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.memory.fromjob import SpeedInputs, plan_for_job
    from orchestrator.planning.speed.communication import Links
    from orchestrator.planning.speed.steptime import GPU_KINDS
    from orchestrator.spec.job import load_job

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "sft-lognormal.jsonl"
        rows = sft_data.alpaca_rows(3000, seed=0, max_len=4096)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        # The launch's own plan, whatever today's planner would choose for the job.
        recorded = result["plan"]
        sets = [*result["overrides"], f"train.micro_batch_size={recorded['micro_batch_size']}"]
        sets.append(f"train.gradient_checkpointing={recorded['checkpointed_layers'] or 'false'}")
        if recorded["zero"]["offload_optimizer"]:
            sets.append("zero.offload=all" if recorded["zero"]["offload_param"] else "zero.offload=optimizer")
        args = ap.Namespace(
            model="qwen3-8b", seq=4096, layers=layers, set=sets, env=[], port=29541, work=str(work), steps=7, rows=3000
        )
        spec = launcher.job_spec(result["config"], args, "gpu", data.name, work)
        (work / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
        inputs = read_inputs(load_job(work / "job.yaml"))
        kind = GPU_KINDS[kind_name]
        speed = SpeedInputs(gpu=kind, links=Links.rated(None, kind.intra_bytes_per_s, "one GPU"), host=host)
        # The launch's plan is fixed above; GPU memory is not what is predicted here (it stays the estimate's).
        plan, _ = plan_for_job(inputs, [1], gpu_mem_gib=1000.0, host_mem_gib=125.0, speed=speed)
    return plan, plan.speed.step.optimizer_step_s


def launches_table(folder: Path) -> list[str]:
    from orchestrator.planning.speed.offload import HostOptimizer

    if not (folder / "offload-rates.json").is_file():
        return []
    rates = json.loads((folder / "offload-rates.json").read_text(encoding="utf-8"))
    host = HostOptimizer(
        rates["torch_fused_adamw_params_per_s"], rates["h2d_bytes_per_s"], "offload-rates.json",
        rates["d2h_bytes_per_s"],
    )  # fmt: skip
    lines = [
        "| launch | plan | measured tokens/s (step s) | predicted, host not timed | predicted, host timed | "
        "peak GiB predicted / measured |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(folder.glob("off-*/summary.json")):
        result = json.loads(path.read_text(encoding="utf-8"))["results"][0]
        if "useful_tokens_per_s_per_gpu" not in result or result.get("launch_exit_code") != 0:
            lines.append(f"| {path.parent.name} | failed: {result.get('error') or result.get('launch_exit_code')} |")
            continue
        measured = result["useful_tokens_per_s_per_gpu"]
        plan_then = result["plan"]
        cells = []
        for rate in (None, host):
            plan, step_s = predicted(result, rate)
            tokens = plan.speed.step.tokens_per_s * result["data_packing_efficiency"]  # real tokens, as measured
            cells.append(f"{tokens:,.0f} ({step_s:.2f} s, {tokens / measured - 1:+.1%})")
        peak = result["peak_allocated_gib"][0]
        today_peak = plan.estimate.gpu_peak / 2**30  # dzctl plan's per_gpu_gib
        lines.append(
            f"| {path.parent.name} | micro {plan_then['micro_batch_size']} × {plan.gradient_accumulation_steps}, "
            f"{plan_then['checkpointed_layers']}/18 checkpointed, offload optimizer | "
            f"{measured:,.0f} ({result['median_step_s']:.2f} s) | "
            f"{cells[0]} | {cells[1]} | {result['predicted_peak_gib']:.2f} then, {today_peak:.2f} today / {peak:.2f} "
            f"({today_peak / peak - 1:+.1%} today) |"
        )
    return lines


def flight_recorder(folder: Path) -> list[str]:
    traces = sorted(folder.glob("hang-flight-recorder/dzctl-ranks/*/nccl-trace-rank-*"))
    if not traces:
        return []
    dump = pickle.loads(traces[0].read_bytes())
    entries = dump.get("entries", [])
    last = [(e.get("profiling_name"), e.get("collective_seq_id")) for e in entries[-3:]]
    probe = json.loads((folder / "hang-flight-recorder/probe.json").read_text(encoding="utf-8"))
    return [
        f"flight recorder ({traces[0].name}): {len(entries)} entries, last {last}; "
        f"rank state {probe['state']}, stack via {probe['stack_via']}"
    ]


def grids_table(folder: Path) -> list[str]:
    lines = []
    for path in sorted(folder.glob("recompute-*.json")):
        grid = json.loads(path.read_text(encoding="utf-8"))
        fit = grid["fit"]
        lines.append(
            f"{path.name}: {grid['device']}, {grid['layers']} layers, lora {grid['lora']}; fit rho {fit['rho']:.3f}, "
            f"C {fit['fixed_tokens']:,.0f} token-times, worst {fit['worst_relative_error']:.1%}"
        )
        for point in grid["points"]:
            if point.get("oom"):
                lines.append(f"  micro {point['micro']}, {point['checkpointed']} checkpointed: out of memory")
            else:
                lines.append(
                    f"  micro {point['micro']}, {point['checkpointed']} checkpointed: {point['tokens_per_s']:,.0f} "
                    f"tokens/s, {point['median_step_s']:.3f} s, peak {point['peak_allocated_gib']:.2f} GiB"
                )
    return lines


def _line_value(text: str, start: str, after: str, until: str) -> str:
    line = next((x for x in text.splitlines() if start in x), "")
    return line.split(after, 1)[1].split(until, 1)[0] if after in line else "?"


def other_launches_table(folder: Path) -> list[str]:
    lines = [
        "| launch | plan (the launch's own) | measured useful tokens/s (step) | predicted tokens/s | "
        "measured peak GiB |",
        "|---|---|---|---|---|",
    ]
    names = ["lora-*", "before-lora-*", "dpo-*", "sftpairs-*", "full12-*", "bf16-full*", "synth-*"]
    if not (folder / "offload-rates.json").is_file():  # else in the offload launches' table
        names.append("off-*")
    for path in sorted(p for pattern in names for p in folder.glob(f"{pattern}/summary.json")):
        result = json.loads(path.read_text(encoding="utf-8"))["results"][0]
        runs = (path.parent / "runs.log").read_text(encoding="utf-8")
        if "useful_tokens_per_s_per_gpu" not in result:
            error = next((x for x in runs.splitlines() if x.startswith("error: ")), "no step measured")
            lines.append(f"| {path.parent.name} | failed: {error.split(': ', 2)[-1]} |")
            continue
        micro = _line_value(runs, "dzctl-train: 1 ranks", "micro-batch ", ",")
        accumulation = _line_value(runs, "dzctl-train: 1 ranks", "accumulation ", ",")
        checkpointing = _line_value(runs, "dzctl-train: 1 ranks", "gradient checkpointing ", ",")
        predicted = _line_value(runs, "predicted step:", "micro-step, ", " tokens/s")
        lines.append(
            f"| {path.parent.name} | micro {micro} x {accumulation}, checkpointing {checkpointing} | "
            f"{result['useful_tokens_per_s_per_gpu']:,.0f} ({result['median_step_s']:.2f} s) | {predicted} | "
            f"{result['peak_allocated_gib'][0]:.2f} |"
        )
    return lines if len(lines) > 2 else []


def ceiling_table(folder: Path) -> list[str]:
    """The plain-PyTorch ceiling (``plain-pytorch-L.json``: benchmarks/plain_pytorch_ceiling.py) against dzctl's
    launch of the same L layers on the same full random rows in the same call (``synth-fullL-*``, and
    ``synth-bf16-fullL-*`` with ``train.pure_bf16``: bf16 master weights and AdamW states, as the ceiling's)."""
    lines = []
    for path in sorted(folder.glob("plain-pytorch-*.json")):
        ceiling = json.loads(path.read_text(encoding="utf-8"))
        measured = [x for x in ceiling["points"] if not x.get("oom")]
        best = max(measured, key=lambda x: x["tokens_per_s"])
        lines.append(
            f"{path.name}: {ceiling['device']}, {ceiling['layers']} layers, seq {ceiling['seq']}, global batch "
            f"{ceiling['global_batch']} rows, bf16 weights and AdamW states, no DeepSpeed: "
            + "; ".join(
                f"micro {x['micro']}: " + ("out of memory" if x.get("oom") else f"{x['tokens_per_s']:,.0f} tokens/s")
                for x in ceiling["points"]
            )
        )
        launches = [*folder.glob(f"synth-full{ceiling['layers']}-*/summary.json")]
        launches += folder.glob(f"synth-bf16-full{ceiling['layers']}-*/summary.json")
        for launch in sorted(launches):
            result = json.loads(launch.read_text(encoding="utf-8"))["results"][0]
            if "useful_tokens_per_s_per_gpu" not in result:
                continue
            plan = result["plan"]
            tokens = result["useful_tokens_per_s_per_gpu"]
            states = "bf16" if plan["ds_config"]["bf16"].get("bf16_optimizer_states") else "fp32"
            lines.append(
                f"  {launch.parent.name} (dzctl launch, auto: micro {plan['micro_batch_size']}, "
                f"{plan['checkpointed_layers']}/{plan['decoder_layers']} recomputed, {states} master and AdamW "
                "states): "
                f"{tokens:,.0f} tokens/s = {tokens / best['tokens_per_s']:.1%} of the ceiling's best (micro "
                f"{best['micro']}, {best['tokens_per_s']:,.0f})"
            )
    return lines


TUNE_CANDIDATE = re.compile(
    r"tune: candidate (\d+)/\d+: micro-batch (\d+), checkpointing (?:off|on in (\d+) of \d+ layers)"
)
TUNE_WARMUP = re.compile(r"^===== tune: .* --warmup (\d+)")
PREDICTED = re.compile(r"predicted step: .* micro-step, ([\d,]+) tokens/s/GPU")


def _first_match(pattern: re.Pattern, lines: list[str]) -> re.Match | None:
    return next((found for line in lines if (found := pattern.search(line))), None)


def tune_warmup(runs: list[str]) -> int:
    """The steps a tune left out of each candidate's median: the ``--warmup`` of its command line (the first line of
    its ``runs.log``), dzctl tune's default where it gave none."""
    from orchestrator.backends.tune import TuneOptions

    given = _first_match(TUNE_WARMUP, runs[:1])
    return int(given[1]) if given else TuneOptions.warmup


def candidate_events(folder: Path, rank: int) -> list[dict]:
    """A tune candidate's progress events (``progress-cN-*.jsonl``); none where it was cut in its launch."""
    progress = next(folder.glob(f"progress-c{rank}-*.jsonl"), None)
    lines = progress.read_text(encoding="utf-8").splitlines() if progress else []
    return [json.loads(x) for x in lines if x.strip()]


def tune_from_progress(folder: Path) -> dict:
    """A tune cut by its time limit (empty tune.json): its candidates rebuilt as ``dzctl tune`` measures them, the
    median of rank 0's tokens/s over the steps after the tune's own warm-up (``tune_warmup``) from its progress
    events, each candidate's prediction from its launch's ``predicted step`` line in ``runs.log``."""
    from orchestrator.backends.tune import median_tokens_per_s

    runs = (folder / "runs.log").read_text(encoding="utf-8").splitlines()
    warmup = tune_warmup(runs)
    candidates = []
    for index, line in enumerate(runs):
        found = TUNE_CANDIDATE.search(line)
        if not found:
            continue
        rank, micro, checkpointed = int(found[1]), int(found[2]), int(found[3] or 0)
        offload = "optimizer" if line.rstrip().endswith("offload optimizer") else "none"  # the candidate line's own
        # The candidate's own closing line has its prediction ("the model predicted N"); one cut before it closed
        # has the predicted step of its launch, which follows the candidate's line.
        closed = re.compile(rf"tune: candidate {rank}: .*the model predicted ([\d,]+)\)")
        predicted = _first_match(closed, runs) or _first_match(PREDICTED, runs[index:])
        events = candidate_events(folder, rank)
        measured = median_tokens_per_s(events, warmup)  # as dzctl tune measures each candidate
        candidates.append({
            "model_rank": rank, "micro_batch_size": micro, "checkpointed_layers": checkpointed, "offload": offload,
            "tokens_per_s": measured,
            "predicted_tokens_per_s": float(predicted[1].replace(",", "")) if predicted else None,
            "error": None if measured else "no step after the warm-up (cut by the time limit)",
            "steps": [e["step"] for e in events if e["event"] == "step"],
        })  # fmt: skip
    return {"kind": "from progress events: the tune was cut by its time limit", "key": "-", "candidates": candidates}


def tune_table(folder: Path) -> list[str]:
    """Each ``dzctl tune --top N`` (tune-*/tune.json): the planner's choice (rank 1) against the fastest measured."""
    lines = []
    for path in sorted(folder.glob("tune-*/tune.json")):
        text = path.read_text(encoding="utf-8").strip()
        tuned = json.loads(text) if text else tune_from_progress(path.parent)
        done = [c for c in tuned["candidates"] if c.get("tokens_per_s")]
        if not done:
            continue
        fastest = max(c["tokens_per_s"] for c in done)
        lines += [f"{path.parent.name} ({tuned['kind']}, {tuned['key']}):",
                  "| rank | micro | recomputed | offload | measured tokens/s | predicted | predicted / measured |"
                  " of the fastest |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in tuned["candidates"]:
            measured = c.get("tokens_per_s")
            if not measured:
                lines.append(f"| {c['model_rank']} | {c['micro_batch_size']} | {c['checkpointed_layers']} | "
                             f"{c['offload']} | {c.get('error') or 'not run'} | | | |")  # fmt: skip
                continue
            lines.append(
                f"| {c['model_rank']} | {c['micro_batch_size']} | {c['checkpointed_layers']} | {c['offload']} | "
                f"{measured:,.0f} | {c['predicted_tokens_per_s']:,.0f} | "
                f"{c['predicted_tokens_per_s'] / measured - 1:+.1%} | {measured / fastest:.1%} |"
            )
        lines.append("")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args().folder
    for title, lines in (
        ("offload rates", rates_table(folder)),
        ("offload launches", launches_table(folder)),
        ("NCCL flight recorder", flight_recorder(folder)),
        ("recompute grids", grids_table(folder)),
        ("other launches", other_launches_table(folder)),
        ("plain-PyTorch ceiling", ceiling_table(folder)),
        ("dzctl tune: the planner's candidates, each measured", tune_table(folder)),
    ):
        if not lines:
            continue
        print(f"## {title}")
        print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
