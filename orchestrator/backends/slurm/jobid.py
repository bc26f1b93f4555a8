"""Which Slurm job a dzctl job is, known before ``sbatch`` returns.

The job is recorded before sbatch runs, so that ``status``, ``stop`` and a relaunch
see it even if this controller dies in between; the Slurm job id comes later, from
sbatch's answer (kept in the job dir's ``slurm-job-id``). Until then, or for good if
the controller died first, the job is found in squeue by its comment
(``dzctl:<job id>``, an ``#SBATCH`` line of its script). While sbatch runs, the
submitting dzctl holds an flock on ``submit.lock`` in the job dir (the kernel drops
it when that process dies): no lock held and no such job in the queue means the
submission never completed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ...observe.store import JobRecord
from .client import answered, run_slurm
from .script import COMMENT

ID_FILE = "slurm-job-id"
LOCK_FILE = "submit.lock"


def mark(job_id: str) -> str:
    return COMMENT.format(job_id=job_id)


def job_dir_of(record: JobRecord) -> Path:
    return Path(record.plan["nodes"][0]["job_dir"])


@contextlib.contextmanager
def submitting(job_dir: Path) -> Iterator[None]:
    """Held by the dzctl that submits, from before its record is written until sbatch's answer is kept."""
    fd = os.open(job_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def submission_in_flight(record: JobRecord) -> bool:
    """Whether a dzctl is still between recording this job and keeping sbatch's answer."""
    try:
        fd = os.open(job_dir_of(record) / LOCK_FILE, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the lock this call may have taken
    return False


def remember(job_dir: Path, slurm_id: str) -> None:
    partial = job_dir / f".{ID_FILE}.partial"
    partial.write_text(slurm_id + "\n")
    partial.replace(job_dir / ID_FILE)  # whole or absent: a reader never sees half an id


def slurm_job_id(record: JobRecord) -> str | None:
    """The Slurm job id: as stored, or found in the queue by the job's comment; None if Slurm has no such job."""
    stored = (record.plan.get("slurm") or {}).get("job_id")  # records written before the id file existed
    if stored:
        return str(stored)
    with contextlib.suppress(OSError):
        kept = (job_dir_of(record) / ID_FILE).read_text().strip()
        if kept:
            return kept
    found = find_in_queue(record)
    if found:
        with contextlib.suppress(OSError):
            remember(job_dir_of(record), found)  # so it is known once the job has left the queue
    return found


def find_in_queue(record: JobRecord) -> str | None:
    """The queued or running Slurm job whose comment names this dzctl job (SlurmUnreachable if none can tell)."""
    listed = answered(run_slurm(["squeue", "--noheader", "--name", record.name, "--format", "%i %k"]))
    for line in listed.stdout.splitlines():
        slurm_id, _, comment = line.strip().partition(" ")
        if comment.strip() == mark(record.job_id):
            return slurm_id
    return None
