"""A failed rank's output as the view reads it, without a job: tracebacks folded, the failure said once.

torchrun's report is made by torch's own classes (``ChildFailedError`` and ``ProcessFailure``, raised
and formatted by Python's traceback module), so the folding is checked on the text torchrun prints.
"""

from __future__ import annotations

import json
import traceback

import pytest

from orchestrator.observe.rankfailure import (
    before_launcher_report,
    errors_in_log,
    failure_lines,
    rank_details,
    torchrun_root_cause,
)
from orchestrator.observe.watchstate import JobWatch, NodeView


def _torchrun_report(exitcode: int, local_rank: int = 1) -> list[str]:
    """What torchrun prints when a worker fails: its uncaught ChildFailedError, traceback and summary."""
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    failure = errors.ProcessFailure(local_rank=local_rank, pid=4242, exitcode=exitcode, error_file="")
    try:
        raise errors.ChildFailedError(name="orchestrator.train", failures={local_rank: failure})
    except errors.ChildFailedError as exc:
        return "".join(traceback.format_exception(exc)).splitlines()


def _rank_traceback(rank: int) -> list[str]:
    try:
        try:
            {}["missing"]
        except KeyError as inner:
            raise RuntimeError("gloo: connection reset by peer") from inner
    except RuntimeError as exc:
        return [f"[rank{rank}]:{line}" for line in "".join(traceback.format_exception(exc)).splitlines()]


def _error_event(rank: int, message: str, fix: str | None, exit_code: int) -> str:
    reason = f"{message} (fix: {fix})" if fix else message
    event = {"event": "error", "time": 1.0, "rank": rank, "reason": reason, "message": message, "fix": fix,
             "exit_code": exit_code}  # fmt: skip
    return f"[rank{rank}]:dzctl-progress {json.dumps(event)}"


def _watch() -> JobWatch:
    return JobWatch("tiny", "tiny-1", [NodeView(0, "node0", 2)], started_at=0.0, accelerator="cpu")


def test_torchrun_report_folds_to_nothing_and_a_rank_traceback_to_its_last_line():
    report = _torchrun_report(2)
    assert any("ChildFailedError" in x for x in report) and any("exitcode" in x for x in report)
    watch = _watch()
    # torchrun's log lines before its report, as a real failed run of the tiny job printed them.
    narration = [
        "W1203 06:54:29.319000 31006 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/"
        "api.py:1028] Sending process 31017 closing signal SIGTERM",
        "E1203 06:54:29.351000 31006 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/"
        "api.py:1002] failed (exitcode: 2) local_rank: 0 (pid: 31016) of binary: /venv/bin/python",
    ]
    lines = [*_rank_traceback(1), "[rank0]:dzctl-train: 2 ranks", *narration, *report, "after the report"]
    for line in lines:
        watch.feed(0, line, 1.0)
    # The chained cause (KeyError) gives way to the exception raised last, as Python prints it last.
    shown = [m.text for m in watch.messages.values()]
    assert shown == ["RuntimeError: gloo: connection reset by peer", "dzctl-train: 2 ranks", "after the report"]
    assert next(m for m in watch.messages.values() if m.level == "error").ranks == {1}


def test_the_ranks_error_lines_are_said_once_through_its_event_in_either_order():
    message, fix = "data.jsonl:row 7: missing key 'output'", "fix the row"
    for lines in (
        [_error_event(0, message, fix, 2), f"[rank0]:error: {message}", f"[rank0]:fix: {fix}"],
        [f"[rank0]:error: {message}", f"[rank0]:fix: {fix}", _error_event(0, message, fix, 2)],
    ):
        watch = _watch()
        seq = "[rank0]:dzctl failure-seq: 1 (node's place among the job's failure reports)"
        for line in [*lines, seq, *_torchrun_report(2, local_rank=0)]:
            watch.feed(0, line, 1.0)
        assert watch.messages == {}
        assert failure_lines(watch.failure) == [f"first failure: node 0 (node0), rank 0, exit 2: {message}",
                                                f"fix: {fix}"]  # fmt: skip


def test_torchruns_root_cause_gives_the_ranks_own_exit_code():
    assert torchrun_root_cause(["noise", *_torchrun_report(2)]) == {"rank": 1, "exit_code": 2}
    killed = torchrun_root_cause(_torchrun_report(-9))
    assert killed == {"rank": 1, "exit_code": -9}
    assert rank_details(None, killed) == {"rank": 1, "exit_code": 137}  # SIGKILL, as a shell says it
    assert torchrun_root_cause(["RuntimeError: boom"]) is None


def test_a_nodes_log_gives_its_ranks_error_events_and_the_lines_before_torchruns_report():
    lines = ["[rank1]:RuntimeError: boom", _error_event(1, "RuntimeError: boom", None, 1), *_torchrun_report(1)]
    assert errors_in_log(lines) == [{"rank": 1, "reason": "RuntimeError: boom", "message": "RuntimeError: boom",
                                     "exit_code": 1}]  # fmt: skip
    assert before_launcher_report(lines) == lines[:2]
    event = errors_in_log(lines)[0]
    assert rank_details(event, torchrun_root_cause(lines)) == event
