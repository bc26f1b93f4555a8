"""The restart policy (issue 31): which failures restart, which never do, and which spare takes a node's place.

Pure: the job statuses are built by observe.status's own first_failure from node states as the
hosts report them, and the spec's restart: section is loaded from a real job file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.backends.recovery.policy import decide, failure_cause
from orchestrator.backends.recovery.spares import WORLD_SIZE_CONVERSION, replace_failed, spare_candidates
from orchestrator.errors import HostfileError, RuntimeFailure, SpecError
from orchestrator.observe.status import JobStatus, NodeStatus, first_failure
from orchestrator.spec.hostfile import Node, parse_hostfile
from orchestrator.spec.job import load_job
from orchestrator.spec.recovery import RestartSpec

ROOT = Path(__file__).resolve().parents[1]


def _status(nodes: list[NodeStatus], details: dict[int, dict] | None = None, reasons=None) -> JobStatus:
    failure = first_failure(nodes, reasons or {}, details=details)
    return JobStatus("j", "j-1", "failed", nodes, None, None, failure)


def _node(rank, state="exited", code=0, oom=False, at=100.0):
    return NodeStatus(f"node{rank}", rank, state, code, oom, at)


POLICY = RestartSpec(max=2, final_exit_codes=[3])


def test_a_killed_node_is_a_lost_node_and_restarts():
    status = _status([_node(0, code=75, at=101.0), _node(1, code=137, at=100.0)])
    verdict = decide(status, POLICY, restarts_done=0)
    assert (verdict.cause, verdict.restart) == ("node-lost", True)
    assert "node 1 (node1) was killed (exit 137)" in verdict.why and "restart 1 of 2" in verdict.why


def test_an_unreachable_node_is_lost_even_when_only_the_gang_stopped_node_has_an_exit():
    status = _status([_node(0, code=75), NodeStatus("node1", 1, "unreachable", None, False, None, "refused")])
    assert failure_cause(status)[0] == "node-lost"
    assert "node 1 (node1: unreachable)" in failure_cause(status)[1]


def test_a_crashed_rank_and_a_collective_timeout_restart():
    crashed = _status([_node(0, code=1), _node(1, code=75)], reasons={0: "RuntimeError: CUDA error: ECC"})
    assert decide(crashed, POLICY, 0).cause == "rank-failed" and decide(crashed, POLICY, 0).restart
    timeout = _status(
        [_node(0, code=1), _node(1, code=75)],
        reasons={0: "RuntimeError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE)"},
    )
    assert decide(timeout, POLICY, 0).cause == "nccl-timeout" and decide(timeout, POLICY, 0).restart


CRASHED = [_node(0, code=1), _node(1, code=75)]  # torchrun's 1 on node 0; node 1 stopped by the gang
OOM_MESSAGE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.mark.parametrize(
    ("nodes", "details", "cause"),
    [
        # A data row the trainer refused: the rank's own exit 2.
        (CRASHED, {0: {"rank": 0, "exit_code": 2, "message": "data.jsonl:row 7"}}, "input-error"),
        (CRASHED, {0: {"rank": 0, "exit_code": 1, "message": OOM_MESSAGE}}, "out-of-memory"),
        ([_node(0, code=137, oom=True), _node(1, code=75)], None, "out-of-memory"),  # the host's OOM killer
        (CRASHED, {0: {"rank": 0, "exit_code": 3, "message": "labels"}}, "final-exit-code"),
    ],
)
def test_what_no_restart_can_fix_never_restarts(nodes, details, cause):
    verdict = decide(_status(nodes, details), POLICY, restarts_done=0)
    assert (verdict.cause, verdict.restart) == (cause, False), verdict


def test_the_limit_the_causes_listed_and_no_policy():
    lost = _status([_node(0, code=75), _node(1, code=137)])
    assert not decide(lost, POLICY, restarts_done=2).restart
    assert "restart limit reached (2 of restart.max 2)" in decide(lost, POLICY, 2).why
    only_crashes = RestartSpec(on=["rank-failed"])
    assert "restart.on does not list node-lost" in decide(lost, only_crashes, 0).why
    assert not decide(lost, None, 0).restart


def test_the_restart_section_loads_and_refuses_unknown_keys_with_their_line(tmp_path):
    job = tmp_path / "job.yaml"
    base = (ROOT / "jobs/tiny-cpu.yaml").read_text()
    job.write_text(base + "restart:\n  max: 1\n  spare_hosts: [node9]\n  backof_s: 3\n")
    with pytest.raises(SpecError) as raised:
        load_job(job)
    line = len(base.splitlines()) + 4
    assert f"{job}:{line}: restart.backof_s" in raised.value.message and "backoff_s" in raised.value.message
    job.write_text(base + "restart:\n  max: 1\n  on: [node-lost]\n  spare_hosts: ['node9 slots=1']\n")
    loaded = load_job(job)
    assert loaded.spec.restart == RestartSpec(max=1, on=["node-lost"], backoff_s=30.0, spare_hosts=["node9 slots=1"])
    assert loaded.spec.notify is None and loaded.spec.train.save_minutes is None


def test_a_spare_takes_the_failed_nodes_rank_and_slots():
    nodes = [Node("a", (0, 1)), Node("b", (2, 3)), Node("c", (0, 1))]
    unused = [e for e in parse_hostfile("a slots=2\nb slots=4\nc slots=2\nd slots=2\n", "hosts.txt") if e.host == "d"]
    spares = spare_candidates(["e"], "job.yaml:9", unused, "hosts.txt")
    listed = "restart.spare_hosts[0] (job.yaml:9)"
    assert [(s.host, s.slots, s.source) for s in spares] == [("e", None, listed), ("d", 2, "hosts.txt line 4")]
    new, replaced = replace_failed(nodes, {"b"}, spares, tried=set())
    assert new == [Node("a", (0, 1)), Node("e", (0, 1)), Node("c", (0, 1))]
    assert [r.to_dict() for r in replaced] == [{"node_rank": 1, "host": "b", "spare": "e", "source": listed}]
    # e failed in turn: the hostfile's unused line is next.
    again, _ = replace_failed(new, {"e"}, spares, tried={"b"})
    assert [n.host for n in again] == ["a", "d", "c"]


def test_no_spare_left_or_only_one_that_changes_the_world_size_is_refused():
    nodes = [Node("a", (0,)), Node("b", (0,))]
    with pytest.raises(RuntimeFailure, match=r"node 1 \(b\) failed preflight and no spare host is left"):
        replace_failed(nodes, {"b"}, [], tried=set())
    wide = spare_candidates(["w slots=4"], "job.yaml:9", [])
    with pytest.raises(RuntimeFailure) as raised:
        replace_failed(nodes, {"b"}, wide, tried=set())
    assert "w (restart.spare_hosts[0] (job.yaml:9)), has 4 slot(s) where node 1 had 1" in raised.value.message
    assert WORLD_SIZE_CONVERSION in raised.value.fix and "ds_to_universal" in raised.value.fix
    with pytest.raises(HostfileError) as bad:
        spare_candidates(["bad host!"], "job.yaml:9", [])
    assert bad.value.message == "restart.spare_hosts[0] (job.yaml:9):1: unknown token 'host!'; a line is 'HOST slots=N'"
