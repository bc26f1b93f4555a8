"""Submit a planned job to Slurm and read it back: sbatch, squeue/scontrol/sacct, scancel.

Where Slurm is reached: the machine dzctl runs on is the submit host (a login
node), so ``sbatch``, ``squeue``, ``scontrol``, ``sacct`` and ``scancel`` run
here, with the environment's ``SLURM_CONF``. The job directory
(``launch.remote_dir``) must be a path this host and every node share (home,
scratch, NFS): dzctl writes the job files there, and the ranks' records and
logs come back through it. Each rank's truth is its ``rank-<r>.json``
(``nodeexec run``); the job's is Slurm's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ...errors import InputError, RemoteError, RuntimeFailure
from ...observe.status import (
    GANG_EXIT_CODE,
    GANG_LINE,
    JobStatus,
    error_on_node,
    failure_sequence,
    failure_sequence_in_log,
    first_failure,
    node_status,
    parse_progress,
)
from ...observe.store import FINAL_STATES, JobRecord, JobStore
from ...planning.resolve import ResolvedJob
from ...runtimes.control import NodeState
from ..jobfiles import JobFile
from .script import BATCH_LOG

COMMAND_TIMEOUT_S = 30
# squeue shows a job only while it is queued or runs; then sacct (accounting) or scontrol (MinJobAge) know it.
STOP_WAIT_S = 60
RECORD_GRACE_S = 5  # scancel's SIGTERM, Slurm's KillWait, then SIGKILL: the ranks are gone well within this
# Slurm's job states (squeue/scontrol/sacct) as dzctl's.
SLURM_STATES = {
    "PENDING": "pending",
    "CONFIGURING": "pending",
    "RUNNING": "running",
    "COMPLETING": "running",
    "SUSPENDED": "running",
    "COMPLETED": "succeeded",
    "CANCELLED": "stopped",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "PREEMPTED": "failed",
}


def run_slurm(argv: list[str], *, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """One Slurm client command here; a missing command is a clear error, not a traceback."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise RuntimeFailure(
            f"`{argv[0]}` is not installed here: dzctl submits Slurm jobs from a host with Slurm's client commands",
            fix="run dzctl on a login node of the cluster (or install slurm-client and set SLURM_CONF)",
        ) from None
    except subprocess.TimeoutExpired:
        raise RemoteError(f"`{' '.join(argv)}` did not answer within {timeout:g} s", fix="is slurmctld up?") from None


def slurm_job_id(record: JobRecord) -> str:
    return str(record.plan["slurm"]["job_id"])


def is_slurm(record: JobRecord) -> bool:
    return isinstance(record.plan.get("slurm"), dict)


class SlurmBackend:
    """``launcher``'s backend for Slurm: writes the job dir and the batch script, submits, records."""

    name = "slurm"

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def start(self, prepared, progress):
        """Write the job dir (shared), submit the batch script, record the job as pending."""
        return self.submit(prepared.job, prepared.files[0], prepared.spec_record, prepared.batch_script)

    def submit(self, job: ResolvedJob, files: list[JobFile], spec_record: dict, script: str):
        from ..start import Started

        plan = job.plan
        refuse_running(job.spec.name, self.store)
        job_dir = Path(plan.nodes[0].job_dir)
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            Path(plan.nodes[0].output_dir).mkdir(parents=True, exist_ok=True)
            for item in files:
                _write(job_dir / item.name, item.content, item.mode)
            # Checked before anything was written (inputs.check_data_sources).
            for item in job.inputs.shipped:
                (job_dir / "data").mkdir(exist_ok=True)
                shutil.copyfile(item.local, job_dir / item.name)
            script_path = job_dir / "job.sbatch"
            _write(script_path, script.encode(), 0o755)
        except OSError as exc:
            raise RuntimeFailure(
                f"cannot write the job directory {job_dir}: {exc}",
                fix="launch.remote_dir must be a path this host and every node share, writable here",
            ) from None
        result = run_slurm(["sbatch", "--parsable", str(script_path)])
        if result.returncode != 0:
            raise RuntimeFailure(
                f"sbatch refused the job: {(result.stderr or result.stdout).strip()}",
                fix=f"`dzctl launch ... --slurm --dry-run` prints the script; {script_path} is the one submitted",
            )
        slurm_id = result.stdout.strip().split(";")[0]
        record_plan = {**plan.to_dict(), "slurm": {"job_id": slurm_id, "script": str(script_path)}}
        self.store.add(
            job_id=plan.job_id,
            name=plan.job,
            runtime=plan.runtime,
            image=plan.image,
            hosts=[n.host for n in plan.nodes],
            spec=spec_record,
            plan=record_plan,
            ssh_config=None,
        )
        self.store.set_state(plan.job_id, "pending")
        return Started(plan.job_id, [f"slurm job {slurm_id}"])


