"""The step-time model at launch: preflight's GPU name and the collective check's links plan ZeRO's settings.

``dzctl plan`` takes the GPU kind and the link speed from flags; ``launch`` has both measured
(nvidia-smi's name, the check's all-gather and reduce-scatter). The GPU name here is the
recorded H200 output (tests/fixtures/h200x2), the links the recorded gloo check
(tests/fixtures/collective), as every rank of 2 nodes would report it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from test_collective_zero3 import judged

from orchestrator.commands.jobs import render_status
from orchestrator.commands.ranks import ranks_by_node
from orchestrator.observe.lines import event_line
from orchestrator.observe.status import JobStatus
from orchestrator.observe.store import JobStore
from orchestrator.observe.view import render
from orchestrator.observe.watchstate import JobWatch, NodeView
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.launchplan import make_plan
from orchestrator.planning.memory.fromjob import plan_for_job
from orchestrator.planning.resolve import resolve_job
from orchestrator.planning.speed.atlaunch import predicted_step_line, speed_inputs_at_launch, speed_notes
from orchestrator.preflight.parsers import parse_gpu_query
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job

REPO = Path(__file__).resolve().parents[1]
H200_NAME = parse_gpu_query((REPO / "tests/fixtures/h200x2/query-gpu.csv").read_text())[0].name
SKIPPED = {"ran": False, "ok": None, "reason": "skipped (--skip-collective)"}


def _hosts(tmp_path: Path, nodes: int, slots: int) -> Path:
    path = tmp_path / f"{nodes}x{slots}.txt"
    path.write_text("".join(f"gpu{i} slots={slots}\n" for i in range(nodes)))
    return path


def _measured_plan(tmp_path: Path):
    """Qwen3-8B on 2 × 8 H200 whose link measured the recorded gloo figures (0.4 GB/s): the model's worst case."""
    nodes = load_nodes(_hosts(tmp_path, 2, 8))
    speed, _ = speed_inputs_at_launch(judged(2), {n.host: H200_NAME for n in nodes}, len(nodes))
    job = load_job(REPO / "jobs/qwen3-8b.yaml", ["train.gradient_accumulation_steps=1"])
    inputs = read_inputs(job)
    memory, ds_config = plan_for_job(inputs, [8, 8], gpu_mem_gib=140, host_mem_gib=1024, speed=speed)
    return job, inputs, nodes, memory, ds_config


def test_the_recorded_h200_name_and_two_nodes_measured_links_are_the_models_inputs():
    assert H200_NAME == "NVIDIA H200"
    speed, line = speed_inputs_at_launch(judged(2), {"gpu0": H200_NAME, "gpu1": H200_NAME}, 2)
    assert speed.gpu.name == "H200"
    assert speed.links.inter_bytes_per_s == pytest.approx(0.408e9)  # the check's all-gather, between nodes
    assert speed.links.inter_reduce_bytes_per_s == pytest.approx(0.279e9)
    assert speed.links.intra_bytes_per_s == speed.gpu.intra_bytes_per_s  # within a node: the kind's NVLink
    assert line.startswith("step-time links: measured by the collective check") and "385 µs" in line


