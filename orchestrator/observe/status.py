"""A job's state, derived from what the hosts say (pure; ``observe.py`` asks them).

The record alone can be stale (the controller may have been killed, a node may
have died since): the node states and rank 0's progress.jsonl decide.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from ..planning.preference import metrics as preference_metrics
from ..runtimes.control import NodeState
from .rankfailure import error_details

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
    state: str  # pending | running | stalled | succeeded | failed | stopped
    nodes: list[NodeStatus]
    progress: dict | None
    progress_age_s: float | None
    first_failure: dict | None
    # What the launch's checks measured, from the record: {"collective": {...}} (busbw, transports).
    preflight: dict | None = None
    # A supervised job (restart:/notify:): the supervisor's state, the restarts with cause and nodes replaced.
    restarts: dict | None = None
    # The plan's predicted step (the record's plan["speed"]): status compares the measured rate with it.
    speed: dict | None = None
    # A running job's stall verdict (observe/stall.py), with the culprit once stalled (evidence.py):
    # state is then "stalled": every rank still runs, none has ended a step within the bound.
    stall: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def state_failed(state: str, exit_code: int | None) -> bool:
    """A node's container (or process supervisor) ended badly: dead, or exited non-zero."""
    return state in FAILED_NODE_STATES or (state == "exited" and exit_code not in (0, None))


def node_failed(node: NodeStatus) -> bool:
    return state_failed(node.state, node.exit_code)


def derive_state(record_state: str, nodes: list[NodeStatus]) -> str:
    if record_state == "stopped":
        # The record says someone stopped it; the nodes have the last word: a rank still running
        # (a stop that failed on that node, or a relaunch outside dzctl) is not stopped.
        return "running" if any(n.state == "running" for n in nodes) else "stopped"
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


GANG_EXIT_CODE = 75  # orchestrator.train.gang's own exit: "stopped because another node failed"
GANG_LINE = "dzctl gang: node "  # what the gang watchdog prints before it ends its node (train/gang.py)


def first_failure(
    nodes: list[NodeStatus],
    reasons: dict[int, str],
    sequence: dict[int, int] | None = None,
    gang_stopped: set[int] | frozenset[int] = frozenset(),
    details: dict[int, dict] | None = None,
) -> dict | None:
    """The rank that failed first, decided without comparing node clocks (which may differ by minutes):

    1. a node the gang watchdog stopped (``gang_stopped``: its log says so; or exit 75) was stopped
       because another node failed: it comes after every other failed node;
    2. a node that failed without reporting to the rendezvous store (killed outright, OOM-killed,
       crashed hard) comes before the nodes that reported: a rank that raises reports, and when a
       peer vanishes the others' collectives raise and report after the fact (seen on the test
       hosts: node 0's gloo error reported while node 1 had been SIGKILLed);
    3. nodes that reported, in the order of the store's failure counter (``sequence``: node rank ->
       1 for the first to report), one counter on the master for all nodes;
    4. only then end times, which come from each node's own clock (two nodes killed outright leave
       nothing else), and the node rank.

    ``details``: node rank -> what its failed rank said of itself (``rank``, ``message``, ``fix``,
    ``exit_code``: see rankfailure.py). ``exit_code`` is then the rank's own, and
    ``node_exit_code`` the node's (torchrun's 1 for any failed rank, or the container's).
    """
    failed = [n for n in nodes if node_failed(n)]
    if not failed:
        return None
    sequence = sequence or {}

    def order(n: NodeStatus) -> tuple:
        seq = sequence.get(n.node_rank)
        stopped_by_gang = n.node_rank in gang_stopped or n.exit_code == GANG_EXIT_CODE
        return (stopped_by_gang, seq is not None, seq or 0, n.finished_at is None, n.finished_at or 0.0,
                n.node_rank)  # fmt: skip

    first = min(failed, key=order)
    found = (details or {}).get(first.node_rank, {})
    reason = reasons.get(first.node_rank) or describe_exit(first)
    return {
        "node_rank": first.node_rank,
        "host": first.host,
        "rank": found.get("rank"),
        "exit_code": found.get("exit_code", first.exit_code),
        "node_exit_code": first.exit_code,
        "reason": reason,
        "message": found.get("message") or reason,
        "fix": found.get("fix"),
    }