def refuse_running(name: str, store: JobStore) -> None:
    for record in store.active_with_name(name):
        if not is_slurm(record):
            continue
        state = slurm_state(record)
        if state in ("pending", "running"):
            raise InputError(
                f"job {name!r} is still {state} as {record.job_id} (slurm job {slurm_job_id(record)})",
                fix=f"wait for it, or `dzctl stop {record.job_id}`",
            )


def _write(path: Path, content: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)


def slurm_state(record: JobRecord) -> str | None:
    """Slurm's word on the job, as dzctl's state: squeue while it is queued or runs, then the accounting
    (sacct), then slurmctld's memory of ended jobs (scontrol, for clusters without accounting)."""
    job_id = slurm_job_id(record)
    queued = run_slurm(["squeue", "--noheader", "--jobs", job_id, "--format", "%T"])
    if queued.returncode == 0 and queued.stdout.strip():
        return SLURM_STATES.get(queued.stdout.split()[0])
    acct = run_slurm(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id, "--format", "State"])
    if acct.returncode == 0 and acct.stdout.strip():
        # "CANCELLED by 0": the first word is the state.
        return SLURM_STATES.get(acct.stdout.split()[0])
    shown = run_slurm(["scontrol", "show", "job", "--oneliner", job_id])
    if shown.returncode == 0:
        for word in shown.stdout.split():
            if word.startswith("JobState="):
                return SLURM_STATES.get(word.partition("=")[2])
    return None


def rank_record(record: JobRecord, rank: int) -> dict | None:
    path = Path(record.plan["nodes"][rank]["job_dir"]) / f"rank-{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rank_log(record: JobRecord, rank: int) -> Path:
    return Path(record.plan["nodes"][rank]["job_dir"]) / f"rank-{rank}.log"


def _tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [x.strip() for x in text.splitlines() if x.strip()][-lines:]


def gather_status(record: JobRecord) -> JobStatus:
    """The job's state from Slurm, each rank's from its record in the shared job dir."""
    job_state = slurm_state(record)
    nodes, gang_stopped, lines = [], set(), {}
    for node in record.plan["nodes"]:
        rank = node["node_rank"]
        found = rank_record(record, rank)
        if found is None:
            state = NodeState("missing")
        elif found.get("exit_code") is not None:
            state = NodeState("exited", exit_code=found["exit_code"], started_at=found.get("started"),
                              finished_at=found.get("finished"), error=found.get("error"))  # fmt: skip
            if found.get("stopped_by_signal") or found["exit_code"] == GANG_EXIT_CODE:
                gang_stopped.add(rank)  # Slurm ended this node because another failed (or scancel)
        elif job_state in ("pending", "running", None):
            state = NodeState("running", started_at=found.get("started"))
        else:
            state = NodeState("dead", started_at=found.get("started"), error="the Slurm job ended without its end")
        host = (found or {}).get("host") or node["host"]
        nodes.append(node_status(host, rank, state))
        if state.state in ("exited", "dead") and state.exit_code != 0:
            lines[rank] = _tail(rank_log(record, rank), 50)
            if any(GANG_LINE in line for line in lines[rank]):
                gang_stopped.add(rank)
    rank0 = record.plan["nodes"][0]
    progress = age = None
    errors: list[dict] = []
    try:
        text = (Path(rank0["output_dir"]) / "progress.jsonl").read_text()
        progress, age, errors = parse_progress(text, job_id=record.job_id)
    except OSError:
        pass
    slots = [n["slots"] for n in record.plan["nodes"]]
    sequence = failure_sequence(errors, slots)
    for rank, found_lines in lines.items():
        seq = failure_sequence_in_log(found_lines)
        if seq is not None:
            sequence[rank] = min(seq, sequence.get(rank, seq))
    reasons = {}
    first = first_failure(nodes, {}, sequence, gang_stopped)
    if first is not None:
        from ...observe.hosts import _error_line  # the same reading of a rank's log as the SSH fleet's

        # The trainer's own error event says it best; else the rank's log (the exit code says the rest).
        reason = error_on_node(errors, slots, first["node_rank"]) or _error_line(lines.get(first["node_rank"], []))
        if reason:
            reasons[first["node_rank"]] = reason
    state = _job_state(record, job_state, nodes)
    failure = first_failure(nodes, reasons, sequence, gang_stopped)
    if state == "failed" and failure is None:
        failure = _batch_failure(record)
    return JobStatus(
        job=record.name,
        job_id=record.job_id,
        state=state,
        nodes=nodes,
        progress=progress,
        progress_age_s=age,
        first_failure=failure,
        preflight=record.preflight,
    )


def _job_state(record: JobRecord, slurm: str | None, nodes) -> str:
    if record.state == "stopped" or slurm == "stopped":
        return "stopped"
    if slurm is None:
        # Forgotten by Slurm and no accounting: the ranks' records have the last word.
        if nodes and all(n.state == "exited" for n in nodes):
            return "succeeded" if all(n.exit_code == 0 for n in nodes) else "failed"
        return record.state if record.state in FINAL_STATES else "failed"
    if slurm == "running" and any(n.state == "exited" and n.exit_code not in (0, None) for n in nodes):
        return "failed"  # one node failed: the rest are being ended (kill-on-bad-exit)
    return slurm


