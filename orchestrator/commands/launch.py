"""``dzctl launch``: parse the options, run the launch sequence (``orchestrator.backends.launcher``), render it."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from ..backends import launcher
from ..backends.fleet import SshFleet
from ..backends.recovery import supervisor as recovery
from ..errors import DzError, InputError, RuntimeFailure, SpecError
from ..observe.rankfailure import failure_lines
from ..observe.store import JobStore
from ..planning.dsconfig import auto_filled, auto_left
from ..planning.launchplan import LaunchPlan, shell_line
from ..planning.speed.spacing import describe as describe_spacing
from ..transport.pool import HostPool
from .follow import follow_job, output_mode
from .localhw import hardware_for
from .options import (
    collective_options,
    hardware_options,
    job_options,
    json_option,
    load_job_from_options,
    nodes_from_options,
    optional_hosts_options,
    slurm_options,
    ssh_options,
)
from .plan import DEFAULT_TOP, ConsoleProgress, render_tune, run_tune, tune_settings
from .plan import render as render_memory

log = logging.getLogger(__name__)


@click.command("launch")
@job_options
@optional_hosts_options
@slurm_options
@ssh_options
@click.option(
    "--dry-run",
    is_flag=True,
    help="Run every check the launch runs before touching a host (spec, data, model, memory plan); print the plan.",
)
@hardware_options
@click.option(
    "--follow/--detach",
    default=None,
    help="Stream every node's output until the job ends (default on a terminal), or return once all nodes run.",
)
@click.option("--raw", is_flag=True, help="With --follow: the ranks' own interleaved output instead of the view.")
@click.option("--replace", is_flag=True, help="Stop a running job of the same name first.")
@click.option("--no-distribute", is_flag=True, help="Do not copy the image to nodes that lack it; fail instead.")
@click.option(
    "--tune",
    is_flag=True,
    help="First run the planner's top candidates a few steps each on the first node (as `dzctl tune`), then "
    "launch with the fastest.",
)
@collective_options
@json_option
def launch_command(
    job_file, overrides, runtime, hostfile, include, exclude, num_nodes, num_gpus,
    slurm, partition, nodes_wanted, gpus_per_node, time_limit, account,
    ssh_config, trust_new_hosts, dry_run, gpu_mem_gib, host_mem_gib, follow, raw, replace, no_distribute, tune,
    skip_collective, collective_timeout,
    as_json,
):  # fmt: skip
    """Check every node, ship the job, and start one launcher per node."""
    job = load_job_from_options(job_file, overrides, runtime)
    given = [
        flag for flag, value in (("--gpu-mem-gib", gpu_mem_gib), ("--host-mem-gib", host_mem_gib)) if value is not None
    ]
    on_slurm = slurm or (hostfile is None and job.spec.slurm is not None)
    if given and on_slurm:
        raise click.UsageError(f"{given[0]}: a Slurm job is planned on slurm.gpu_mem_gib (set it in the spec or --set)")
    if given and not dry_run:
        raise click.UsageError(f"{given[0]} is for --dry-run: the launch reads every node's memory in preflight")
    if slurm and hostfile is not None:
        raise click.UsageError("--slurm and --hosts: Slurm picks the nodes; give one or the other")
    if tune and (dry_run or on_slurm):
        raise click.UsageError(
            f"--tune runs the candidates on the first node of --hosts: not with {'--dry-run' if dry_run else 'Slurm'}"
            " (run `dzctl tune JOB --hosts FILE` on one node of the kind first)"
        )
    if on_slurm:
        refuse_recovery_on_slurm(job)
        request = launcher.slurm_request(
            job, partition=partition, nodes=nodes_wanted, gpus_per_node=gpus_per_node, time=time_limit,
            account=account,
        )  # fmt: skip
        launch_on_slurm(job, request, dry_run=dry_run, follow=follow, as_json=as_json)
        return
    if hostfile is None:
        raise click.UsageError("give --hosts FILE, or --slurm (or a slurm: section in the job spec)")
    nodes = nodes_from_options(hostfile, include, exclude, num_nodes, num_gpus)
    if dry_run:
        hardware = hardware_for(nodes, gpu_mem_gib, host_mem_gib)
        checked = launcher.dry_run(job, nodes, gpu_mem_gib=hardware.gpu_mem_gib, host_mem_gib=hardware.host_mem_gib)
        require_known_host_ram(checked.memory)
        click.echo(json.dumps(dry_run_dict(checked), indent=2) if as_json else render_dry_run(checked))
        return
    options = launcher.LaunchOptions(
        replace=replace,
        distribute=not no_distribute,
        skip_collective=skip_collective,
        collective_timeout_s=collective_timeout,
        ssh_config=ssh_config,
    )
    progress = ConsoleProgress(as_json)
    if tune:
        # The calibration it writes is what the launch's plan reads next ($DZCTL_HOME/calibration.json).
        tuned = run_tune(job, nodes, tune_settings(DEFAULT_TOP, 6, 2, 900.0, ssh_config), progress, trust_new_hosts)
        progress.note(render_tune(tuned))
    if recovery.supervised(job.spec):
        check_webhook(job)  # a ${NAME} the env file lacks: exit 2 before any host is touched
    with HostPool([n.host for n in nodes], ssh_config=ssh_config, trust_new_hosts=trust_new_hosts) as pool:
        prepared = launcher.prepare(job, nodes, pool, options, progress)
        plan, phases = prepared.plan, prepared.phases
        with JobStore() as store:
            launcher.execute(prepared, SshFleet(pool, store), progress)
            log.debug("launch phases: %s", phases.seconds)
            if recovery.supervised(job.spec):
                launch_args = supervisor_args(job, hostfile, include, exclude, num_nodes, num_gpus, ssh_config,
                                              trust_new_hosts, skip_collective, collective_timeout)  # fmt: skip
                pid = recovery.start_supervisor(plan.job_id, plan.job, launch_args)
                progress.note(f"supervisor: pid {pid}, log {recovery.log_file(plan.job_id)}")
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
            status = follow_job(store.get(plan.job_id), pool, store, quiet=as_json, mode=mode, report_failure=False)
            if recovery.supervised(job.spec):
                status = follow_restarts(plan.job_id, status, store, progress, ssh_config, trust_new_hosts,
                                         quiet=as_json, mode=mode)  # fmt: skip
    if as_json:
        click.echo(json.dumps(status.to_dict()))
    if status.state != "succeeded":
        raise job_failed(plan.job_id, status.state, status.first_failure, shown_above=mode == "live")


def follow_restarts(lineage, status, store, progress, ssh_config, trust_new_hosts, *, quiet, mode):
    """After a failed attempt, follow the supervisor's next one, until one succeeds or it gives up."""
    import time

    from ..backends.recovery.record import ENDED, SupervisionStore

    following = status.job_id
    with SupervisionStore() as supervision:
        while status.state == "failed":
            found = supervision.get(lineage)
            if found.current_job_id != following:
                record = store.get(found.current_job_id)
                cause = found.restarts[-1]["why"] if found.restarts else "restarted"
                progress.note(f"restarted as {record.job_id}: {cause}")
                with HostPool(record.hosts, ssh_config=ssh_config, trust_new_hosts=trust_new_hosts) as pool:
                    status = follow_job(record, pool, store, quiet=quiet, mode=mode, report_failure=False)
                following = record.job_id
            elif found.state in ENDED:
                if found.final:
                    progress.note(f"supervisor: {found.final}")
                return status
            else:
                time.sleep(1.0)
    return status