def describe_exit(node: NodeStatus) -> str:
    if node.oom_killed:
        return "killed by the kernel's OOM killer (host memory)"
    if node.exit_code == 137:
        return "killed (SIGKILL, exit 137): OOM killer, docker kill, or a lost node"
    if node.exit_code == GANG_EXIT_CODE:
        return "stopped by dzctl's gang watchdog because another node failed (exit 75)"
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
    last_eval: dict | None = None
    stopped_early = False
    last_time: float | None = None
    errors: list[dict] = []
    for event in job_events(text, job_id):
        stamp = event.get("time")
        if isinstance(stamp, (int, float)):
            last_time = float(stamp)
        if event.get("event") == "eval":
            last_eval = event
        if event.get("event") == "end":
            stopped_early = bool(event.get("stopped_early"))
        if event.get("event") == "step":
            last_step = event
        elif event.get("step") is not None and event.get("event") in ("start", "checkpoint", "end"):
            # Later events move the step on; loss and speed stay the last step's
            # (the end event's loss is the run's average, not where it ended).
            last_step = {**(last_step or {}), "step": event["step"], "max_steps": event.get("max_steps"),
                         "event": event["event"]}  # fmt: skip
        if event.get("event") == "error":
            error = error_details(event)
            if not isinstance(error.get("failure_seq"), int):
                error.pop("failure_seq", None)
            errors.append(error)
    progress = None
    if last_step is not None:
        progress = {
            "step": last_step.get("step"),
            "max_steps": last_step.get("max_steps"),
            "loss": last_step.get("loss"),
            "tokens_per_s": last_step.get("tokens_per_s"),  # real (non-pad) tokens, the whole job
            "padding_efficiency": last_step.get("padding_efficiency"),  # real / processed tokens
            "eta_s": last_step.get("eta_s"),
            "step_time_s": last_step.get("step_time_s"),  # the last step's wall time (checkpoint spacing)
            "event": last_step.get("event"),
            "grad_norm": last_step.get("grad_norm"),
            "eval": eval_summary(last_eval),  # the last eval (None: none yet, or no eval data)
            "stopped_early": stopped_early,
        }
        preference = preference_metrics.of_event(last_step)
        if preference is not None:  # train.stage dpo | kto: rewards, reward accuracy and margin, KTO's KL
            progress["preference"] = preference
    age = None if last_time is None else max(0.0, (now if now is not None else time.time()) - last_time)
    return progress, age, errors


def eval_summary(event: dict | None) -> dict | None:
    """``status``'s view of an ``eval`` event: its loss and tokens, the best so far and where it is kept."""
    if event is None:
        return None
    keys = ("step", "eval_loss", "eval_tokens", "best_eval_loss", "best_step", "best_checkpoint")
    return {key: event.get(key) for key in keys}


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
    """The reason of the first error event written by a rank of this node."""
    event = error_event_on_node(errors, slots, node_rank)
    return event["reason"] if event else None


def error_event_on_node(errors: list[dict], slots: list[int], node_rank: int) -> dict | None:
    """The first error event of a rank of this node (global ranks follow node order).

    First by the store's failure counter where the events carry it: two ranks of a node that
    fail together (one waiting on the other's data build) may write their events in either order.
    """
    first = sum(slots[:node_rank])
    mine = range(first, first + slots[node_rank])
    found = [e for e in errors if isinstance(e.get("rank"), int) and e["rank"] in mine]
    if not found:
        return None
    return min(found, key=lambda e: (not isinstance(e.get("failure_seq"), int), e.get("failure_seq") or 0))


FAILURE_SEQ_LINE = "dzctl failure-seq: "  # the trainer's own line, after its traceback (train/entry.py)


def failure_sequence_in_log(lines: list[str]) -> int | None:
    """The store's sequence number a rank printed in its log when it reported its failure."""
    for line in reversed(lines):
        _, found, rest = line.partition(FAILURE_SEQ_LINE)
        words = rest.split()
        if found and words and words[0].isdigit():
            return int(words[0])
    return None


def failure_sequence(errors: list[dict], slots: list[int]) -> dict[int, int]:
    """Node rank -> the store's sequence number of its first reported failure (see first_failure)."""
    sequence: dict[int, int] = {}
    for error in errors:
        rank, seq = error.get("rank"), error.get("failure_seq")
        if isinstance(rank, int) and isinstance(seq, int):
            node = next((i for i in range(len(slots)) if sum(slots[: i + 1]) > rank), None)
            if node is not None:
                sequence[node] = min(seq, sequence.get(node, seq))
    return sequence


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
