"""A job's local inputs, read and checked once on this machine, before any host is touched.

A launch reads the job's own files in several places: the env file with its
secrets, the data set it ships, ``zero.config``, the model's shape for the memory
planner. Each of those is an input error, exit 2, with nothing on the nodes: found
only after preflight ran on every node, or after a job record was written, it would
leave both behind for a job that never started. So ``read_inputs`` reads them all
first, and what it returns (``JobInputs``) is what the planner and the job files
use afterwards: none of them reads the job's files again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..spec.job import SYNTHETIC_DATA, JobSpec, LoadedJob, is_secret_name, read_env_file
from . import fusedloss
from .dsconfig import load_user_config
from .fusedloss import FusedLoss
from .packing import resolve_packing
from .shape import ModelShape, shape_for_job


@dataclass(frozen=True)
class JobInputs:
    """What the job's own files decide; the hardware decides the rest (``resolve.ResolvedJob``)."""

    job: LoadedJob
    secrets: dict[str, str]  # name -> value: secret-named launch.env values and all of launch.env_file
    data_file: Path | None  # the local data file shipped with the job (None: on the nodes, or synthetic)
    user_ds_config: dict[str, Any] | None  # zero.config, read and checked (None: the spec names none)
    shape: ModelShape
    packing: bool  # train.packing, resolved
    fused_loss: FusedLoss  # train.fused_loss, resolved for the model type

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def secret_names(self) -> tuple[str, ...]:
        return tuple(self.secrets)


def read_inputs(job: LoadedJob) -> JobInputs:
    """Read and check every local input of ``job``; raise the input error a launch would otherwise meet later."""
    secrets = job_secrets(job)
    data_file = check_data_file(job)
    user = load_user_config(job)  # zero.config: exists, JSON, stage 3
    shape = shape_for_job(job)  # the memory planner needs the model's shape: config.json, catalogue or model.config
    spec = job.spec
    return JobInputs(
        job=job,
        secrets=secrets,
        data_file=data_file,
        user_ds_config=user,
        shape=shape,
        packing=resolve_packing(spec),
        fused_loss=fusedloss.resolve(spec.train.fused_loss, accelerator=spec.accelerator, model_type=shape.model_type),
    )


def env_file_values(job: LoadedJob) -> dict[str, str]:
    """``launch.env_file`` read locally (all its names are secret: that file is for secrets)."""
    if not job.spec.launch.env_file:
        return {}
    return read_env_file(job.resolve_local(job.spec.launch.env_file), job.where("launch.env_file"))


def secret_env(job: LoadedJob, env_file_values: dict[str, str]) -> dict[str, str]:
    """Secret-named ``launch.env`` values plus everything in ``launch.env_file``."""
    found = {k: v for k, v in job.spec.launch.env.items() if is_secret_name(k)}
    found.update(env_file_values)
    return dict(sorted(found.items()))


def job_secrets(job: LoadedJob) -> dict[str, str]:
    """The secrets the job's nodes get through their 0600 env file."""
    return secret_env(job, env_file_values(job))


def shipped_data(job: LoadedJob) -> Path | None:
    """The local data file to ship with the job, or None if data.path lives on the nodes (or is synthetic)."""
    if job.spec.data.path == SYNTHETIC_DATA or Path(job.spec.data.path).is_absolute():
        return None
    return job.resolve_local(job.spec.data.path)


def check_data_file(job: LoadedJob) -> Path | None:
    """A ``data.path`` relative to the job file is shipped: it must be a readable file here. Returns it."""
    data_file = shipped_data(job)
    if data_file is None:  # absolute: it lives on the nodes; or the synthetic source: nothing to ship
        return None
    where = job.where("data.path")
    if not data_file.exists():
        problem = "no such file"
    elif not data_file.is_file():
        problem = "is not a file"
    else:
        try:
            with data_file.open("rb"):
                return data_file
        except OSError as exc:
            problem = f"cannot be read ({exc.strerror})"
    raise InputError(
        f"{where}: data.path: {data_file} {problem}",
        fix="give a file next to the job file, an absolute path that exists on every node, "
        "or synthetic:random (random full-length rows, to measure throughput)",
    )
