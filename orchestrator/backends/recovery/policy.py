"""Why a job failed, and whether a restart can fix it: pure, from the job's status as the hosts gave it.

A restart reruns the same plan on the same (or equally sized) nodes from the newest complete
checkpoint. It fixes what was outside the plan: a node lost (killed, rebooted, unreachable), a
rank that crashed on a transient fault, a collective that timed out. It cannot fix what the
plan or the inputs cause, so these never restart:

- bad input (a rank's exit 2: the spec, a data row, a checkpoint that cannot be resumed);
- out of memory: the same plan on the same hardware runs out again at the same step;
- an exit code the user lists as final (``restart.final_exit_codes``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import InputError
from ...observe.status import GANG_EXIT_CODE, JobStatus, node_failed
from ...spec.recovery import RestartSpec

RESTARTABLE = frozenset({"node-lost", "rank-failed", "nccl-timeout", "hang"})
SIGKILL_EXIT = 137  # 128 + 9: docker kill, the node's OOM killer (flagged apart), a lost node's supervisor
# A node whose state is one of these cannot be asked: the host is down, unreachable or its rank vanished.
GONE_STATES = frozenset({"unreachable", "missing", "dead"})
# A rank's own words (torch's OutOfMemoryError, CUDA's message). Not a bare "OOM": status's text for any
# SIGKILL names the OOM killer as one possibility; the kernel's OOM kill is its own flag (oom_killed).
_OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
_COLLECTIVE_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout|(nccl|gloo|collective|allreduce|all_reduce|barrier)"
    r"[^\n]*(timeout|timed out)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Verdict:
    cause: str  # node-lost | rank-failed | nccl-timeout | hang | input-error | out-of-memory | final-exit-code
    restart: bool
    why: str  # one line: what happened, and why it is (not) restarted

    def to_dict(self) -> dict:
        return {"cause": self.cause, "restart": self.restart, "why": self.why}


def failure_cause(status: JobStatus, final_exit_codes: list[int] | tuple[int, ...] = ()) -> tuple[str, str]:
    """(cause, what happened) of a failed job. The first failure decides; the nodes' states back it up.

    A stalled job (every rank runs, none ends a step: observe/stall.py) is a ``hang``, told by its
    culprit line (observe/culprit.py) where the evidence named one.
    """
    if status.state == "stalled":
        stall = status.stall or {}
        culprit = (stall.get("culprit") or {}).get("line") or "culprit not named"
        return "hang", f"{stall.get('line', 'stalled')}; {culprit}"
    failure = status.first_failure or {}
    text = " ".join(str(failure.get(k) or "") for k in ("message", "reason"))
    code = failure.get("exit_code")
    where = f"node {failure.get('node_rank')} ({failure.get('host')})" if failure else "a node"
    first = next((n for n in status.nodes if n.node_rank == failure.get("node_rank")), None)
    if code in final_exit_codes:
        return "final-exit-code", f"{where} exited {code}, listed in restart.final_exit_codes"
    if code == InputError.exit_code:
        return "input-error", f"{where}: bad input (exit {code}): {failure.get('message') or failure.get('reason')}"
    if (first is not None and first.oom_killed) or _OOM.search(text):
        return "out-of-memory", f"{where} ran out of memory: the same plan would again"
    gone = [n for n in status.nodes if n.state in GONE_STATES]
    if gone:
        names = ", ".join(f"node {n.node_rank} ({n.host}: {n.state})" for n in gone)
        return "node-lost", f"lost {names}"
    if _COLLECTIVE_TIMEOUT.search(text):
        return "nccl-timeout", f"{where}: a collective timed out: {failure.get('reason')}"
    if code == SIGKILL_EXIT or (first is not None and first.state == "dead"):
        return "node-lost", f"{where} was killed (exit {code})"
    failed = [n for n in status.nodes if node_failed(n)]
    if failed and all(n.exit_code == GANG_EXIT_CODE for n in failed):
        # Every node that ended says another one failed: that one left no exit of its own.
        return "node-lost", "every node was stopped by the gang watchdog: the node that failed left no exit code"
    return "rank-failed", f"{where}: rank failed (exit {code}): {failure.get('reason')}"


def decide(status: JobStatus, policy: RestartSpec | None, restarts_done: int) -> Verdict:
    """Whether the supervisor restarts this failed job now."""
    cause, what = failure_cause(status, tuple(policy.final_exit_codes) if policy else ())
    if policy is None:
        return Verdict(cause, False, f"{what}; no restart policy (restart: in the job spec)")
    if cause not in RESTARTABLE:
        return Verdict(cause, False, f"{what}; a restart cannot fix {cause}")
    if cause not in policy.on:
        return Verdict(cause, False, f"{what}; restart.on does not list {cause}")
    if restarts_done >= policy.max:
        return Verdict(cause, False, f"{what}; restart limit reached ({restarts_done} of restart.max {policy.max})")
    return Verdict(cause, True, f"{what}; restart {restarts_done + 1} of {policy.max}")
