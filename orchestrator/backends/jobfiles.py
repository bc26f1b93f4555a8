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

import yaml

from ..planning.launchplan import CONTAINER_JOB_DIR, NodePlan
from ..planning.resolve import ResolvedJob
from ..spec.job import is_secret_name

SECRET_MODE = 0o600  # only the node's user may read secrets (and docker, reading --env-file as root)


@dataclass(frozen=True)
class JobFile:
    name: str  # relative to the job directory
    content: bytes
    mode: int = 0o644


def node_spec(job: ResolvedJob, node: NodePlan) -> dict:
    """The spec a node's trainer reads: concrete, self-contained, secret-free (the job record keeps node 0's)."""
    spec = job.spec
    data = spec.model_dump(mode="json")
    job_dir = CONTAINER_JOB_DIR if job.plan.runtime == "docker" else node.job_dir
    data["train"]["output_dir"] = node.output_dir
    if job.output_storage is not None:
        data["train"]["output_storage"] = job.output_storage
    for item in job.inputs.shipped:
        # The node reads its copy; errors name the user's file (shipped_from), not the copy.
        section = data["data"]["eval"] if item.part == "eval" else data["data"]
        target = section if section["sources"] is None else section["sources"][item.index]
        target["shipped_from"] = target["path"]
        target["path"] = f"{job_dir}/{item.name}"
    template = job.inputs.chat_template
    if template.text is not None and data["data"]["template"] not in ("chatml", "plain"):
        data["data"]["template_text"] = template.text  # a PATH.jinja travels inside job.yaml
    settings = job.settings
    data["train"]["micro_batch_size"] = settings.micro_batch_size
    data["train"]["gradient_checkpointing"] = settings.checkpointing_setting
    data["train"]["precision"] = settings.precision
    # "trl" is the planner's word for a preference stage's loss (TRL's own fused LM head, which
    # train.fused_loss does not choose): the job's own value stays as written.
    if settings.fused_loss not in (None, "trl"):
        data["train"]["fused_loss"] = settings.fused_loss
    data["zero"]["offload"] = (
        "nvme"
        if settings.nvme_path is not None
        else "all"
        if settings.offload_param
        else "optimizer"
        if settings.offload_optimizer
        else "none"
    )
    data["train"]["packing"] = job.inputs.packing
    # ds_config.json beside job.yaml is authoritative; the user's file was merged into it.
    data["zero"]["config"] = None
    # Secrets reach the ranks through the env file, never through job.yaml.
    data["launch"]["env"] = {k: v for k, v in spec.launch.env.items() if not is_secret_name(k)}
    data["launch"]["env_file"] = None
    return data


def job_files(job: ResolvedJob, node: NodePlan) -> list[JobFile]:
    files = [
        JobFile("job.yaml", yaml.safe_dump(node_spec(job, node), sort_keys=False).encode()),
        JobFile("ds_config.json", (json.dumps(job.ds_config, indent=2) + "\n").encode()),
        JobFile("hostfile", "".join(f"{n.host} slots={n.num_slots}\n" for n in job.nodes).encode()),
    ]
    secrets = job.inputs.secrets
    if secrets:
        files.append(JobFile("env", "".join(f"{k}={v}\n" for k, v in secrets.items()).encode(), SECRET_MODE))
    return files
