"""A stalled job's evidence from every rank on every node, taken before anything is stopped.

One command per node, all nodes at once over the job's existing connections: the node side
(``runtimes/rankprobe.py``) reads each rank's state from /proc, has it dump its Python stack
(and, on GPU, NCCL's flight recorder) into the job's rank files, and answers in JSON. A node that
does not answer is evidence too (``reachable: false``). The whole of it is kept on the controller,
``$DZCTL_HOME/evidence/<job id>.json``, which ``dzctl logs JOB --stacks`` prints; the stack files
stay on the nodes beside the checkpoints (``<output_dir>/dzctl-ranks/<job id>/``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import RemoteError
from ..spec.recovery import PULSE_FILE, StallSpec, rank_files_dir
from ..transport.pool import HostPool
from . import stall
from .culprit import name_culprit
from .store import JobRecord, dzctl_home

PROBE_WAIT_S = 10.0  # per rank: a faulthandler dump takes milliseconds; a loaded node, seconds
READ_TIMEOUT_S = 30


def files_dir(record: JobRecord, node: dict) -> str:
    return rank_files_dir(node["output_dir"], record.job_id)


def probe_argv(record: JobRecord, node: dict, wait_s: float = PROBE_WAIT_S) -> list[str]:
    """The node-side probe: beside the process runtime's launcher, or inside the rank's container."""
    python = record.spec.get("launch", {}).get("python", "python3")
    args = ["-m", "orchestrator.runtimes.rankprobe", "--dir", files_dir(record, node), "--wait", f"{wait_s:g}"]
    if record.runtime == "docker":
        # The container's own Python and /proc: the ranks' pids and files as they see them.
        return ["docker", "exec", node["container_name"], "python3", *args]
    return [python, *args, "--job-dir", node["job_dir"], "--rank", str(node["node_rank"])]


def read_pulse(record: JobRecord, pool: HostPool) -> dict | None:
    """Rank 0's pulse (train/hang/stacks.py): the phase and the step times; None when not written or unreadable."""
    rank0 = record.plan["nodes"][0]
    try:
        result = pool.connection(rank0["host"]).run(
            ["cat", f"{files_dir(record, rank0)}/{PULSE_FILE}"], timeout=READ_TIMEOUT_S
        )
    except RemoteError:
        return None
    if result.exit_code != 0:
        return None
    try:
        pulse = json.loads(result.stdout)
    except json.JSONDecodeError:
        return None
    return pulse if isinstance(pulse, dict) else None


def gather_evidence(record: JobRecord, pool: HostPool, wait_s: float = PROBE_WAIT_S) -> dict:
    """Every node's ranks: state, what they block in, Python stack, flight-recorder dump, GPU use."""
    by_host = {n["host"]: n for n in record.plan["nodes"]}

    def one(conn) -> dict:
        node = by_host[conn.host]
        result = conn.run(probe_argv(record, node, wait_s), timeout=READ_TIMEOUT_S + 4 * wait_s)
        if result.exit_code != 0:
            raise RemoteError(f"the probe exited {result.exit_code}: {(result.stderr.strip() or '')[-300:]}")
        return json.loads(result.stdout)

    outcomes = pool.map(one, by_host)
    nodes = []
    for host, node in by_host.items():
        found = outcomes.get(host)
        entry = {"node_rank": node["node_rank"], "host": host, "reachable": not isinstance(found, Exception)}
        if isinstance(found, Exception):
            entry.update(error=str(found), ranks=[], gpus=None)
        else:
            entry.update(ranks=found.get("ranks") or [], gpus=found.get("gpus"))
        nodes.append(entry)
    nodes.sort(key=lambda n: n["node_rank"])
    return {"job_id": record.job_id, "taken_at": time.time(), "nodes": nodes}


@contextlib.contextmanager
def _evidence_lock(job_id: str) -> Iterator[None]:
    path = evidence_path(job_id).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def evidence_path(job_id: str) -> Path:
    return dzctl_home() / "evidence" / f"{job_id}.json"