def batch_log_path(record: JobRecord) -> Path:
    return Path(record.plan["nodes"][0]["job_dir"]) / BATCH_LOG.replace("%j", slurm_job_id(record))


def batch_log(record: JobRecord) -> str:
    """The batch step's output: the allocation, the preflight report, how the job ended."""
    try:
        return batch_log_path(record).read_text(errors="replace")
    except OSError:
        return ""


def _batch_failure(record: JobRecord) -> dict | None:
    """A job that failed before any rank ran (a refused step, an allocation lost): the batch log says why."""
    path = batch_log_path(record)
    lines = _tail(path, 200)
    reason = next((x for x in lines if x.startswith("dzctl: preflight failed on")), None) or next(
        (x for x in reversed(lines) if "error" in x.lower() or "failed" in x.lower()), None
    )
    return {"node_rank": None, "host": None, "exit_code": None, "reason": reason or f"see {path}"}


def stop(record: JobRecord) -> dict[str, str]:
    """scancel, then wait until Slurm and every rank's record say it ended: {node: outcome}."""
    result = run_slurm(["scancel", slurm_job_id(record)])
    # scancel refuses a job that already ended ("Invalid job id", "already completing or completed"):
    # that is stopped as far as dzctl is concerned, as `stop` on the SSH fleet finds nothing running.
    if result.returncode != 0 and slurm_state(record) in ("pending", "running"):
        raise RemoteError(f"scancel {slurm_job_id(record)}: {result.stderr.strip()}")
    deadline = time.monotonic() + STOP_WAIT_S
    ended_at = None
    while True:
        state = slurm_state(record)
        ranks = [rank_record(record, n["node_rank"]) for n in record.plan["nodes"]]
        unended = [i for i, r in enumerate(ranks) if r is not None and r.get("exit_code") is None]
        if state not in ("pending", "running"):
            # Slurm ended every step's processes; a wrapper it had to SIGKILL (past KillWait) could not
            # write its end, so its record is given a few seconds and then Slurm's word stands.
            ended_at = ended_at or time.monotonic()
            if not unended or time.monotonic() - ended_at > RECORD_GRACE_S:
                break
        elif time.monotonic() > deadline:
            return {"slurm": f"error: job {slurm_job_id(record)} still {state} {STOP_WAIT_S} s after scancel"}
        time.sleep(0.5)
    return {((r or {}).get("host") or n["host"]): "stopped" for n, r in zip(record.plan["nodes"], ranks, strict=True)}


def stream_logs(
    record: JobRecord,
    *,
    ranks: list[int] | None,
    tail: int | None,
    follow: bool,
    write: Callable[[str], None] | None = None,
) -> None:
    """Every rank's log from the shared job dir, each line prefixed ``[rank host] ``, as the SSH fleet's."""
    write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    chosen = [n for n in record.plan["nodes"] if ranks is None or n["node_rank"] in ranks]
    # Offsets count the file's bytes: text read in text mode is shorter (CRLF becomes LF) or longer
    # (a replacement character is 3 bytes) than what it was read from, and following would repeat or skip.
    offsets: dict[int, int] = {}
    for node in chosen:
        rank = node["node_rank"]
        data = _read_from(rank_log(record, rank), 0)
        # While following, a partial last line waits for its end (printed once, whole, by the loop).
        whole = data[: data.rfind(b"\n") + 1] if follow else data
        shown = whole.decode(errors="replace").splitlines(keepends=True)
        if tail is not None:
            shown = shown[-tail:] if tail else []
        _write_lines(write, record, rank, "".join(shown))
        offsets[rank] = len(whole)
    while follow:
        ended = _ended(record)
        for node in chosen:
            rank = node["node_rank"]
            chunk = _read_from(rank_log(record, rank), offsets[rank])
            # Whole lines only: a partial last line waits for its end.
            keep = chunk.rfind(b"\n") + 1 if not ended else len(chunk)
            _write_lines(write, record, rank, chunk[:keep].decode(errors="replace"))
            offsets[rank] += keep
        if ended:
            return
        time.sleep(1.0)


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read()
    except FileNotFoundError:
        return b""  # the rank has not started yet


def _ended(record: JobRecord) -> bool:
    return slurm_state(record) not in ("pending", "running")


def _write_lines(write, record: JobRecord, rank: int, text: str) -> None:
    if not text:
        return
    host = (rank_record(record, rank) or {}).get("host") or record.plan["nodes"][rank]["host"]
    write("".join(f"[{rank} {host}] {line}\n" for line in text.splitlines()))


def wait_until_ended(record: JobRecord, store: JobStore, *, poll_s: float = 2.0) -> JobStatus:
    while True:
        status = gather_status(store.get(record.job_id))
        if status.state in FINAL_STATES:
            store.set_state(record.job_id, status.state)
            return status
        time.sleep(poll_s)