def test_zero_settings_are_chosen_on_the_measured_links_and_said_at_launch(tmp_path):
    _, _, _, memory, ds_config = _measured_plan(tmp_path)
    speed = memory.speed
    assert speed.links_source.startswith("measured by the collective check") and speed.gpu == "H200"
    # At 0.4 GB/s between nodes plain ZeRO-3 is communication-bound: hpZ (GPUs per node) is chosen
    # because it is predicted faster, and its secondary copy is counted in the memory that fits.
    assert ds_config["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert speed.step.step_s < speed.plain.step_s
    assert memory.estimate.gpu_terms["hpZ secondary weights"] > 0
    line = predicted_step_line(speed)
    # The H200's measured MFU, scaled to this plan's micro-batch and checkpointed layers.
    assert speed.mfu_source.startswith("measured (H200, loss liger") and 0.4 < speed.mfu < 0.8
    assert line.startswith("predicted step: ") and f"communication-bound (H200, MFU {speed.mfu:.1%}; hpZ 8," in line
    said = speed_notes(speed)
    assert any(n.startswith("note: hpZ on (zero_hpz_partition_size 8)") for n in said)
    assert said[-1].startswith("warning: communication-bound: predicted at") and "Gbit/s per node" in said[-1]


def test_without_measured_links_several_nodes_keep_zeros_defaults_and_one_node_uses_nvlinks_figure():
    names = {"gpu0": H200_NAME, "gpu1": H200_NAME}
    speed, line = speed_inputs_at_launch(SKIPPED, names, 2)
    assert speed is None and "not measured (skipped (--skip-collective))" in line and "--link-gbps" in line
    one, line = speed_inputs_at_launch(SKIPPED, {"gpu0": H200_NAME}, 1)
    assert one.links.inter_bytes_per_s is None and one.links.intra_bytes_per_s == 302e9
    assert line == "step-time links: intra-node H200 default (not measured: skipped (--skip-collective))"


@pytest.mark.parametrize(
    ("names", "why"),
    [
        ({"gpu0": "Tesla V100-SXM2-32GB"}, "a GPU kind not in the step-time model's table: Tesla V100-SXM2-32GB"),
        ({"gpu0": "NVIDIA H100 80GB HBM3", "gpu1": "NVIDIA A100-SXM4-80GB"}, "different GPU kinds"),
        ({}, "preflight read no GPU name"),
    ],
)
def test_an_unknown_or_mixed_gpu_kind_predicts_nothing_and_says_why(names, why):
    speed, line = speed_inputs_at_launch(judged(2), names, max(len(names), 1))
    assert speed is None and why in line and line.startswith("step time: not predicted")


def test_the_job_record_keeps_the_prediction_and_status_and_the_view_compare_the_measured_rate(tmp_path):
    job, inputs, nodes, memory, ds_config = _measured_plan(tmp_path)
    launch_plan = make_plan(job.spec, nodes, "qwen3-8b-20261204-000000-abcd", master_addr="10.0.0.1")
    resolved = resolve_job(inputs, nodes, memory, ds_config, launch_plan, None)
    from orchestrator.backends.start import record_plan

    with JobStore(tmp_path / "jobs.sqlite") as store:
        store.add(job_id=launch_plan.job_id, name="qwen3-8b", runtime="docker", image="img", hosts=["gpu0", "gpu1"],
                  spec={"accelerator": "gpu"}, plan=record_plan(resolved), ssh_config=None)  # fmt: skip
        record = store.get(launch_plan.job_id)
    speed = record.plan["speed"]
    assert speed == json.loads(json.dumps(memory.speed.to_dict())) and speed["bound"] == "communication"
    predicted = speed["tokens_per_s_per_gpu"]

    # status: the last step's useful rate over its padding efficiency is the processed rate the model predicts.
    progress = {"step": 5, "max_steps": 100, "tokens_per_s": predicted * 16 * 0.9 * 0.5, "padding_efficiency": 0.5}
    status = JobStatus("qwen3-8b", record.job_id, "running", [], progress, 1.0, None, speed=speed)
    text = render_status(status, ranks_by_node(record.plan["nodes"]))
    assert f"plan: predicted {predicted:,.0f} tok/s/GPU (communication-bound), measured " in text
    assert "(-10%)" in text
    assert "warning: communication-bound: predicted at" in text

    # the live view and the plain lines: the same comparison, and the warning said where the run begins.
    nodes_view = [NodeView(n["node_rank"], n["host"], n["slots"]) for n in record.plan["nodes"]]
    watch = JobWatch("qwen3-8b", record.job_id, nodes_view, started_at=0.0, speed=speed)
    start = {"event": "start", "step": 0, "max_steps": 100, "world_size": 16}
    watch.feed(0, "dzctl-progress " + json.dumps(start), 1.0)
    line = event_line(start, watch)
    assert f"; predicted {predicted:,.0f} tok/s/GPU (communication-bound)" in line.splitlines()[0]
    assert line.splitlines()[1].startswith("warning: communication-bound")
    step = {"event": "step", "step": 1, "max_steps": 100, "loss": 2.0, "tokens_per_s": predicted * 16 * 1.2}
    watch.feed(0, "dzctl-progress " + json.dumps(step), 2.0)
    console = Console(width=200, record=True, color_system=None, force_terminal=False)
    console.print(render(watch, now=3.0))
    shown = console.export_text()
    assert f"predicted {predicted:,.0f} tok/s/GPU (communication-bound), measured" in shown and "(+20%)" in shown
    assert "warning: communication-bound: predicted at" in shown


def test_a_job_without_a_prediction_shows_no_plan_line():
    status = JobStatus("tiny", "tiny-1", "running", [], {"step": 1, "max_steps": 2, "tokens_per_s": 10.0}, 1.0, None)
    assert "plan:" not in render_status(status, {}) and "warning" not in render_status(status, {})
