"""Click options shared by several commands, defined once so they read the same everywhere."""

from __future__ import annotations

import os

import click

from ..spec.hostfile import Node, ResourceFilter, load_nodes
from ..spec.job import LoadedJob, load_job


def job_options(func):
    """``JOB`` plus ``--set`` and ``--runtime``: every command that takes a job has these."""
    func = click.option(
        "--runtime",
        type=click.Choice(["docker", "process"]),
        default=None,
        help="Override the job's runtime.",
    )(func)
    func = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a spec key (dotted path, YAML-typed value). Repeatable.",
    )(func)
    return click.argument("job_file", metavar="JOB", type=click.Path(dir_okay=False))(func)


def hosts_options(func, required: bool = True):
    """``--hosts`` and DeepSpeed's resource filters."""
    func = click.option("--num-gpus", type=int, default=None, help="Use the first N GPUs of each node.")(func)
    func = click.option("--num-nodes", type=int, default=None, help="Use the first N nodes of the hostfile.")(func)
    filter_metavar = "NAME[:SLOT[,SLOT]]@..."
    func = click.option("--exclude", default="", metavar=filter_metavar, help="Hosts/GPUs to leave out.")(func)
    func = click.option("--include", default="", metavar=filter_metavar, help="Only these hosts/GPUs.")(func)
    return click.option(
        "--hosts",
        "hostfile",
        required=required,
        type=click.Path(dir_okay=False),
        help="DeepSpeed-format hostfile: 'HOST slots=N' per line.",
    )(func)


def optional_hosts_options(func):
    """``hosts_options`` where ``--hosts`` may be left out (``launch --slurm``: Slurm picks the nodes)."""
    return hosts_options(func, required=False)


def slurm_options(func):
    """``--slurm`` and what to ask Slurm for; each overrides the spec's ``slurm:`` key of that name."""
    func = click.option("--account", default=None, help="Slurm account to charge (sbatch --account).")(func)
    func = click.option("--time", "time_limit", default=None, help="Slurm time limit (sbatch --time).")(func)
    func = click.option("--gpus-per-node", type=click.IntRange(min=1), default=None, help="GPUs per Slurm node.")(func)
    func = click.option(
        "--nodes", "nodes_wanted", type=click.IntRange(min=1), default=None, help="Slurm nodes to allocate."
    )(func)
    func = click.option("--partition", default=None, help="Slurm partition (sbatch --partition).")(func)
    return click.option(
        "--slurm",
        is_flag=True,
        help="Submit to Slurm (sbatch) instead of starting on --hosts; the default when the spec has slurm:.",
    )(func)


def ssh_options(func):
    func = click.option(
        "--trust-new-hosts",
        is_flag=True,
        help="Record the keys of hosts not yet in known_hosts (a changed key is still refused).",
    )(func)
    return click.option(
        "--ssh-config",
        type=click.Path(dir_okay=False),
        default=lambda: os.environ.get("DZCTL_SSH_CONFIG"),
        help="OpenSSH client config (env DZCTL_SSH_CONFIG; default ~/.ssh/config).",
    )(func)


def json_option(func):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")(func)


def load_job_from_options(job_file: str, overrides: tuple[str, ...], runtime: str | None) -> LoadedJob:
    return load_job(job_file, overrides, runtime)


def nodes_from_options(hostfile: str, include: str, exclude: str, num_nodes, num_gpus) -> list[Node]:
    """The nodes ``hosts_options`` select: the hostfile, then DeepSpeed's filters."""
    return load_nodes(hostfile, ResourceFilter(include, exclude, num_nodes, num_gpus))


def hardware_options(func):
    """``--gpu-mem-gib`` and ``--host-mem-gib``: the nodes' memory, for planning without preflight."""
    func = click.option(
        "--host-mem-gib",
        type=float,
        default=None,
        metavar="N",
        help="RAM of each node in GiB; needed to check offloaded states (read on localhost).",
    )(func)
    return click.option(
        "--gpu-mem-gib",
        type=float,
        default=None,
        metavar="N",
        help="Memory of each GPU in GiB (nvidia-smi memory.total / 1024; H200: 140.4; read on localhost).",
    )(func)


def collective_options(func):
    """``--skip-collective`` and ``--collective-timeout``: the collective check, on preflight and launch."""
    func = click.option(
        "--collective-timeout",
        type=click.FloatRange(min=1),
        default=60.0,
        show_default=True,
        metavar="SECONDS",
        help="How long the collective check's ranks have to form their group.",
    )(func)
    return click.option(
        "--skip-collective",
        is_flag=True,
        help="Do not run the all-reduce across every GPU of every node (e.g. a large fleet known to be good).",
    )(func)
