"""``dzctl launch``: check every node, plan memory, ship the job, start one launcher per node."""

from __future__ import annotations

import json
import logging
import secrets as pysecrets
import sys
import time

import click
from rich.console import Console

from ..busy import busy
from ..dsconfig import BF16_MIN_COMPUTE_CAPABILITY, Resolved, bf16_supported_by
from ..errors import RuntimeFailure, SpecError
from ..hostfile import Node
from ..jobfiles import job_files, resolved_spec, secret_env
from ..launch import Phases, probe_output_storage, start_job
from ..localcheck import check_local_inputs
from ..memory import nodes_description, nvme_reading, plan_for_job, require_fit
from ..options import (
    collective_options,
    hosts_options,
    job_options,
    json_option,
    load_job_from_options,
    nodes_from_options,
    ssh_options,
)
from ..plan import LaunchPlan, make_plan, shell_line
from ..preflight import run_preflight
from ..preflight.collective import collective_unless_skipped
from ..preflight.render import print_report
from ..spec import LoadedJob, read_env_file
from ..ssh import HostPool
from ..store import JobStore
from .follow import follow_job, output_mode

log = logging.getLogger(__name__)


def new_job_id(name: str, now: float | None = None) -> str:
    """``<name>-<UTC time>-<4 hex>``: sortable by start time, unique across controllers."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{name}-{stamp}-{pysecrets.token_hex(2)}"


def env_file_values(job: LoadedJob) -> dict[str, str]:
    """``launch.env_file`` read locally (all its names are secret: that file is for secrets)."""
    if not job.spec.launch.env_file:
        return {}
    return read_env_file(job.resolve_local(job.spec.launch.env_file), job.where("launch.env_file"))


def memory_choice(
    job: LoadedJob,
    nodes: list[Node],
    gpu_mem_gib,
    host_mem_gib,
    compute_capability: float | None = None,
    nvme: dict[str, dict] | None = None,
) -> tuple[Resolved, dict]:
    """The planner's configuration for these nodes, or DoesNotFit with the numbers.

    ``compute_capability`` (the lowest preflight found) decides ``precision: auto``:
    bf16 from Ampere on, fp16 before. A job that insists on bf16 there is refused
    here, before anything starts, rather than by every rank after loading the model.
    """
    bf16 = bf16_supported_by(compute_capability)
    slots = [n.num_slots for n in nodes]
    plan, ds_config = plan_for_job(
        job,
        slots,
        gpu_mem_gib=gpu_mem_gib,
        host_mem_gib=host_mem_gib,
        bf16_supported=bf16,
        # Only nodes where preflight found zero.nvme_path usable report it; all must.
        nvme=nvme_reading(nvme) if nvme and len(nvme) == len(nodes) else None,
    )
    if plan.nvme_step_s is not None:
        _note(f"offload to NVMe: about {plan.nvme_step_s:.1f} s of disk I/O per optimizer step (preflight's bandwidth)")
    if not bf16 and plan.precision == "bf16":  # auto would have become fp16: the job forces bf16
        raise SpecError(
            f"{job.where('train.precision')}: the job asks for bf16, but the nodes' GPUs have compute "
            f"capability {compute_capability:g} and bf16 needs {BF16_MIN_COMPUTE_CAPABILITY:g} or newer "
            "(Ampere, Hopper)",
            fix="set train.precision: auto (fp16 on these GPUs), or remove bf16 from zero.config/zero.overrides",
        )
    require_fit(plan, nodes_description(slots, plan.hardware.gpu_mem_gib, host_mem_gib))
    return plan.resolved(), ds_config


@click.command("launch")
@job_options
@hosts_options
@ssh_options
@click.option("--dry-run", is_flag=True, help="Print the plan; touch no host.")
@click.option(
    "--follow/--detach",
    default=None,
    help="Stream every node's output until the job ends (default on a terminal), or return once all nodes run.",
)
@click.option("--raw", is_flag=True, help="With --follow: the ranks' own interleaved output instead of the view.")
@click.option("--replace", is_flag=True, help="Stop a running job of the same name first.")
@click.option("--no-distribute", is_flag=True, help="Do not copy the image to nodes that lack it; fail instead.")
@collective_options
@json_option
def launch_command(
    job_file, overrides, runtime, hostfile, include, exclude, num_nodes, num_gpus, ssh_config, trust_new_hosts,
    dry_run, follow, raw, replace, no_distribute, skip_collective, collective_timeout, as_json,
):  # fmt: skip
    """Check every node, ship the job, and start one launcher per node."""
    job = load_job_from_options(job_file, overrides, runtime)
    nodes = nodes_from_options(hostfile, include, exclude, num_nodes, num_gpus)
    secrets = secret_env(job, env_file_values(job))
    job_id = new_job_id(job.spec.name)
    if not dry_run:
        check_local_inputs(job)  # input errors exit 2 here: no host touched, no job recorded
    if dry_run:
        plan = make_plan(job.spec, nodes, job_id, secret_names=tuple(secrets))
        click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else render_plan(plan))
        return
    phases = Phases()
    started_at = time.monotonic()
    with HostPool([n.host for n in nodes], ssh_config=ssh_config, trust_new_hosts=trust_new_hosts) as pool:
        with phases.timed("preflight"), busy(f"preflight: checking {len(nodes)} node(s)"):
            report = run_preflight(job, nodes, pool)
        if job.spec.runtime == "docker" and not no_distribute and _image_missing(report):
            # The one failure launch repairs itself: ship the image, then check again.
            with phases.timed("distribute"):
                _distribute(job, nodes, pool)
            with phases.timed("preflight"):
                report = run_preflight(job, nodes, pool)
        _require_preflight(report, as_json)
        # The probe container's start and imports: container time, not dzctl's own (see the benchmark).
        phases.seconds["preflight_container_probe"] = max(report.container_probe_s.values(), default=0.0)
        gpu_mem = _min_reading(report, "gpu_mem_gib")
        host_mem = _min_reading(report, "host_mem_gib")
        capability = _min_reading(report, "gpu_compute_capability")
        with phases.timed("memory_plan"):
            resolved, ds_config = memory_choice(job, nodes, gpu_mem, host_mem, capability, report.nvme)
        # Last before the start, as the model would load: every rank of every node in one all-reduce.
        with phases.timed("collective"):
            collective_unless_skipped(
                job.spec, nodes, pool, report, skip=skip_collective, timeout_s=collective_timeout, job_id=job_id
            )
        _require_preflight(report, quiet=True)
        plan = make_plan(
            job.spec,
            nodes,
            job_id,
            secret_names=tuple(secrets),
            master_addr=report.master_addr,
            interfaces=report.interfaces,
            infiniband_hosts=frozenset(h for h, devices in report.infiniband.items() if devices),
        )
        storage = job.spec.train.output_storage
        if storage == "auto":
            with phases.timed("storage_probe"):
                storage = probe_output_storage(plan, pool)
        files = {n.node_rank: job_files(job, plan, n, nodes, ds_config, resolved, secrets, storage) for n in plan.nodes}
        with JobStore() as store:
            started = start_job(
                job,
                plan,
                files,
                pool,
                store,
                spec_record=resolved_spec(job, plan, plan.nodes[0], resolved, storage),
                ssh_config=ssh_config,
                replace=replace,
                phases=phases,
            )
            store.set_preflight(started.job_id, {"collective": report.collective})
            phases.seconds["total_to_running"] = round(time.monotonic() - started_at, 3)
            log.debug("launch phases: %s", phases.seconds)
            _note(f"started {started.job_id} on {len(started.hosts)} node(s): {', '.join(started.hosts)}")
            if follow is None:
                follow = sys.stdout.isatty() and not as_json
            if not follow:
                if as_json:
                    running = {"job": plan.job, "job_id": plan.job_id, "state": "running", "phases_s": phases.seconds}
                    click.echo(json.dumps(running))
                return
            # With --json, stdout keeps its one object and stderr the ranks' raw stream, as before:
            # a script asking for JSON wants every line, each prefixed with its rank and host.
            mode = "raw" if as_json else output_mode(raw)
            status = follow_job(store.get(plan.job_id), pool, store, quiet=as_json, mode=mode)
    if as_json:
        click.echo(json.dumps(status.to_dict()))
    if status.state != "succeeded":
        failure = status.first_failure
        where = f": rank {failure['node_rank']} on {failure['host']}: {failure['reason']}" if failure else ""
        raise RuntimeFailure(f"job {plan.job_id} {status.state}{where}", fix=f"dzctl logs {plan.job_id} --tail 100")


def _note(text: str) -> None:
    # Progress notes go to stderr: with --json, stdout holds exactly one object.
    click.echo(text, err=True)


def _min_reading(report, name: str) -> float | None:
    values = getattr(report, name, None)
    if isinstance(values, dict):
        values = [v for v in values.values() if v is not None]
        return min(values) if values else None
    return values


def _image_missing(report) -> bool:
    return any(check.name == "image" for _, check in report.failures())


def _require_preflight(report, quiet: bool) -> None:
    """The same checks as `dzctl preflight`; nothing starts unless every node passes."""
    if not report.ok or not quiet:
        print_report(report, Console(stderr=True, highlight=False, soft_wrap=True))
    if not report.ok:
        failed = sorted({host for host, _ in report.failures()})
        raise RuntimeFailure(
            f"preflight failed on {len(failed)} of {len(report.hosts)} node(s): {', '.join(failed)}; "
            "nothing was started",
            fix="apply the fixes listed above, then launch again",
        )


def _distribute(job: LoadedJob, nodes: list[Node], pool: HostPool) -> None:
    from ..distribute import distribute_image

    _note(f"distributing {job.spec.image} to the nodes that lack it")
    result = distribute_image(job.spec.image, nodes, pool)
    result.raise_on_failure()


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