def require_known_host_ram(memory) -> None:
    """A dry run whose plan offloads to host RAM it was not told: not a success (exit 2, naming --host-mem-gib).

    As for GPU memory: the launch reads each node's RAM in preflight and refuses a plan that
    does not fit it; a dry run that has no RAM to check the offloaded states against cannot say
    the launch would run (72B on 2 × 4 A100-40GB needs 704 GiB per node).
    """
    if memory.hardware.host_mem_gib is not None or not memory.fits or memory.choice.offload == "none":
        return
    needed = max(memory.host_per_node) / 2**30
    raise InputError(
        f"the plan offloads to host RAM (offload {memory.choice.offload}: {needed:.2f} GiB per node), "
        "and the nodes' RAM is not known: the dry run cannot say it fits",
        fix="give --host-mem-gib N (each node's RAM in GiB, as `free -g` shows it), as for --gpu-mem-gib",
    )


def refuse_recovery_on_slurm(job) -> None:
    """Slurm jobs have no supervisor yet: a restart policy there would be silently ignored."""
    for key in ("restart", "notify"):
        if getattr(job.spec, key) is not None:
            raise SpecError(
                f"{job.where(key)}: {key}: is for jobs launched over SSH (--hosts); a Slurm job is not "
                "supervised by dzctl yet",
                fix=f"remove {key}: for --slurm; Slurm itself can requeue a failed job (sbatch --requeue)",
            )


def check_webhook(job) -> None:
    if job.spec.notify is not None:
        from ..backends.recovery.notify import webhook_url
        from ..planning.inputs import job_secrets

        webhook_url(job.spec.notify, job_secrets(job), job.where("notify.webhook"))


def supervisor_args(job, hostfile, include, exclude, num_nodes, num_gpus, ssh_config, trust_new_hosts,
                    skip_collective, collective_timeout) -> dict:  # fmt: skip
    """What each restart needs to run the launch again: absolute paths, the user's own --set items."""
    return {
        "job_file": str(Path(job.path).resolve()),
        "overrides": list(job.overrides),
        "hostfile": str(Path(hostfile).resolve()),
        "include": include,
        "exclude": exclude,
        "num_nodes": num_nodes,
        "num_gpus": num_gpus,
        "ssh_config": str(Path(ssh_config).expanduser().resolve()) if ssh_config else None,
        "trust_new_hosts": trust_new_hosts,
        "skip_collective": skip_collective,
        "collective_timeout": collective_timeout,
    }


