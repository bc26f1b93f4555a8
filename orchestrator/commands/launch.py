"""``dzctl launch``: plan a job on the hostfile's nodes; ``--dry-run`` prints the plan."""

from __future__ import annotations

import json
import secrets as pysecrets
import time

import click

from ..errors import InputError
from ..hostfile import Node, ResourceFilter, load_nodes
from ..options import hosts_options, job_options, json_option, load_job_from_options
from ..plan import LaunchPlan, make_plan, shell_line
from ..spec import LoadedJob, read_env_file


def new_job_id(name: str, now: float | None = None) -> str:
    """``<name>-<UTC time>-<4 hex>``: sortable by start time, unique across controllers."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{name}-{stamp}-{pysecrets.token_hex(2)}"


def nodes_from_options(hostfile: str, include: str, exclude: str, num_nodes, num_gpus) -> list[Node]:
    return load_nodes(hostfile, ResourceFilter(include, exclude, num_nodes, num_gpus))


def secret_names_of(job: LoadedJob) -> tuple[str, ...]:
    """Names defined in ``launch.env_file`` (all secret by definition: that file is for secrets)."""
    if not job.spec.launch.env_file:
        return ()
    path = job.resolve_local(job.spec.launch.env_file)
    return tuple(read_env_file(path, job.where("launch.env_file")))


def plan_from_options(job: LoadedJob, nodes: list[Node], job_id: str) -> LaunchPlan:
    return make_plan(job.spec, nodes, job_id, secret_names=secret_names_of(job))


@click.command("launch")
@job_options
@hosts_options
@click.option("--dry-run", is_flag=True, help="Print the plan; touch no host.")
@json_option
def launch_command(job_file, overrides, runtime, hostfile, include, exclude, num_nodes, num_gpus, dry_run, as_json):
    """Check every node, ship the job, and start one launcher per node."""
    job = load_job_from_options(job_file, overrides, runtime)
    nodes = nodes_from_options(hostfile, include, exclude, num_nodes, num_gpus)
    plan = plan_from_options(job, nodes, new_job_id(job.spec.name))
    if not dry_run:
        raise InputError("launch without --dry-run is not available yet", fix="add --dry-run to see the plan")
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2))
    else:
        click.echo(render_plan(plan))


def render_plan(plan: LaunchPlan) -> str:
    lines = [
        f"job {plan.job}  id {plan.job_id}  runtime {plan.runtime}  accelerator {plan.accelerator}",
        f"world size {plan.world_size} over {len(plan.nodes)} node(s); master {plan.master_addr}:{plan.master_port}",
    ]
    if plan.image:
        lines.append(f"image {plan.image}")
    if plan.secret_env:
        lines.append(f"secrets (env file, 0600 on each node): {', '.join(plan.secret_env)}")
    for node in plan.nodes:
        gpus = ",".join(map(str, node.gpus)) if node.gpus else "-"
        lines += ["", f"node {node.node_rank}: {node.host}  slots {node.slots}  gpus {gpus}"]
        lines.append(f"  job dir    {node.job_dir}")
        lines.append(f"  output dir {node.output_dir}")
        lines.append(f"  run        {shell_line(node.argv)}")
    return "\n".join(lines)


def register(group: click.Group) -> None:
    group.add_command(launch_command)
