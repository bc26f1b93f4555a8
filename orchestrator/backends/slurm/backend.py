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
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ...errors import InputError, RuntimeFailure
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
from .client import SlurmUnreachable, answered, run_slurm, says_unknown_job
from .jobid import mark, remember, slurm_job_id, submission_in_flight, submitting
from .script import BATCH_LOG

__all__ = ["SlurmBackend", "SlurmUnreachable", "gather_status", "run_slurm", "slurm_job_id", "stop", "stream_logs"]

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
        """Record the job, then write its dir and run sbatch: a controller that dies at any point leaves
        a record that ``status``, ``stop`` and a relaunch find (jobid.py: by comment until the id is kept)."""
        from ..start import Started

        plan = job.plan
        refuse_running(job.spec.name, self.store)
        job_dir = Path(plan.nodes[0].job_dir)
        script_path = job_dir / "job.sbatch"
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unwritable(job_dir, exc) from None
        with submitting(job_dir):
            record_plan = {**plan.to_dict(), "slurm": {"job_id": None, "script": str(script_path)}}
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
            try:
                _write_job_dir(job, files, job_dir, script_path, script)
            except OSError as exc:
                failure = _unwritable(job_dir, exc)
                self.store.set_state(plan.job_id, "failed", reason=failure.message)
                raise failure from None
            # A timeout here (SlurmUnreachable) leaves the record as it is: the job may have been queued,
            # and squeue finds it by its comment once Slurm answers.
            result = run_slurm(["sbatch", "--parsable", str(script_path)])
            if result.returncode != 0:
                failure = RuntimeFailure(
                    f"sbatch refused the job: {(result.stderr or result.stdout).strip()}",
                    fix=f"`dzctl launch ... --slurm --dry-run` prints the script; {script_path} is the one submitted",
                )
                self.store.set_state(plan.job_id, "failed", reason=failure.message)
                raise failure
            slurm_id = result.stdout.strip().split(";")[0]
            remember(job_dir, slurm_id)
            self.store.set_state(plan.job_id, "pending")
        return Started(plan.job_id, [f"slurm job {slurm_id}"])


def _write_job_dir(job: ResolvedJob, files: list[JobFile], job_dir: Path, script_path: Path, script: str) -> None:
    Path(job.plan.nodes[0].output_dir).mkdir(parents=True, exist_ok=True)
    for item in files:
        _write(job_dir / item.name, item.content, item.mode)
    # Checked before anything was written (inputs.check_data_sources).
    for item in job.inputs.shipped:
        (job_dir / "data").mkdir(exist_ok=True)
        shutil.copyfile(item.local, job_dir / item.name)
    _write(script_path, script.encode(), 0o755)


def _unwritable(job_dir: Path, exc: OSError) -> RuntimeFailure:
    return RuntimeFailure(
        f"cannot write the job directory {job_dir}: {exc}",
        fix="launch.remote_dir must be a path this host and every node share, writable here",
    )


def refuse_running(name: str, store: JobStore) -> None:
    for record in store.active_with_name(name):
        if not is_slurm(record):
            continue
        state = slurm_state(record)
        if state in ("pending", "running"):
            slurm_id = slurm_job_id(record)
            what = f"slurm job {slurm_id}" if slurm_id else "being submitted: sbatch has not answered yet"
            raise InputError(
                f"job {name!r} is still {state} as {record.job_id} ({what})",
                fix=f"wait for it, or `dzctl stop {record.job_id}`",
            )


def _write(path: Path, content: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)