def job_failed(job_id: str, state: str, failure: dict | None, *, shown_above: bool = False) -> DzError:
    """The launch's error for a job that did not succeed: the first failed rank's message and own fix, once.

    ``shown_above``: the live view's last frame has them at its top already; the error then only
    says so. Without a fix of the rank's own, the fix is to read the logs. A rank that exited 2 refused the
    job's own input (a bad data row, say): the launch exits 2 too, as it would had the controller seen it.
    """
    if failure is None:
        return RuntimeFailure(f"job {job_id} {state}", fix=f"dzctl logs {job_id} --tail 100")
    error = InputError if failure.get("exit_code") == 2 else RuntimeFailure
    if shown_above:
        return error(f"job {job_id} {state}: the first failure and its fix are at the top of the view")
    what = failure_lines(failure)[0].removeprefix("first failure: ")
    return error(f"job {job_id} {state}: {what}", fix=failure.get("fix") or f"dzctl logs {job_id} --tail 100")


def launch_on_slurm(job, request, *, dry_run: bool, follow: bool | None, as_json: bool) -> None:
    """``launch --slurm``: print the batch script, or submit it and (with --follow) wait for the job."""
    from ..backends.slurm import backend as slurm
    from ..backends.slurm.values import unshared_defaults

    for warning in unshared_defaults(job, request.python, request.container):
        click.echo(f"warning: {warning}", err=True)
    if dry_run:
        # The same local checks and memory plan as the submission (on slurm.gpu_mem_gib), nothing submitted.
        prepared = launcher.prepare_slurm(job, request)
        plan, script, memory = prepared.plan, prepared.batch_script, prepared.job.memory
        if as_json:
            shown = {**plan.to_dict(), "sbatch_script": script, "memory": memory.to_dict(prepared.job.ds_config)}
            click.echo(json.dumps(shown, indent=2))
        else:
            click.echo(script, nl=False)
        return
    progress = ConsoleProgress(as_json)
    prepared = launcher.prepare_slurm(job, request)
    with JobStore() as store:
        started = launcher.execute(prepared, slurm.SlurmBackend(store), progress)
        record = store.get(started.job_id)
        if follow is None:
            follow = sys.stdout.isatty() and not as_json
        if not follow:
            if as_json:
                click.echo(json.dumps({"job": record.name, "job_id": record.job_id, "state": "pending",
                                       "slurm_job_id": slurm.slurm_job_id(record)}))  # fmt: skip
            return
        write = (lambda text: (sys.stderr.write(text), sys.stderr.flush())) if as_json else None
        slurm.stream_logs(record, ranks=None, tail=None, follow=True, write=write)
        status = slurm.wait_until_ended(record, store)
    if as_json:
        click.echo(json.dumps(status.to_dict()))
    if status.state != "succeeded":
        failure = status.first_failure or {}
        if failure.get("node_rank") is None:
            # Ended before any launcher ran (preflight inside the allocation): its report is the batch log.
            click.echo(slurm.batch_log(record), err=True, nl=False)
            where = f": {failure['reason']}" if failure.get("reason") else ""
        else:
            where = f": node {failure['node_rank']} on {failure['host']}: {failure['reason']}"
        raise RuntimeFailure(f"job {record.job_id} {status.state}{where}", fix=f"dzctl logs {record.job_id} --tail 100")


def render_dry_run(checked: launcher.DryRun) -> str:
    """The launch plan, then the memory plan (as ``dzctl plan`` shows it) and the DeepSpeed config."""
    memory = render_memory(checked.memory, checked.inputs.shape, checked.inputs.spec)
    ds_config = json.dumps(checked.ds_config, indent=2)
    spacing = describe_spacing(checked.checkpoint_spacing())
    return f"{render_plan(checked.plan)}\n{spacing}\n\n{memory}\n\n{ds_config_heading(checked)}\n{ds_config}"


def filled_from_auto(checked: launcher.DryRun) -> list[tuple[str, object]]:
    """The values of the user's ``zero.config`` written as "auto" that the plan filled in, with their values."""
    inputs = checked.inputs
    return auto_filled(inputs.user_ds_config, checked.ds_config, inputs.spec.zero.overrides)


def dry_run_dict(checked: launcher.DryRun) -> dict:
    """``launch --dry-run --json``: the dry run's keys, and ``ds_config_auto_filled`` (``[{key, value}]``)."""
    filled = [{"key": key, "value": value} for key, value in filled_from_auto(checked)]
    return {**checked.to_dict(), "ds_config_auto_filled": filled}


def ds_config_heading(checked: launcher.DryRun) -> str:
    """Where the DeepSpeed config comes from, which "auto" values the plan filled and which stay "auto"."""
    zero = checked.inputs.spec.zero
    source = "generated by dzctl" if checked.inputs.user_ds_config is None else f"zero.config {zero.config}"
    if zero.overrides:
        source += ", zero.overrides merged last"
    lines = [f"ds_config.json ({source}):"]
    filled = filled_from_auto(checked)
    if filled:
        lines.append('  filled from "auto" by the plan: ' + ", ".join(f"{k} {json.dumps(v)}" for k, v in filled))
    left = auto_left(checked.ds_config)
    if left:
        lines.append('  left "auto" (the HF Trainer fills them from the job): ' + ", ".join(left))
    return "\n".join(lines)


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
