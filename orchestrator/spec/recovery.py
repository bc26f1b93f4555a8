"""The job spec's ``restart:`` and ``notify:`` sections: what happens, unattended, after a fault.

Kept apart from ``job.py`` so the schema's core stays readable; ``JobSpec`` holds
them as ``restart`` and ``notify`` (both optional: without them a failed job waits
for a person, as before).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RESTART_CAUSES = ("node-lost", "rank-failed", "nccl-timeout", "hang")
NOTIFY_EVENTS = ("failed", "restarted", "succeeded")
# ``${NAME}`` in the webhook URL: a secret of the job's env file (or a secret-named launch.env value).
URL_SECRET = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _on_is_a_key(cls, data: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare `on:` key as the boolean true; here it is the `on` list.
        if isinstance(data, dict) and True in data and "on" not in data:
            data = {("on" if key is True else key): value for key, value in data.items()}
        return data


class RestartSpec(_Strict):
    """``restart: {max, on, backoff_s, spare_hosts, final_exit_codes}``: the supervisor's policy."""

    max: int = Field(3, ge=0, le=100)  # restarts, not attempts: max 3 is up to 4 runs
    on: list[Literal["node-lost", "rank-failed", "nccl-timeout", "hang"]] = Field(
        default_factory=lambda: list(RESTART_CAUSES), min_length=1
    )
    # Seconds between the gang being down and the relaunch: a node that rebooted gets time to come back.
    backoff_s: float = Field(30.0, ge=0, le=3600)
    # Hostfile lines (``HOST`` or ``HOST slots=N``) that may take a failed node's place.
    spare_hosts: list[str] = Field(default_factory=list)
    # A rank's exit codes that no restart can fix (the user's own: a script that exits 3 on bad labels).
    final_exit_codes: list[int] = Field(default_factory=list)

    @field_validator("spare_hosts")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        for line in value:
            if not line.strip() or "\n" in line or line.strip().startswith("#"):
                raise ValueError(f"{line!r}: each spare is one hostfile line, HOST or HOST slots=N")
        return value


class NotifySpec(_Strict):
    """``notify: {webhook, on, timeout_s}``: one JSON POST per event; never fails the job."""

    # http(s) URL; ``${NAME}`` parts are filled from the job's secrets (launch.env_file), never stored.
    webhook: str = Field(pattern=r"^https?://\S+$")
    on: list[Literal["failed", "restarted", "succeeded"]] = Field(
        default_factory=lambda: list(NOTIFY_EVENTS), min_length=1
    )
    timeout_s: float = Field(5.0, gt=0, le=30)  # bounded: a hung receiver must not hold the supervisor


class StallSpec(_Strict):
    """``stall:``: when a job whose ranks all run counts as hung (observe/stall.py applies it).

    Training: no step has ended for ``multiple`` x the median of the recent steps, and at least
    ``floor_s`` (a short step must not trip it on a GC pause or a slow log write). Before the
    first step, and in the phases that are not steps, a bound of their own: ``first_step_s``
    (or ``multiple`` x the plan's predicted step when longer), ``data_build_s``, ``model_load_s``,
    ``save_s`` (a checkpoint, the consolidated model, an evaluation).
    """

    multiple: float = Field(10.0, ge=3, le=1000)  # below 3 a step that triples would read as a hang
    floor_s: float = Field(180.0, ge=5, le=86400)
    first_step_s: float = Field(900.0, ge=5, le=86400)
    data_build_s: float = Field(3600.0, ge=5, le=86400)
    model_load_s: float = Field(1800.0, ge=5, le=86400)
    save_s: float = Field(1800.0, ge=5, le=86400)


# Where each rank's evidence lives on its node: ``<output_dir>/dzctl-ranks/<job id>/``, beside the
# checkpoints (the output dir is writable by the ranks under both runtimes, and mounted at the same
# path in a container, so the controller reads it over SSH as the ranks wrote it). The trainer writes
# there (train/hang/stacks.py), the controller reads it (observe/evidence.py).
RANK_FILES_DIR = "dzctl-ranks"
PULSE_FILE = "pulse.json"  # rank 0: the phase, the last step's end and the recent step times


def rank_files_dir(output_dir: str, job_id: str) -> str:
    return f"{output_dir.rstrip('/')}/{RANK_FILES_DIR}/{job_id}"