def slurm_state(record: JobRecord) -> str | None:
    """Slurm's word on the job, as dzctl's state: squeue while it is queued or runs, then the accounting
    (sacct), then slurmctld's memory of ended jobs (scontrol, for clusters without accounting).

    None: Slurm answered and has no such job (forgotten, or never submitted). SlurmUnreachable: squeue
    got no answer, which says nothing about the job.
    """
    # Asked first: the submitting dzctl keeps sbatch's answer before it lets go of the lock, so a lock
    # found free here means the id (if there is one) can be read now.
    in_flight = submission_in_flight(record)
    job_id = slurm_job_id(record)
    if job_id is None:
        # Recorded, never seen by Slurm: sbatch may still be running in the dzctl that recorded it.
        return "pending" if in_flight else None
    queued = answered(run_slurm(["squeue", "--noheader", "--jobs", job_id, "--format", "%T"]))
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
    """The job's state from Slurm, each rank's from its record in the shared job dir.

    When Slurm cannot be asked, no state is made up (a rank may still run): SlurmUnreachable, with
    what the ranks' records say."""
    try:
        job_state = slurm_state(record)
    except SlurmUnreachable as exc:
        said = "; ".join(_rank_summary(record)) or "no rank has started"
        raise SlurmUnreachable(f"{exc.message}; the job's state is unknown. The ranks' records say: {said}",
                               fix=exc.fix) from None  # fmt: skip
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
        speed=record.plan.get("speed"),
    )


def _rank_summary(record: JobRecord) -> list[str]:
    said = []
    for node in record.plan["nodes"]:
        found = rank_record(record, node["node_rank"])
        if found is not None:
            where = f"rank {node['node_rank']} on {found.get('host') or node['host']}"
            ended = found.get("exit_code") is not None
            said.append(f"{where} exited with {found['exit_code']}" if ended else f"{where} running")
    return said


def _job_state(record: JobRecord, slurm: str | None, nodes) -> str:
    # A job dzctl stopped is stopped once Slurm no longer runs it: never while Slurm still does.
    if slurm == "stopped" or (record.state == "stopped" and slurm not in ("pending", "running")):
        return "stopped"
    if slurm is None:
        # Forgotten by Slurm and no accounting: the ranks' records have the last word.
        if nodes and all(n.state == "exited" for n in nodes):
            return "succeeded" if all(n.exit_code == 0 for n in nodes) else "failed"
        return record.state if record.state in FINAL_STATES else "failed"
    if slurm == "running" and any(n.state == "exited" and n.exit_code not in (0, None) for n in nodes):
        return "failed"  # one node failed: the rest are being ended (kill-on-bad-exit)
    return slurm


def batch_log_path(record: JobRecord) -> Path | None:
    slurm_id = slurm_job_id(record)
    return None if slurm_id is None else Path(record.plan["nodes"][0]["job_dir"]) / BATCH_LOG.replace("%j", slurm_id)


def batch_log(record: JobRecord) -> str:
    """The batch step's output: the allocation, the preflight report, how the job ended."""
    path = batch_log_path(record)
    try:
        return "" if path is None else path.read_text(errors="replace")
    except OSError:
        return ""


def _batch_failure(record: JobRecord) -> dict | None:
    """A job that failed before any rank ran (a refused step, an allocation lost): the batch log says why."""
    path = batch_log_path(record)
    if path is None:
        # Never queued: sbatch's refusal as recorded, or a submitting dzctl that ended before sbatch answered.
        reason = record.reason or (
            "sbatch never answered with a Slurm job id (the dzctl that submitted the job ended first), "
            f"and squeue lists no job with the comment {mark(record.job_id)}"
        )
        return {"node_rank": None, "host": None, "exit_code": None, "reason": reason}
    lines = _tail(path, 200)
    reason = next((x for x in lines if x.startswith("dzctl: preflight failed on")), None) or next(
        (x for x in reversed(lines) if "error" in x.lower() or "failed" in x.lower()), None
    )
    return {"node_rank": None, "host": None, "exit_code": None, "reason": reason or f"see {path}"}


