"""ZeRO-3's collectives in the collective check: parsing, aggregation, ``Links.measured`` and the launch line.

tests/fixtures/collective/gloo-2ranks-zero3.txt is a real recording: the ``result`` line of
``python -m orchestrator.train.collective --bytes 8388608 --iters 3 --warmup 1`` under torchrun,
2 gloo ranks on one CPU machine (the real two-node run is asserted in test_collective_e2e.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.planning.speed.atlaunch import measured_links_note
from orchestrator.planning.speed.communication import Layout, Links, ZeroSettings, comm_time, micro_step_collectives
from orchestrator.preflight.collective_result import NodeWatch, Settings, describe_collective, judge, zero3_figures
from orchestrator.train.collective import MARK, gather_factor

RECORDED = Path(__file__).parent / "fixtures" / "collective" / "gloo-2ranks-zero3.txt"
SETTINGS = Settings(timeout_s=60, size_bytes=8 * 2**20, iters=3, warmup=1)


def recorded() -> dict:
    return json.loads(RECORDED.read_text().strip().removeprefix(MARK))


def judged(n_nodes: int) -> dict:
    """The recorded result as every rank's line, over ``n_nodes`` nodes of 2 ranks."""
    result = recorded()
    watches = []
    for node in range(n_nodes):
        watch = NodeWatch(f"node{node}", node, 2, 2 * node, launcher_started=True)
        for rank in watch.ranks:
            for event in ("start", "store", "group"):
                watch.feed(MARK + json.dumps({"event": event, "rank": rank, "node_rank": node, "form_s": 1.0}))
            watch.feed(MARK + json.dumps({**result, "rank": rank, "node_rank": node}))
        watches.append(watch)
    outcome = judge(
        watches, SETTINGS, formed_in_time=True, elapsed_s=5.0, launch_to_group_s=2.0,
        infiniband_hosts=frozenset(), backend_hint="gloo",
    )  # fmt: skip
    assert outcome.ok
    return outcome.figures


def test_gather_factor_is_nccl_tests():
    assert gather_factor(1) == 0.0 and gather_factor(2) == 0.5 and gather_factor(8) == 7 / 8


def test_the_group_figures_of_each_zero3_collective_are_kept_and_the_all_reduce_fields_unchanged():
    figures = judged(1)
    # The existing contract: the all-reduce's group figures under their old names.
    assert figures["busbw_gbs"] == 1.038 and figures["mean_s"] == 0.008083 and figures["bytes"] == 8388608
    zero3 = figures["zero3"]
    assert zero3["scope"] == "intra"  # one node: no network in the ring
    assert zero3["all_gather"] == {"bytes": 8388608, "mean_s": 0.010293, "busbw_gbs": 0.408, "latency_s": 0.000327}
    assert zero3["reduce_scatter"] == {"bytes": 8388608, "mean_s": 0.015047, "busbw_gbs": 0.279, "latency_s": 0.0003853}
    assert zero3["all_reduce_latency_s"] == 0.0002636
    line = describe_collective(figures)
    assert "all-gather 0.408 GB/s busbw (latency 327 µs)" in line and "reduce-scatter 0.279 GB/s" in line
    assert line.endswith("within the node")


def test_several_nodes_make_the_figures_the_inter_node_bound():
    figures = judged(2)
    assert figures["zero3"]["scope"] == "inter" and describe_collective(figures).endswith("between nodes")


def test_a_node_with_an_older_check_module_gives_no_zero3_figures():
    old = {k: v for k, v in recorded().items() if not k.startswith(("all_gather", "reduce_scatter", "all_reduce_"))}
    assert zero3_figures(old, multi_node=True) is None
    assert Links.measured({"ok": True, "zero3": None}, 1e11) is None


def test_links_measured_between_nodes_feeds_the_model_with_each_collectives_bandwidth_and_latency():
    links = Links.measured(judged(2), intra_bytes_per_s=300e9)
    assert links.inter_bytes_per_s == pytest.approx(0.408e9)
    assert links.inter_reduce_bytes_per_s == pytest.approx(0.279e9)
    assert links.inter_latency_s == pytest.approx(0.0003853)  # the slower of the two calls
    assert links.intra_bytes_per_s == 300e9 and "measured by the collective check" in links.source
    layout = Layout(gpus_per_node=2, nodes=2)
    assert links.latency_s(4, 2) == pytest.approx(0.0003853)
    # The measured reduce-scatter bandwidth is what the gradient reduce-scatter takes.
    collectives = micro_step_collectives(
        [100_000], [100_000], [100_000], zero=ZeroSettings(50_000, 50_000, 0), layout=layout,
        param_bytes=2, grad_bytes=2,
    )  # fmt: skip
    comm = comm_time(collectives, layout=layout, links=links)
    reduce = next(c for c in collectives if c.name == "gradient reduce-scatter")
    assert comm.last_reduce_s == pytest.approx(0.75 * reduce.total_bytes / 0.279e9 / reduce.calls + 0.0003853)


def test_links_measured_on_one_node_are_the_intra_node_figures():
    links = Links.measured(judged(1), intra_bytes_per_s=300e9)
    assert links.inter_bytes_per_s is None
    assert links.intra_bytes_per_s == pytest.approx(0.279e9) and links.intra_latency_s == pytest.approx(0.0003853)


def test_nothing_measured_means_no_links_and_the_launch_says_why():
    assert Links.measured(None, 1e11) is None
    skipped = {"ran": False, "ok": None, "reason": "skipped (--skip-collective)"}
    assert Links.measured(skipped, 1e11) is None
    assert Links.measured({**judged(2), "ok": False}, 1e11) is None  # a failed check measured nothing to plan with
    line = measured_links_note(skipped)
    assert line.startswith("step-time links: not measured (skipped (--skip-collective))") and "--link-gbps" in line
    measured = measured_links_note(judged(2))
    assert "all-gather 0.408 GB/s" in measured and "between nodes" in measured and "385 µs" in measured
