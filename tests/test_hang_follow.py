"""`launch --follow` and `status --watch` say a stall and its culprit in one line (issue 45): the watch state,
the plain line and the live view, from a real stall verdict (observe/stall.py) and a culprit named from
faulthandler-format stacks (observe/culprit.py). Pure: no host, no process."""

from __future__ import annotations

from rich.console import Console

from orchestrator.observe.culprit import name_culprit
from orchestrator.observe.lines import stall_line
from orchestrator.observe.stall import check
from orchestrator.observe.view import render
from orchestrator.observe.watchstate import JobWatch, NodeView
from orchestrator.spec.recovery import StallSpec

JOB_ID = "tiny-20261206-000000-abcd"
BOUNDS = {**StallSpec().model_dump(), "floor_s": 6.0, "multiple": 3.0}
# Rank 0's main thread inside the collective, as faulthandler dumps it (most recent call first).
WAITING = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1010 in run

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/zero/stage3.py", line 1402 in step
  File "/repo/orchestrator/train/entry.py", line 40 in main
"""
STOPPED = WAITING.replace('distributed_c10d.py", line 2806 in all_reduce', 'stage3.py", line 1390 in step')


def _stalled_watch() -> tuple[JobWatch, dict]:
    watch = JobWatch(JOB_ID, JOB_ID, [NodeView(0, "node0", 1), NodeView(1, "node1", 1)], started_at=0.0,
                     accelerator="cpu")  # fmt: skip
    for step in (1, 2, 3):
        event = f'{{"event": "step", "time": {step}.0, "step": {step}, "max_steps": 16, "loss": 5.0}}'
        watch.feed(0, f"dzctl-progress {event}", float(step))
    watch.set_nodes({0: ("running", None), 1: ("running", None)}, "running")
    pulse = {"phase": "step", "since": 3.0, "step": 3, "step_ended_at": 3.0, "recent_step_s": [0.25] * 3}
    verdict = check(pulse, 12.0, BOUNDS)
    evidence = [
        {"node_rank": 0, "host": "node0", "reachable": True, "ranks": [{"rank": 0, "state": "S", "stack": WAITING}]},
        {"node_rank": 1, "host": "node1", "reachable": True, "ranks": [{"rank": 1, "state": "T", "stack": STOPPED}]},
    ]
    stall = {**verdict.to_dict(), "line": verdict.line(), "culprit": name_culprit(evidence, verdict.step)}
    return watch, stall


def _text(watch: JobWatch) -> str:
    console = Console(width=300, record=True, color_system=None)
    console.print(render(watch, 12.0, 300))
    return console.export_text()


def test_a_stall_is_one_line_with_its_bound_and_culprit_said_once_per_stall():
    watch, stall = _stalled_watch()
    assert stall["stalled"] and stall["culprit"]["kind"] == "stopped"
    assert watch.set_stall(stall) is stall and watch.state == "stalled"
    assert watch.set_stall(dict(stall)) is None  # the next poll, the same stall: said once
    line = stall_line(stall, JOB_ID)
    assert line == (
        "stalled in step 4: no step ended for 9 s (bound 6 s: stall.floor_s (above 3 x the median step, 0.25 s)); "
        "culprit: rank 1 on node 1 (node1) stopped (state T: SIGSTOP or a debugger); rank 0 waits in all_reduce; "
        f"step 4; stacks: dzctl logs {JOB_ID} --stacks"
    )
    text = _text(watch)
    assert "STALLED" in text and line in text.replace("\n", "")


def test_the_view_drops_the_stall_once_a_step_ends_and_names_no_culprit_when_none_is_found():
    watch, stall = _stalled_watch()
    watch.set_stall(stall)
    watch.set_nodes({0: ("running", None), 1: ("running", None)}, "running")
    healthy = check({"phase": "step", "since": 13.0, "step": 4, "step_ended_at": 13.0, "recent_step_s": [0.25]},
                    14.0, BOUNDS)  # fmt: skip
    assert watch.set_stall({**healthy.to_dict(), "line": healthy.line()}) is None and watch.state == "running"
    assert "stalled" not in _text(watch).lower()
    # Every rank in the same collective: no culprit, said as status says it.
    assert stall_line({**stall, "culprit": None}, JOB_ID).split("; ")[1] == (
        "culprit: not named (every rank waits in the same collective)"
    )
