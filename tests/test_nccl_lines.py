"""The collective check's pure parts: NCCL INFO lines, progress lines, and the verdict.

tests/fixtures/nccl/h200x2-nccl-2.28.9-allreduce-1GiB.log is a real recording: the output of
`torchrun --standalone --nproc_per_node 2 -m orchestrator.train.collective --bytes 1073741824`
with NCCL_DEBUG=INFO on the 2×H200 machine (NCCL 2.28.9, benchmarks/collective_h200.sh, first
GPU call), unedited. It also holds two ranks' records glued into one line, as they arrived.
The other NCCL lines below (IB, SHM, sockets between nodes, which that machine cannot show) are
written from NCCL's own format strings (src/transport/net.cc, shm.cc, src/init.cc,
src/graph/search.cc, 2.18-2.28) with a real line prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.preflight.collective_result import (
    EXPECTED_MIN_BUSBW_GBS,
    NodeWatch,
    Settings,
    describe_collective,
    judge,
    never_joined,
    transport_key,
)
from orchestrator.preflight.nccl_lines import Transports, parse_progress, store_failure, transport_of
from orchestrator.train.collective import MARK, bus_factor

PREFIX = "gpu-node-1:12345:12398 [0] NCCL INFO "
RECORDED = Path(__file__).parent / "fixtures" / "nccl" / "h200x2-nccl-2.28.9-allreduce-1GiB.log"


def progress(event: str, rank: int, node_rank: int = 0, **fields) -> str:
    return MARK + json.dumps({"event": event, "rank": rank, "local_rank": 0, "node_rank": node_rank, **fields})


@pytest.mark.parametrize(
    ("via", "expected"),
    [
        ("P2P/CUMEM/read", ("within", "P2P/CUMEM")),
        ("P2P/IPC", ("within", "P2P/IPC")),
        ("SHM/direct/direct", ("within", "SHM")),
        ("NET/IB/0/GDRDMA", ("between", "NET/IB")),
        ("NET/Socket/1", ("between", "NET/Socket")),
    ],
)
def test_transport_of_a_channel(via, expected):
    assert transport_of(via) == expected


def test_transports_from_nccl_info_lines():
    seen = Transports()
    lines = [
        PREFIX + "Using network IB",
        PREFIX + "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        PREFIX + "Channel 01/0 : 1[1] -> 0[0] via P2P/CUMEM/read",
        PREFIX + "Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA",
        PREFIX + "Channel 00/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA",
        PREFIX + "Channel 02 : 0[0] -> 1[1] via SHM/direct/direct",
        PREFIX + "Pattern 4, crossNic 0, nChannels 16, bw 40.000000/40.000000, type NVL/PIX, sameChannels 1",
        PREFIX + "Pattern 1, crossNic 0, nChannels 16, bw 40.000000/40.000000, type PHB/PIX, sameChannels 1",
    ]
    assert [seen.feed(line) for line in lines] == [True] * len(lines)
    assert seen.to_dict() == {
        "within_node": ["P2P/CUMEM", "SHM"],
        "between_nodes": ["NET/IB"],
        "network": "IB",
        "intra_node_path": "NVL",  # the best path seen, not the last
    }
    assert seen.describe() == "within the node P2P/CUMEM, SHM over NVLink; between nodes NET/IB"
    assert not seen.feed("gpu-node-1:12345:12398 [0] NCCL INFO cudaDriverVersion 13000")
    assert not seen.feed("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read")  # not an NCCL INFO line


def test_progress_lines_and_store_failures():
    assert parse_progress("  " + progress("store", 3, master="10.0.0.1:29500"))["rank"] == 3
    assert parse_progress(MARK + "{not json") is None
    assert parse_progress("an ordinary line") is None
    assert store_failure(
        "[W1130 21:30:01.123 socket.cpp:755] [c10d] The client socket has failed to connect to [node0]:29500 "
        "(errno: 111 - Connection refused)."
    )
    assert not store_failure("NCCL INFO Bootstrap: Using eth0:10.0.0.2<0>")


def test_bus_factor_is_nccl_tests():
    assert [bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]


SETTINGS = Settings(timeout_s=60, size_bytes=256 * 2**20, iters=5, warmup=2)


def watches(n_nodes: int, slots: int = 2) -> list[NodeWatch]:
    out = [NodeWatch(f"node{i}", i, slots, i * slots) for i in range(n_nodes)]
    for watch in out:
        watch.launcher_started = True
    return out


def finish(watch: NodeWatch, busbw: float, world: int) -> None:
    for rank in watch.ranks:
        watch.feed(progress("start", rank, watch.node_rank))
        watch.feed(progress("store", rank, watch.node_rank))
        watch.feed(progress("group", rank, watch.node_rank, form_s=1.5 + rank / 10))
        watch.feed(
            progress(
                "result", rank, watch.node_rank, backend="nccl", dtype="bfloat16", bytes=SETTINGS.size_bytes,
                mean_s=0.001, busbw_gbs=busbw, algbw_gbs=busbw / bus_factor(world), group_mean_s=0.001,
                group_busbw_gbs=busbw, group_algbw_gbs=busbw / bus_factor(world),
            )
        )  # fmt: skip


def test_a_passing_check_reports_figures_per_node_and_for_the_group():
    nodes = watches(2)
    for watch in nodes:
        finish(watch, 20.0, 4)
        watch.feed(PREFIX + "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read")
        watch.feed(PREFIX + "Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA")
    outcome = judge(
        nodes, SETTINGS, formed_in_time=True, elapsed_s=9.0, launch_to_group_s=4.0,
        infiniband_hosts=frozenset({"node0", "node1"}), backend_hint="nccl",
    )  # fmt: skip
    assert outcome.ok
    figures = outcome.figures
    assert figures["busbw_gbs"] == 20.0 and figures["algbw_gbs"] == pytest.approx(20.0 / 1.5)
    assert figures["form_s"] == 1.8 and figures["world_size"] == 4 and figures["dtype"] == "bfloat16"
    assert figures["transports"]["between_nodes"] == ["NET/IB"]
    assert [n["reached"] for n in figures["nodes"]] == [{"0": "result", "1": "result"}, {"2": "result", "3": "result"}]
    assert all(c.status == "ok" for c in outcome.checks.values())
    assert "busbw 20.0 GB/s" in describe_collective(figures)


def test_infiniband_present_but_sockets_used_fails_with_the_runbook():
    nodes = watches(2)
    for watch in nodes:
        finish(watch, 2.0, 4)
        watch.feed(PREFIX + "Using network Socket")
        watch.feed(PREFIX + "Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0")
    outcome = judge(
        nodes, SETTINGS, formed_in_time=True, elapsed_s=9.0, launch_to_group_s=4.0,
        infiniband_hosts=frozenset({"node1"}), backend_hint="nccl",
    )  # fmt: skip
    assert not outcome.ok
    assert outcome.checks["node0"].status == "ok"  # no IB devices there
    assert outcome.checks["node1"].status == "fail"
    assert "InfiniBand devices but NCCL used TCP sockets" in outcome.checks["node1"].detail
    assert "docs/runbooks/nccl-ib-unused.md" in outcome.checks["node1"].fix


def test_bandwidth_far_below_the_transport_warns_with_measured_and_expected():
    nodes = watches(1)
    finish(nodes[0], 40.0, 2)
    nodes[0].feed(PREFIX + "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read")
    nodes[0].feed(PREFIX + "Pattern 4, crossNic 0, nChannels 16, bw 40.000000/40.000000, type NVL/PIX, sameChannels 1")
    outcome = judge(
        nodes, SETTINGS, formed_in_time=True, elapsed_s=5.0, launch_to_group_s=3.0,
        infiniband_hosts=frozenset(), backend_hint="nccl",
    )  # fmt: skip
    check = outcome.checks["node0"]
    assert outcome.ok and check.status == "warn"
    assert "busbw 40.0 GB/s" in check.detail and f"{EXPECTED_MIN_BUSBW_GBS['P2P/NVLink']:g} GB/s" in check.detail
    assert "nccl-slow-collective.md" in check.fix


def test_transport_key_picks_the_slowest_kind_crossed():
    nvlink = Transports(within={"P2P/CUMEM"}, intra_path="NVL")
    assert transport_key(nvlink, multi_node=False) == "P2P/NVLink"
    assert transport_key(Transports(within={"P2P/CUMEM"}, intra_path="PHB"), multi_node=False) == "P2P/PCIe"
    assert transport_key(Transports(within={"SHM"}), multi_node=False) == "SHM"
    mixed = Transports(within={"P2P/CUMEM"}, between={"NET/IB", "NET/Socket"}, intra_path="NVL")
    assert transport_key(mixed, multi_node=True) == "NET/Socket"


def test_a_group_that_did_not_form_names_the_node_and_the_ranks_never_heard_from():
    nodes = watches(3)
    for watch in nodes[:2]:
        finish(watch, 20.0, 6)
    late = nodes[2]
    late.feed(progress("start", 4, 2))
    late.feed(progress("store", 4, 2))
    late.feed(progress("start", 5, 2))
    late.feed(progress("imported", 5, 2))
    late.feed("some other line the launcher printed")
    outcome = judge(
        nodes, SETTINGS, formed_in_time=False, elapsed_s=61.0, launch_to_group_s=None,
        infiniband_hosts=frozenset(), backend_hint="nccl",
    )  # fmt: skip
    assert not outcome.ok
    assert outcome.figures["never_joined"] == ["node2"]
    failure = outcome.figures["failure"]
    assert failure.startswith("the group did not form within 60 s: node 2 (node2) never joined")
    assert failure.endswith("never heard from rank 4, 5")
    detail = outcome.checks["node2"].detail
    assert "rank 5: imported torch, never reached the master's store" in detail
    assert "last output: some other line the launcher printed" in detail
    assert "docs/runbooks/nccl-group-did-not-form.md" in outcome.checks["node2"].fix
    assert "this node joined" in outcome.checks["node0"].detail


def test_before_any_rank_starts_the_workers_are_blamed_not_the_store_host():
    nodes = watches(3, slots=1)
    nodes[2].feed("[W socket.cpp:755] [c10d] The client socket has failed to connect to [node0]:29500 (errno: 113)")
    assert never_joined(nodes) == [nodes[2]]  # the one that said so
    quiet = watches(3, slots=1)
    assert never_joined(quiet) == quiet[1:]  # node 0 hosts the store
    outcome = judge(
        quiet, SETTINGS, formed_in_time=False, elapsed_s=61.0, launch_to_group_s=None,
        infiniband_hosts=frozenset(), backend_hint="gloo",
    )  # fmt: skip
    assert "hosts the master's store" in outcome.checks["node0"].detail
    assert "no rank started" in outcome.checks["node1"].detail


def test_a_rank_error_fails_the_check_with_its_reason():
    nodes = watches(1)
    nodes[0].feed(progress("start", 0))
    nodes[0].feed(progress("error", 1, error="ModuleNotFoundError: No module named 'orchestrator.train.collective'"))
    outcome = judge(
        nodes, SETTINGS, formed_in_time=False, elapsed_s=3.0, launch_to_group_s=None,
        infiniband_hosts=frozenset(), backend_hint="nccl",
    )  # fmt: skip
    assert "rank 1 failed: ModuleNotFoundError" in outcome.figures["failure"]


def test_an_image_without_the_check_module_says_to_rebuild_it():
    nodes = watches(2, slots=1)
    for watch in nodes:
        watch.feed("/usr/bin/python3: Error while finding module specification for 'orchestrator.train.collective'")
        watch.feed("ModuleNotFoundError: No module named 'orchestrator.train.collective'")
        watch.ended = True
    outcome = judge(
        nodes, SETTINGS, formed_in_time=False, elapsed_s=8.0, launch_to_group_s=None,
        infiniband_hosts=frozenset(), backend_hint="gloo",
    )  # fmt: skip
    assert outcome.figures["failure"] == (
        "the group did not form: node 0 (node0), node 1 (node1) never joined; never heard from rank 0, 1"
    )
    assert "the launcher exited" in outcome.checks["node1"].detail
    assert "No module named" in outcome.checks["node1"].detail
    assert outcome.checks["node1"].fix.startswith("the image or Python lacks dzctl's check module: rebuild")


def test_the_recorded_h200_run_reads_as_p2p_over_nvlink_with_both_results():
    watch = NodeWatch("vm", 0, 2, 0)
    watch.launcher_started = True
    for line in RECORDED.read_text().splitlines():
        watch.feed(line)
    assert watch.transports.to_dict() == {
        "within_node": ["P2P/CUMEM"],
        "between_nodes": [],
        "network": "Socket",
        "intra_node_path": "NVL",
    }
    # Rank 0's result and rank 1's arrived glued into one line; both are read.
    assert sorted(watch.results) == [0, 1] and watch.done()
    settings = Settings(timeout_s=60, size_bytes=2**30, iters=5, warmup=2)
    outcome = judge(
        [watch], settings, formed_in_time=True, elapsed_s=5.0, launch_to_group_s=3.2,
        infiniband_hosts=frozenset(), backend_hint="nccl",
    )  # fmt: skip
    assert outcome.ok and outcome.checks["vm"].status == "ok"
    assert outcome.figures["busbw_gbs"] == 312.349 and outcome.figures["dtype"] == "bfloat16"
    assert "within the node P2P/CUMEM over NVLink" in outcome.checks["vm"].detail


def test_glued_records_are_each_read():
    one, two = progress("result", 0, bytes=1), progress("result", 1, bytes=1)
    watch = NodeWatch("h", 0, 2, 0)
    watch.feed(one + two)
    assert sorted(watch.results) == [0, 1]


def test_a_node_whose_ranks_never_started_is_blamed_before_one_waiting_for_it():
    nodes = watches(2, slots=1)
    for step in ("start", "imported", "store"):
        nodes[0].feed(progress(step, 0, 0))  # waits in the group's init for rank 1
    assert never_joined(nodes) == [nodes[1]]
    nodes[1].feed(progress("start", 1, 1))
    nodes[1].feed(progress("imported", 1, 1))
    nodes[1].feed(progress("store", 1, 1))
    assert never_joined(nodes) == nodes  # both wait for each other: both named


def test_a_node_that_finished_and_exited_is_not_blamed():
    nodes = watches(2, slots=1)
    finish(nodes[1], 1.0, 2)
    nodes[1].ended = True  # its container exited after its result: normal
    nodes[1].feed("[W socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3")
    for step in ("start", "imported", "store", "group"):
        nodes[0].feed(progress(step, 0, 0))
    assert never_joined(nodes) == []
    assert nodes[1].store_failure_line is None