def stop(record: JobRecord) -> dict[str, str]:
    """scancel, then wait until Slurm and every rank's record say it ended: {node: "stopped" or why not}.

    Only Slurm's answer ends the wait: a Slurm that cannot be asked, or a scancel it refused for a job
    it still runs, leaves each node whose rank is still there (or may yet start) named with the reason.
    """
    slurm_id, problem = _cancel(record)
    cancelled = problem is None
    deadline = time.monotonic() + STOP_WAIT_S
    ended_at = None
    while True:
        try:
            state, unreachable = slurm_state(record), None
        except SlurmUnreachable as exc:
            state, unreachable = None, exc.message
        ranks = [rank_record(record, n["node_rank"]) for n in record.plan["nodes"]]
        unended = [i for i, r in enumerate(ranks) if r is not None and r.get("exit_code") is None]
        if unreachable is None and state not in ("pending", "running"):
            # Slurm ended every step's processes; a wrapper it had to SIGKILL (past KillWait) could not
            # write its end, so its record is given a few seconds and then Slurm's word stands.
            ended_at = ended_at or time.monotonic()
            if not unended or time.monotonic() - ended_at > RECORD_GRACE_S:
                return _outcomes(record, ranks, None, cancelled=True)
        elif unreachable is not None and all(r is not None and r.get("exit_code") is not None for r in ranks):
            return _outcomes(record, ranks, None, cancelled=True)  # every rank recorded its end: nothing runs
        elif not cancelled:
            # scancel failed and Slurm still has the job (or cannot say): waiting would not change that.
            return _outcomes(record, ranks, unreachable or problem, cancelled=False)
        elif time.monotonic() > deadline:
            why = unreachable or f"slurm job {slurm_id} still {state} {STOP_WAIT_S} s after scancel"
            # A job Slurm still lists may yet start its ranks; one it took the cancel for and then went
            # silent about will not.
            return _outcomes(record, ranks, why, cancelled=unreachable is not None)
        time.sleep(0.5)


def _cancel(record: JobRecord) -> tuple[str | None, str | None]:
    """(the Slurm job id, why scancel did not take it, or None when it did or Slurm has no such job)."""
    in_flight = submission_in_flight(record)  # before the id: see slurm_state
    try:
        slurm_id = slurm_job_id(record)
    except SlurmUnreachable as exc:
        return None, exc.message
    if slurm_id is None:
        if in_flight:
            return None, "sbatch has not answered yet (the job is being submitted); stop it again once it has"
        return None, None  # never queued: nothing to cancel
    try:
        result = run_slurm(["scancel", slurm_id])
    except SlurmUnreachable as exc:
        return slurm_id, exc.message
    # scancel refuses a job that already ended ("Invalid job id", "already completing or completed"):
    # stopped as far as dzctl is concerned, as `stop` on the SSH fleet finds nothing running.
    if result.returncode == 0 or says_unknown_job(result):
        return slurm_id, None
    return slurm_id, f"scancel {slurm_id}: {(result.stderr or result.stdout).strip()}"


def _outcomes(record: JobRecord, ranks: list[dict | None], why: str | None, *, cancelled: bool) -> dict[str, str]:
    """Each node's outcome: stopped, or (with ``why``) named while its rank still runs, or may yet start."""
    outcomes = {}
    for node, found in zip(record.plan["nodes"], ranks, strict=True):
        host = (found or {}).get("host") or node["host"]
        rank = node["node_rank"]
        if why is None or (found is not None and found.get("exit_code") is not None):
            outcomes[host] = "stopped"
        elif found is not None:
            outcomes[host] = f"rank {rank} is still running (its record has no end): {why}"
        elif cancelled:
            outcomes[host] = "stopped"  # Slurm took the cancel: this rank will not start
        else:
            outcomes[host] = f"rank {rank} has not started, and Slurm may still start it: {why}"
    return outcomes


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
    try:
        return slurm_state(record) not in ("pending", "running")
    except SlurmUnreachable:
        return False  # unknown: keep following (the ranks' logs grow on the shared path regardless)


def _write_lines(write, record: JobRecord, rank: int, text: str) -> None:
    if not text:
        return
    host = (rank_record(record, rank) or {}).get("host") or record.plan["nodes"][rank]["host"]
    write("".join(f"[{rank} {host}] {line}\n" for line in text.splitlines()))


def wait_until_ended(record: JobRecord, store: JobStore, *, poll_s: float = 2.0) -> JobStatus:
    while True:
        try:
            status = gather_status(store.get(record.job_id))
        except SlurmUnreachable:
            time.sleep(poll_s)  # Slurm will answer again; nothing about the job is known meanwhile
            continue
        if status.state in FINAL_STATES:
            store.set_state(record.job_id, status.state)
            return status
        time.sleep(poll_s)
