"""Slurm's client commands, run here (the submit host): one place that runs them and tells
"Slurm answered" from "Slurm could not be asked".

The difference matters: a job Slurm no longer lists has ended, but a query that
never reached slurmctld says nothing about the job. Reading the second as the first
would report a running job stopped.
"""

from __future__ import annotations

import subprocess

from ...errors import RemoteError, RuntimeFailure

COMMAND_TIMEOUT_S = 30
# What squeue/scontrol/scancel print for a job id slurmctld does not (or no longer) know: an answer.
UNKNOWN_JOB = ("Invalid job id", "already completing or completed")
UNREACHABLE_FIX = (
    "check that slurmctld answers here (`scontrol ping`, SLURM_CONF), then run the command again; "
    "the ranks' records in the job directory are unchanged"
)


class SlurmUnreachable(RemoteError):
    """A Slurm command got no answer from slurmctld (down, unreachable, timed out)."""


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
        raise SlurmUnreachable(f"`{' '.join(argv)}` did not answer within {timeout:g} s", fix=UNREACHABLE_FIX) from None


def says_unknown_job(result: subprocess.CompletedProcess) -> bool:
    return any(text in result.stderr for text in UNKNOWN_JOB)


def answered(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``result`` if slurmctld answered it (a success, or "no such job"); else SlurmUnreachable."""
    if result.returncode != 0 and not says_unknown_job(result):
        said = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        raise SlurmUnreachable(f"`{' '.join(result.args)}` got no answer from Slurm: {said}", fix=UNREACHABLE_FIX)
    return result
