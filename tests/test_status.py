"""Job state from node states and progress.jsonl (pure), and the node-side supervisor (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from orchestrator.observe.status import (
    NodeStatus,
    derive_state,
    error_on_node,
    failure_sequence,
    failure_sequence_in_log,
    first_failure,
    parse_progress,
)
from orchestrator.runtimes.control import parse_inspect


def node(rank, state, exit_code=None, finished=None, oom=False):
    return NodeStatus(f"h{rank}", rank, state, exit_code, oom, finished)


@pytest.mark.parametrize(
    ("record", "nodes", "expected"),
    [
        ("running", [node(0, "running"), node(1, "running")], "running"),
        ("running", [node(0, "exited", 0, 5.0), node(1, "exited", 0, 6.0)], "succeeded"),
        ("running", [node(0, "running"), node(1, "exited", 137, 5.0)], "failed"),
        ("running", [node(0, "exited", 75, 9.0), node(1, "exited", 137, 5.0)], "failed"),
        ("stopped", [node(0, "missing"), node(1, "missing")], "stopped"),
        # A stop that failed on a node (its dockerd down, an unkillable rank): the nodes win over the record.
        ("stopped", [node(0, "running"), node(1, "running")], "running"),
        ("stopped", [node(0, "missing"), node(1, "running")], "running"),
        ("starting", [node(0, "missing"), node(1, "created")], "pending"),
        ("succeeded", [node(0, "missing"), node(1, "missing")], "succeeded"),
        ("running", [node(0, "missing"), node(1, "running")], "failed"),
        ("running", [node(0, "dead"), node(1, "running")], "failed"),
    ],
)
def test_derive_state(record, nodes, expected):
    assert derive_state(record, nodes) == expected


def test_first_failure_is_the_earliest_end():
    nodes = [node(0, "exited", 75, 20.0), node(1, "exited", 137, 3.0), node(2, "exited", 0, 1.0)]
    assert first_failure(nodes, {}) == {
        "node_rank": 1,
        "host": "h1",
        "rank": None,
        "exit_code": 137,
        "node_exit_code": 137,
        "reason": "killed (SIGKILL, exit 137): OOM killer, docker kill, or a lost node",
        "message": "killed (SIGKILL, exit 137): OOM killer, docker kill, or a lost node",
        "fix": None,
    }
    assert first_failure(nodes, {1: "RuntimeError: boom"})["reason"] == "RuntimeError: boom"
    assert first_failure([node(0, "exited", 0, 1.0)], {}) is None


def test_progress_from_the_last_step_and_the_error_reason():
    lines = [
        {"event": "start", "time": 100.0, "step": 0, "max_steps": 30},
        {"event": "step", "time": 110.0, "step": 5, "max_steps": 30, "loss": 2.5, "tokens_per_s": 900.0, "eta_s": 50},
        {"event": "error", "time": 111.0, "reason": "CUDA out of memory"},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"event": "st'  # a line being written
    progress, age, errors = parse_progress(text, now=121.0)
    assert progress == {
        "step": 5, "max_steps": 30, "loss": 2.5, "tokens_per_s": 900.0, "padding_efficiency": None, "eta_s": 50,
        "step_time_s": None, "event": "step", "grad_norm": None, "eval": None, "stopped_early": False,
    }  # fmt: skip
    assert age == 10.0
    assert errors == [{"rank": None, "reason": "CUDA out of memory"}]
    # A relaunch into the same output dir: the earlier run's lines are not this job's progress.
    mine = json.dumps({"event": "start", "time": 130.0, "step": 0, "max_steps": 9, "job_id": "j-2"})
    assert parse_progress(text + "\n" + mine, now=131.0, job_id="j-2") == (
        {
            "step": 0,
            "max_steps": 9,
            "loss": None,
            "tokens_per_s": None,
            "padding_efficiency": None,
            "eta_s": None,
            "step_time_s": None,
            "event": "start",
            "grad_norm": None,
            "eval": None,
            "stopped_early": False,
        },
        1.0,
        [],
    )


def test_error_events_are_matched_to_the_node_of_their_rank():
    errors = [{"rank": 3, "reason": "gloo: connection reset"}, {"rank": 1, "reason": "CUDA out of memory"}]
    # Two nodes of 2 slots: ranks 0-1 on node 0, 2-3 on node 1.
    assert error_on_node(errors, [2, 2], 0) == "CUDA out of memory"
    assert error_on_node(errors, [2, 2], 1) == "gloo: connection reset"
    assert error_on_node(errors, [1, 1], 0) is None


def test_docker_inspect_parsing():
    info = [
        {
            "State": {
                "Status": "exited",
                "ExitCode": 137,
                "OOMKilled": True,
                "StartedAt": "2026-11-30T01:00:00.5Z",
                "FinishedAt": "2026-11-30T01:00:10.250000000Z",
                "Error": "",
            }
        }
    ]
    state = parse_inspect("docker", 0, json.dumps(info), "")
    assert (state.state, state.exit_code, state.oom_killed) == ("exited", 137, True)
    assert state.finished_at - state.started_at == pytest.approx(9.75)
    assert parse_inspect("docker", 1, "", "Error: No such container: x").state == "missing"


def _nodeexec(*args):
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.runtimes.process", *args], capture_output=True, text=True, timeout=60
    )


def test_process_supervisor_records_exit_and_survives_its_caller(tmp_path):
    secrets = tmp_path / "env"
    secrets.write_text("API_TOKEN=s3cret\n")
    secrets.chmod(0o600)
    started = _nodeexec(
        "start", "--job-dir", str(tmp_path), "--rank", "1", "--env-file", str(secrets), "--env", "GREETING=hi",
        "--", "sh", "-c", 'echo "$GREETING $API_TOKEN"; sleep 1; echo bye >&2; exit 3',
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    pid = json.loads(started.stdout)["pid"]
    # The secret reached the process through the file, not its argv.
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        assert b"s3cret" not in handle.read()
    followed = _nodeexec("follow", "--job-dir", str(tmp_path), "--rank", "1")
    assert followed.stdout == "hi s3cret\nbye\n"
    status = json.loads(_nodeexec("status", "--job-dir", str(tmp_path), "--rank", "1").stdout)
    assert (status["state"], status["exit_code"]) == ("exited", 3)


def test_process_supervisor_stop_kills_the_whole_group(tmp_path):
    started = _nodeexec(
        "start", "--job-dir", str(tmp_path), "--rank", "0", "--", "sh", "-c", "sleep 300 & sleep 300; wait"
    )
    assert started.returncode == 0, started.stderr
    pid = json.loads(started.stdout)["pid"]
    assert json.loads(_nodeexec("status", "--job-dir", str(tmp_path), "--rank", "0").stdout)["state"] == "running"
    t0 = time.monotonic()
    assert _nodeexec("stop", "--job-dir", str(tmp_path), "--rank", "0", "--grace", "2").returncode == 0
    assert time.monotonic() - t0 < 15
    status = json.loads(_nodeexec("status", "--job-dir", str(tmp_path), "--rank", "0").stdout)
    assert (status["state"], status["exit_code"]) == ("exited", 143)
    # Nothing of the group is left (allowing the kernel a moment to reap the killed).
    deadline = time.monotonic() + 5
    while subprocess.run(["pgrep", "-g", str(pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "processes of the stopped rank are still alive"
        time.sleep(0.1)


def test_first_failure_ignores_node_clocks_when_the_gang_watchdog_says_who_stopped_whom():
    """Node 1 was killed; node 0's watchdog stopped it later, but node 0's clock runs 60 s behind, so
    by end times node 0 "failed first". Its log says the gang stopped it: node 1 is the first failure."""
    nodes = [node(0, "exited", 137, 1000.0), node(1, "exited", 137, 1045.0)]
    assert first_failure(nodes, {}, gang_stopped={0})["node_rank"] == 1
    assert first_failure(nodes, {})["node_rank"] == 0  # with nothing but clocks, clocks decide
    # The watchdog's own exit code says the same when the rank ended itself (no launcher to kill).
    assert first_failure([node(0, "exited", 75, 1.0), node(1, "exited", 1, 9.0)], {})["node_rank"] == 1


def test_first_failure_follows_the_stores_sequence_over_end_times():
    # Both ranks raised and reported to the store: node 1 first (sequence 1), though its clock says later.
    nodes = [node(0, "exited", 1, 10.0), node(1, "exited", 1, 70.0)]
    text = "\n".join(
        json.dumps({"event": "error", "time": t, "rank": rank, "reason": f"boom {rank}", "failure_seq": seq})
        for rank, seq, t in [(0, 2, 10.0), (1, 1, 70.0)]
    )
    _, _, errors = parse_progress(text)
    sequence = failure_sequence(errors, [1, 1])
    assert sequence == {0: 2, 1: 1}
    assert first_failure(nodes, {}, sequence)["node_rank"] == 1


def test_the_stores_failure_counter_orders_reports_from_every_node():
    """Real TCPStore (as torchrun's agent serves it): each node's report gets the next number."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from orchestrator.train.gang import GANG_EXIT_CODE, Watchdog

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    clients = [
        TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
        for _ in range(3)
    ]
    dogs = [Watchdog(store, "job-1", rank, 3) for rank, store in enumerate(clients)]
    assert [dogs[i].mark_failed(f"boom {i}") for i in (2, 0, 1)] == [1, 2, 3]
    import orchestrator.observe.status as status_module

    assert status_module.GANG_EXIT_CODE == GANG_EXIT_CODE  # the controller reads the trainer's code


def test_a_node_killed_outright_comes_before_the_nodes_whose_collectives_then_reported():
    """As on the test hosts: node 1 SIGKILLed (no report); node 0's gloo collective raised and reported
    first to the store (sequence 1). Node 1 is the first failure, whatever the clocks say."""
    nodes = [node(0, "exited", 1, 100.0), node(1, "exited", 137, 160.0)]
    assert first_failure(nodes, {}, {0: 1})["node_rank"] == 1
    lines = ["Traceback (most recent call last):", "RuntimeError: Connection closed by peer",
             "dzctl failure-seq: 3 (node's place among the job's failure reports)"]  # fmt: skip
    assert failure_sequence_in_log(lines) == 3 and failure_sequence_in_log(lines[:2]) is None


def test_a_rank_whose_supervisor_is_still_recording_its_end_is_running_not_dead(tmp_path):
    """The command has exited and its supervisor is between ``wait()`` and writing the exit code (it ends the
    orphans first). A status read then said "dead" and the job "failed": test_json_contract's watch of a
    ``sleep 8`` rank saw a succeeded job end as failed in a clean-clone CI run (2026-12-07)."""
    from orchestrator.runtimes import process

    gone = subprocess.Popen(["true"])
    gone.wait()
    _, state_path = process._paths(str(tmp_path), 0)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    recording = {"pid": gone.pid, "pid_start_ticks": 1, "supervisor": me, "exit_code": None}
    state_path.write_text(json.dumps({**recording, "supervisor_start_ticks": process._start_ticks(me)}))
    assert json.loads(_nodeexec("status", "--job-dir", str(tmp_path), "--rank", "0").stdout)["state"] == "running"
    # The supervisor gone too (a node reboot, kill -9): the end was never recorded.
    state_path.write_text(json.dumps({**recording, "supervisor": gone.pid, "supervisor_start_ticks": 1}))
    assert json.loads(_nodeexec("status", "--job-dir", str(tmp_path), "--rank", "0").stdout)["state"] == "dead"
