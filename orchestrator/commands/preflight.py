"""``dzctl preflight``: check every node of a job before launch; exit 1 if any check fails."""

from __future__ import annotations

import json

import click
from rich.console import Console

from ..errors import RuntimeFailure
from ..preflight import print_report, run_preflight
from ..preflight.collective import collective_unless_skipped
from ..transport.pool import HostPool
from .busy import busy
from .options import (
    collective_options,
    hosts_options,
    job_options,
    json_option,
    load_job_from_options,
    nodes_from_options,
    ssh_options,
)


@click.command("preflight")
@job_options
@hosts_options
@ssh_options
@collective_options
@json_option
def preflight_command(
    job_file, overrides, runtime, hostfile, include, exclude, num_nodes, num_gpus, ssh_config, trust_new_hosts,
    skip_collective, collective_timeout, as_json,
):  # fmt: skip
    """Check every node of JOB (SSH, GPUs, Docker, image, network, disk) and say how to fix what fails."""
    job = load_job_from_options(job_file, overrides, runtime)
    nodes = nodes_from_options(hostfile, include, exclude, num_nodes, num_gpus)
    with (
        HostPool([n.host for n in nodes], ssh_config=ssh_config, trust_new_hosts=trust_new_hosts) as pool,
        busy(f"preflight: checking {len(nodes)} node(s)"),
    ):
        report = run_preflight(job, nodes, pool)
        # Last: it starts the job's launcher on every node, which needs what the other checks check.
        collective_unless_skipped(job.spec, nodes, pool, report, skip=skip_collective, timeout_s=collective_timeout)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report, Console(highlight=False, soft_wrap=True))
    if not report.ok:
        failed = sorted({host for host, _ in report.failures()})
        raise RuntimeFailure(
            f"preflight failed on {len(failed)} of {len(report.hosts)} node(s): {', '.join(failed)}",
            fix="apply the fixes listed above, then rerun dzctl preflight" if not as_json else "see checks[].fix",
        )


def register(group: click.Group) -> None:
    group.add_command(preflight_command)