def save_evidence(evidence: dict) -> Path:
    path = evidence_path(evidence["job_id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(evidence, indent=1))
    temp.replace(path)
    return path


def load_evidence(job_id: str) -> dict | None:
    try:
        return json.loads(evidence_path(job_id).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def render_stacks(evidence: dict) -> str:
    """``dzctl logs JOB --stacks``: the culprit line, then each rank's state, what it blocks in, and its stack."""
    lines = []
    taken = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(evidence.get("taken_at") or 0))
    stall = evidence.get("stall") or {}
    lines.append(f"evidence of {evidence['job_id']}, taken {taken}")
    if stall.get("line"):
        lines.append(stall["line"])
    if (stall.get("culprit") or {}).get("line"):
        lines.append(stall["culprit"]["line"])
    for node in evidence["nodes"]:
        head = f"== node {node['node_rank']} ({node['host']})"
        if not node.get("reachable", True):
            lines.append(f"{head}: did not answer: {node.get('error')}")
            continue
        gpus = node.get("gpus")
        util = ", ".join(f"GPU {g['index']} {g['utilization']}%" for g in gpus) if gpus else "no nvidia-smi"
        lines.append(f"{head}: {len(node['ranks'])} rank(s); {util}")
        for rank in node["ranks"]:
            blocked = rank.get("blocked_on") or {}
            on = f", blocked in {blocked.get('syscall')}" + (f" of {blocked['path']}" if blocked.get("path") else "")
            lines.append(f"-- rank {rank.get('rank')} (pid {rank.get('pid')}): state {rank.get('state')}, "
                         f"in {rank.get('wchan') or '-'}{on if blocked else ''}")  # fmt: skip
            trace = rank.get("nccl_trace")
            if trace:
                said = f" ({trace.get('bytes')} bytes)" if trace.get("ok") else f": {trace.get('error')}"
                lines.append(f"   NCCL flight recorder: {trace.get('path')}{said}")
            lines.append(rank.get("stack") or f"   no Python stack: {rank.get('stack_via')}")
    return "\n".join(lines)


def stall_of(record: JobRecord, pool: HostPool, now: float | None = None) -> dict | None:
    """A running job's stall verdict; once stalled, with the culprit named from every rank's evidence.

    The evidence is taken once per stall (the same phase and step) and kept: a ``status --watch``
    or the supervisor's poll reads the stored one instead of signalling the ranks again.
    """
    pulse = read_pulse(record, pool)
    spec = record.spec
    bounds = {**StallSpec().model_dump(), **(spec.get("stall") or {})}
    accumulation = (spec.get("train") or {}).get("gradient_accumulation_steps")
    predicted = stall.predicted_step_s(record.plan.get("speed"), accumulation if isinstance(accumulation, int) else 1)
    verdict = stall.check(pulse, time.time() if now is None else now, bounds, predicted)
    if verdict is None:
        return None
    found = {**verdict.to_dict(), "line": verdict.line()}
    if not verdict.stalled:
        return found
    # status, --follow and the supervisor may all see a new stall at once: one of them takes the evidence
    # (a probe resumes a stopped rank for an instant, which another probe's reading would catch).
    with _evidence_lock(record.job_id):
        evidence = load_evidence(record.job_id)
        same = evidence is not None and {k: (evidence.get("stall") or {}).get(k) for k in ("phase", "step")} == {
            "phase": verdict.phase, "step": verdict.step}  # fmt: skip
        if not same:
            evidence = gather_evidence(record, pool)
            evidence["stall"] = {**found, "culprit": name_culprit(evidence["nodes"], verdict.step)}
            save_evidence(evidence)
    culprit = evidence["stall"].get("culprit")
    return {**found, "culprit": culprit, "evidence": str(evidence_path(record.job_id)),
            "taken_at": evidence.get("taken_at")}  # fmt: skip
