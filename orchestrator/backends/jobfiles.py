"""The files of a job directory, as bytes: pure, so tests compare them whole.

Every node gets ``<remote_dir>/jobs/<job_id>/`` holding:

- ``job.yaml``: the spec as it will run, every ``auto`` resolved, with this
  node's output directory and the in-container data path written in;
- ``ds_config.json``: the DeepSpeed config the planner chose;
- ``hostfile``: the nodes of the job, in rank order;
- ``env`` (mode 0600, only when there are secrets): ``NAME=value`` lines;
- ``data/<file>``: the data set, when ``data.path`` is a file next to the job
  (an absolute ``data.path`` names shared storage on the nodes and is left there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..planning.dsconfig import Resolved
from ..planning.launchplan import CONTAINER_JOB_DIR, LaunchPlan, NodePlan
from ..planning.packing import resolve_packing
from ..spec.hostfile import Node
from ..spec.job import SYNTHETIC_DATA, LoadedJob, is_secret_name

SECRET_MODE = 0o600  # only the node's user may read secrets (and docker, reading --env-file as root)


@dataclass(frozen=True)
class JobFile:
    name: str  # relative to the job directory
    content: bytes
    mode: int = 0o644


def shipped_data(job: LoadedJob) -> Path | None:
    """The local data file to ship with the job, or None if data.path lives on the nodes (or is synthetic)."""
    if job.spec.data.path == SYNTHETIC_DATA or Path(job.spec.data.path).is_absolute():
        return None
    return job.resolve_local(job.spec.data.path)


def secret_env(job: LoadedJob, env_file_values: dict[str, str]) -> dict[str, str]:
    """Secret-named ``launch.env`` values plus everything in ``launch.env_file``."""
    found = {k: v for k, v in job.spec.launch.env.items() if is_secret_name(k)}
    found.update(env_file_values)
    return dict(sorted(found.items()))


def resolved_spec(
    job: LoadedJob, plan: LaunchPlan, node: NodePlan, resolved: Resolved | None, output_storage: str | None = None
) -> dict:
    """The spec a node's trainer reads: concrete, self-contained, secret-free."""
    data = job.spec.model_dump(mode="json")
    job_dir = CONTAINER_JOB_DIR if plan.runtime == "docker" else node.job_dir
    data["train"]["output_dir"] = node.output_dir
    if output_storage is not None:
        data["train"]["output_storage"] = output_storage
    if shipped_data(job) is not None:
        data["data"]["path"] = f"{job_dir}/data/{Path(job.spec.data.path).name}"
    if resolved is not None:
        data["train"]["micro_batch_size"] = resolved.micro_batch_size
        data["train"]["gradient_checkpointing"] = resolved.gradient_checkpointing
        data["train"]["precision"] = resolved.precision
        if resolved.fused_loss is not None:
            data["train"]["fused_loss"] = resolved.fused_loss
        data["zero"]["offload"] = (
            "nvme"
            if resolved.nvme_path is not None
            else "all"
            if resolved.offload_param
            else "optimizer"
            if resolved.offload_optimizer
            else "none"
        )
    data["train"]["packing"] = resolve_packing(job.spec)
    # ds_config.json beside job.yaml is authoritative; the user's file was merged into it.
    data["zero"]["config"] = None
    # Secrets reach the ranks through the env file, never through job.yaml.
    data["launch"]["env"] = {k: v for k, v in job.spec.launch.env.items() if not is_secret_name(k)}
    data["launch"]["env_file"] = None
    return data


def job_files(
    job: LoadedJob,
    plan: LaunchPlan,
    node: NodePlan,
    nodes: list[Node],
    ds_config: dict,
    resolved: Resolved | None,
    secrets: dict[str, str],
    output_storage: str | None = None,
) -> list[JobFile]:
    spec = resolved_spec(job, plan, node, resolved, output_storage)
    files = [
        JobFile("job.yaml", yaml.safe_dump(spec, sort_keys=False).encode()),
        JobFile("ds_config.json", (json.dumps(ds_config, indent=2) + "\n").encode()),
        JobFile("hostfile", "".join(f"{n.host} slots={n.num_slots}\n" for n in nodes).encode()),
    ]
    if secrets:
        files.append(JobFile("env", "".join(f"{k}={v}\n" for k, v in secrets.items()).encode(), SECRET_MODE))
    return files
