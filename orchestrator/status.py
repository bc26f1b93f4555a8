"""A job's state, derived from what the hosts say (pure; ``observe.py`` asks them).

The record alone can be stale (the controller may have been killed, a node may
have died since): the node states and rank 0's progress.jsonl decide.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from .nodeops import NodeState

FAILED_NODE_STATES = frozenset({"dead"})


@dataclass(frozen=True)
class NodeStatus:
    host: str
    node_rank: int
    state: str
    exit_code: int | None
    oom_killed: bool
    finished_at: float | None
    error: str | None = None


@dataclass(frozen=True)
class JobStatus:
    job: str
    job_id: str
    state: str  # pending | running | succeeded | failed | stopped
    nodes: list[NodeStatus]
    progress: dict | None
    progress_age_s: float | None
    first_failure: dict | None

    def to_dict(self) -> dict:
        return asdict(self)


def state_failed(state: str, exit_code: int | None) -> bool:
    """A node's container (or process supervisor) ended badly: dead, or exited non-zero."""
    return state in FAILED_NODE_STATES or (state == "exited" and exit_code not in (0, None))


def node_failed(node: NodeStatus) -> bool:
    return state_failed(node.state, node.exit_code)


def derive_state(record_state: str, nodes: list[NodeStatus]) -> str:
    if record_state == "stopped":
        return "stopped"
    if any(node_failed(n) for n in nodes):
        return "failed"
    states = {n.state for n in nodes}
    if "missing" in states and record_state == "running":
        return "failed"  # every rank was started: a container that vanished was removed or lost
    if states == {"exited"}:
        return "succeeded"
    if "running" in states:
        return "running"
    if states <= {"missing", "created"} and record_state in ("starting", "pending"):
        return "pending"
    if states == {"missing"} and record_state in ("succeeded", "failed"):
        return record_state  # containers removed after the end: the record has the result
    return record_state


def first_failure(nodes: list[NodeStatus], reasons: dict[int, str]) -> dict | None:
    """The rank that failed first: the earliest end among failed nodes (the others were stopped after it)."""
    failed = [n for n in nodes if node_failed(n)]
    if not failed:
        return None
    first = min(failed, key=lambda n: (n.finished_at is None, n.finished_at or 0.0, n.node_rank))
    return {
        "node_rank": first.node_rank,
        "host": first.host,
        "exit_code": first.exit_code,
        "reason": reasons.get(first.node_rank) or describe_exit(first),
    }


def describe_exit(node: NodeStatus) -> str:
    if node.oom_killed:
        return "killed by the kernel's OOM killer (host memory)"
    if node.exit_code == 137:
        return "killed (SIGKILL, exit 137): OOM killer, docker kill, or a lost node"
    if node.exit_code == 143:
        return "terminated (SIGTERM, exit 143)"
    if node.state == "dead":
        return "the rank's supervisor died without recording an exit code"
    return f"exited with code {node.exit_code}"


def parse_progress(
    text: str, now: float | None = None, job_id: str | None = None
) -> tuple[dict | None, float | None, list[dict]]:
    """From progress.jsonl: the latest progress, the age of its last line, and the error events.

    ``job_id``: keep only that job's lines (the trainer stamps each with
    DZCTL_JOB_ID): an output dir reused by a relaunch holds earlier runs' lines.
    """
    last_step: dict | None = None
    last_time: float | None = None
    errors: list[dict] = []
    for event in job_events(text, job_id):
        stamp = event.get("time")
        if isinstance(stamp, (int, float)):
            last_time = float(stamp)
        if event.get("event") == "step":
            last_step = event
        elif event.get("step") is not None and event.get("event") in ("start", "checkpoint", "end"):
            # Later events move the step on; loss and speed stay the last step's
            # (the end event's loss is the run's average, not where it ended).
            last_step = {**(last_step or {}), "step": event["step"], "max_steps": event.get("max_steps"),
                         "event": event["event"]}  # fmt: skip
        if event.get("event") == "error":
            errors.append({"rank": event.get("rank"), "reason": str(event.get("reason") or "error")})
    progress = None
    if last_step is not None:
        progress = {
            "step": last_step.get("step"),
            "max_steps": last_step.get("max_steps"),
            "loss": last_step.get("loss"),
            "tokens_per_s": last_step.get("tokens_per_s"),
            "eta_s": last_step.get("eta_s"),
            "event": last_step.get("event"),
        }
    age = None if last_time is None else max(0.0, (now if now is not None else time.time()) - last_time)
    return progress, age, errors


def job_events(text: str, job_id: str | None = None) -> list[dict]:
    """The events of progress.jsonl text, only ``job_id``'s when given (see ``parse_progress``)."""
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written as we read
        if isinstance(event, dict):
            events.append(event)
    if job_id is not None and any(e.get("job_id") == job_id for e in events):
        # A trainer that stamps lines (any since this field exists) and has written ours.
        events = [e for e in events if e.get("job_id") == job_id]
    elif job_id is not None and any("job_id" in e for e in events):
        events = []  # only other jobs' lines so far
    return events


def error_on_node(errors: list[dict], slots: list[int], node_rank: int) -> str | None:
    """The first error event written by a rank of this node (global ranks follow node order)."""
    first = sum(slots[:node_rank])
    mine = range(first, first + slots[node_rank])
    for error in errors:
        if isinstance(error.get("rank"), int) and error["rank"] in mine:
            return error["reason"]
    return None


def node_status(host: str, rank: int, state: NodeState) -> NodeStatus:
    return NodeStatus(
        host=host,
        node_rank=rank,
        state=state.state,
        exit_code=state.exit_code,
        oom_killed=state.oom_killed,
        finished_at=state.finished_at,
        error=state.error,
    )
