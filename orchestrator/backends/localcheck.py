"""Everything about a launch that can be checked on this machine, checked before any host is touched.

A launch reads the job's local files in several places (the data set it ships,
``zero.config``, the model's shape for the memory planner). Each of those is an
input error, exit 2, with nothing on the nodes: found only after preflight ran on
every node, or after a job record was written, it would leave both behind for a
job that never started. So ``dzctl launch`` calls ``check_local_inputs`` first,
and only what needs the nodes (their GPUs, memory, images) is left for later.
"""

from __future__ import annotations

from ..errors import InputError
from ..planning.dsconfig import load_user_config
from ..planning.memory.fromjob import allowed_from_job, precision_for_job
from ..planning.shape import shape_for_job
from ..spec.job import LoadedJob
from .jobfiles import shipped_data


def check_local_inputs(job: LoadedJob) -> None:
    """Raise the input error launch would otherwise meet later; return quietly when all is readable."""
    check_data_file(job)
    load_user_config(job)  # zero.config: exists, JSON, stage 3
    allowed_from_job(job)  # zero.config + zero.overrides as the planner reads them
    precision_for_job(job)
    shape_for_job(job)  # the memory planner needs the model's shape: config.json, catalogue or model.config


def check_data_file(job: LoadedJob) -> None:
    """A ``data.path`` relative to the job file is shipped: it must be a readable file here."""
    data_file = shipped_data(job)
    if data_file is None:  # absolute: it lives on the nodes; or the synthetic source: nothing to ship
        return
    where = job.where("data.path")
    if not data_file.exists():
        problem = "no such file"
    elif not data_file.is_file():
        problem = "is not a file"
    else:
        try:
            with data_file.open("rb"):
                return
        except OSError as exc:
            problem = f"cannot be read ({exc.strerror})"
    raise InputError(
        f"{where}: data.path: {data_file} {problem}",
        fix="give a file next to the job file, an absolute path that exists on every node, "
        "or synthetic:random (random full-length rows, to measure throughput)",
    )
