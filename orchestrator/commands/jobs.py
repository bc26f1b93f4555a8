"""``dzctl status``, ``dzctl logs`` and ``dzctl stop``: about launched jobs, asked of their hosts."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import click

from ..backends.recovery.record import ENDED as SUPERVISION_ENDED
from ..backends.recovery.record import SupervisionStore
from ..backends.recovery.supervisor import end_supervisor
from ..backends.slurm import backend as slurm_backend
from ..backends.slurm.backend import is_slurm
from ..errors import DzError, RuntimeFailure
from ..observe.evidence import load_evidence, render_stacks
from ..observe.hosts import fetch_outputs, gather_status, progress_history, stop_nodes, stream_logs, tracker_locations
from ..observe.lines import predicted_text, speed_warning
from ..observe.status import JobStatus
from ..observe.store import FINAL_STATES, JobRecord, JobStore
from ..observe.watchstate import block_chart
from ..planning.speed.spacing import describe as describe_spacing
from ..planning.speed.spacing import work_lost_per_fault
from ..preflight.collective_result import describe_collective
from ..transport.pool import HostPool
from .follow import follow_job, output_mode
from .options import json_option, ssh_options
from .ranks import ranks_by_node, selected_node, span


def _pool(record: JobRecord, ssh_config: str | None, trust_new_hosts: bool) -> HostPool:
    return HostPool(record.hosts, ssh_config=ssh_config or record.ssh_config, trust_new_hosts=trust_new_hosts)


def _refresh(record: JobRecord, store: JobStore, pool: HostPool) -> JobStatus:
    status = gather_status(record, pool)
    if status.state != record.state and (status.state in FINAL_STATES or record.state == "starting"):
        store.set_state(record.job_id, status.state)
    return _with_restarts(status, record)


def _with_restarts(status: JobStatus, record: JobRecord) -> JobStatus:
    """A supervised job's status carries its restarts (the record of every attempt shows them all)."""
    with SupervisionStore() as supervision:
        found = supervision.of_job(record.job_id, record.name)
    if found is None:
        return status
    restart = record.spec.get("restart") or {}
    return dataclasses.replace(status, restarts=found.summary(restart.get("max")))


@click.command("status")
@click.argument("job_ref", metavar="[JOB]", required=False)
@ssh_options
@json_option
@click.option("--watch", is_flag=True, help="Refresh every few seconds until the job ends.")
@click.option("--interval", type=float, default=5.0, show_default=True, help="Seconds between --watch refreshes.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write loss, smoothed loss, learning rate and tokens/s against step to this PNG (needs dzctl[plot]).",
)
def status_command(job_ref, ssh_config, trust_new_hosts, as_json, watch, interval, plot_path):
    """List jobs, or show one job's state as its hosts report it (JOB: name or id)."""
    with JobStore() as store:
        if job_ref is None:
            records = store.all()
            if as_json:
                click.echo(json.dumps({"jobs": [_summary(r) for r in records]}))
            else:
                click.echo(_render_list(records))
            return
        record = store.get(job_ref)
        if is_slurm(record):
            _slurm_status(record, store, as_json, watch, interval)
            return
        with _pool(record, ssh_config, trust_new_hosts) as pool:
            if watch and not as_json:
                # The same view as launch --follow (plain lines when not a terminal); it only looks.
                follow_job(record, pool, store, mode=output_mode(False), stop_gang=False)
                return
            chart: list[str] = []
            if plot_path is not None or (not as_json and not watch and sys.stdout.isatty()):
                chart = _history_outputs(record, pool, plot_path)
            while True:
                status = _refresh(record, store, pool)
                if as_json:
                    click.echo(json.dumps(status_dict(status, record)))
                else:
                    click.echo(render_status(status, ranks_by_node(record.plan["nodes"])))
                    if status.state == "running" and status.progress:
                        click.echo(describe_spacing(checkpoint_spacing(status, record)))
                    for tracker, folder in tracker_locations(record).items():
                        fetch = f"dzctl logs {record.job_id} --fetch DIR"
                        click.echo(f"{tracker}: {record.hosts[0]}:{folder}  (copy it here: {fetch})")
                    if chart:
                        click.echo("\n".join(chart))
                if not watch or status.state in FINAL_STATES:
                    return
                time.sleep(interval)


def _slurm_status(record: JobRecord, store: JobStore, as_json: bool, watch: bool, interval: float) -> None:
    """A Slurm job: its state from Slurm (squeue, scontrol, sacct), its ranks' from the shared job dir."""
    while True:
        status = slurm_backend.gather_status(store.get(record.job_id))
        if status.state != record.state and (status.state in FINAL_STATES or record.state in ("starting", "pending")):
            store.set_state(record.job_id, status.state)
        ranks = ranks_by_node(record.plan["nodes"])
        click.echo(json.dumps(status_dict(status, record)) if as_json else render_status(status, ranks))
        if not watch or status.state in FINAL_STATES:
            return
        time.sleep(interval)


def _history_outputs(record: JobRecord, pool: HostPool, plot_path: Path | None) -> list[str]:
    """Writes the plot file when asked; returns the terminal's loss chart (none when not a terminal)."""
    events = progress_history(record, pool)
    if plot_path is not None:
        from ..observe.plot import write_plot  # matplotlib only when asked for

        write_plot(events, plot_path, title=record.job_id)
        click.echo(f"plot: {plot_path}", err=True)
    if sys.stdout.isatty():
        losses = [e["loss"] for e in events if e.get("event") == "step" and e.get("loss") is not None]
        chart = block_chart(losses, width=60, height=6)
        if chart:
            return [f"loss over {len(losses)} logged steps", *chart]
    return []


def _summary(record: JobRecord) -> dict:
    return {
        "job": record.name,
        "job_id": record.job_id,
        "state": record.state,
        "hosts": record.hosts,
        "created": record.created,
        "finished": record.finished,
    }


def _render_list(records: list[JobRecord]) -> str:
    if not records:
        return "no jobs yet: dzctl launch JOB --hosts FILE"
    lines = [f"{'JOB ID':44} {'STATE':10} {'NODES':5} STARTED (UTC)"]
    for r in records:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created))
        lines.append(f"{r.job_id:44} {r.state:10} {len(r.hosts):<5} {started}")
    return "\n".join(lines)


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def status_dict(status: JobStatus, record: JobRecord) -> dict:
    """``status --json``: DESIGN's keys, and each node's global ``ranks`` beside its ``node_rank``."""
    out = status.to_dict()
    out["checkpoint_spacing"] = checkpoint_spacing(status, record)
    ranks = ranks_by_node(record.plan["nodes"])
    for node in out["nodes"]:
        node["ranks"] = list(ranks.get(node["node_rank"], ()))
    return out


def eval_lines(progress: dict) -> list[str]:
    """The last eval and the best one, and an early stop, for ``status``'s text."""
    found = progress.get("eval")
    lines = []
    if found and found.get("eval_loss") is not None:
        line = (
            f"eval loss {found['eval_loss']:.4f} at step {found.get('step')} ({found.get('eval_tokens') or 0:,} tokens)"
        )
        if found.get("best_eval_loss") is not None:
            line += f"  best {found['best_eval_loss']:.4f} at step {found.get('best_step')}"
        if found.get("best_checkpoint"):
            line += f"  best checkpoint {found['best_checkpoint']}"
        lines.append(line)
    if progress.get("stopped_early"):
        lines.append(f"stopped early at step {progress.get('step')} (train.early_stopping)")
    return lines


def checkpoint_spacing(status: JobStatus, record: JobRecord) -> dict:
    """The work a fault loses now: the record's save interval at the step time rank 0 last measured."""
    train = record.spec.get("train", {})
    step_time = (status.progress or {}).get("step_time_s")
    return work_lost_per_fault(train.get("save_steps", 500), train.get("save_minutes"), step_time)


def render_status(status: JobStatus, ranks: dict[int, range] | None = None) -> str:
    """The job's state, a row per node (NODE = node rank; RANKS = the global ranks it runs)."""
    ranks = ranks or {}
    lines = [f"job {status.job}  id {status.job_id}  state {status.state.upper()}"]
    progress = status.progress
    if progress:
        parts = [f"progress step {progress.get('step')}/{progress.get('max_steps')}"]
        if progress.get("loss") is not None:
            parts.append(f"loss {progress['loss']:.4f}")
        if progress.get("tokens_per_s") is not None:
            parts.append(f"useful tokens/s {progress['tokens_per_s']:,.0f}")
        if progress.get("padding_efficiency") is not None:
            parts.append(f"(padding efficiency {100 * progress['padding_efficiency']:.0f}%)")
        parts.append(f"eta {_fmt_s(progress.get('eta_s'))}")
        parts.append(f"last progress {_fmt_s(status.progress_age_s)} ago")
        lines.append("  ".join(parts))
        lines += eval_lines(progress)
    else:
        lines.append("progress none yet")
    lines.append(f"{'NODE':4} {'HOST':24} {'RANKS':7} {'STATE':11} {'EXIT':5} OOM")
    for n in status.nodes:
        exit_code = "-" if n.exit_code is None else str(n.exit_code)
        held = span(ranks[n.node_rank]) if n.node_rank in ranks else "-"
        oom = "yes" if n.oom_killed else "no"
        lines.append(f"{n.node_rank:<4} {n.host:24} {held:7} {n.state:11} {exit_code:5} {oom}")
    if status.stall and status.stall.get("stalled"):
        # One line each: the bound that applied, and who the ranks wait for (docs/recovery.md).
        lines.append(status.stall["line"])
        culprit = status.stall.get("culprit")
        lines.append(culprit["line"] if culprit else "culprit: not named (every rank waits in the same collective)")
        lines.append(f"stacks of every rank: dzctl logs {status.job_id} --stacks")
    if status.first_failure:
        f = status.first_failure
        held = f"ranks {span(ranks[f['node_rank']])}, " if f.get("node_rank") in ranks else ""
        lines.append(
            f"first failure: node {f['node_rank']} on {f['host']} ({held}exit {f['exit_code']}): {f['reason']}"
        )
    collective = (status.preflight or {}).get("collective")
    if collective:
        lines.append(describe_collective(collective))
    world = sum(len(r) for r in ranks.values()) or 1
    predicted = predicted_text(status.speed, progress, world)
    if predicted:
        lines.append(f"plan: {predicted}")
    if speed_warning(status.speed):
        lines.append(speed_warning(status.speed))
    lines += restart_lines(status.restarts)
    return "\n".join(lines)


def restart_lines(restarts: dict | None) -> list[str]:
    """``restarts N of MAX (supervisor STATE)``, then one line per restart: its cause and the nodes replaced."""
    if not restarts:
        return []
    limit = "" if restarts.get("max") is None else f" of {restarts['max']}"
    lines = [f"restarts {restarts['count']}{limit} (supervisor {restarts['supervisor']}, pid {restarts['pid']})"]
    for item in restarts["history"]:
        replaced = "".join(f"; node {r['node_rank']} {r['host']} replaced by {r['spare']}" for r in item["replaced"])
        lines.append(
            f"  restart {item['number']}: {item['cause']}: {item['why']}; {item['from_job_id']} -> {item['job_id']}"
            f" in {item['seconds_to_running']:g} s{replaced}"
        )
    if restarts.get("final") and restarts["supervisor"] in SUPERVISION_ENDED:
        lines.append(f"  supervisor ended: {restarts['final']}")
    return lines


@click.command("logs")
@click.argument("job_ref", metavar="JOB")
@click.option("--node", "node", type=int, default=None, help="Only this node (its node rank: hostfile line order).")
@click.option("--rank", type=int, default=None, help="Only the node that runs this global rank (torch's [rankR]).")
@click.option("--follow", "-f", is_flag=True, help="Keep streaming until the ranks end.")
@click.option("--tail", type=int, default=None, help="Only the last N lines of each rank.")
@click.option(
    "--fetch",
    "fetch_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Copy the job's progress.jsonl and tracker files (report_to) from rank 0's node into DIR.",
)
@click.option(
    "--stacks",
    is_flag=True,
    help="The evidence of the job's last stall: each rank's state, what it blocks in, and its Python stack.",
)
@ssh_options
def logs_command(job_ref, node, rank, follow, tail, fetch_dir, stacks, ssh_config, trust_new_hosts):
    """Every node's output, each line prefixed with its node rank and host (the raw stream)."""
    with JobStore() as store:
        record = store.get(job_ref)
    if stacks:
        evidence = load_evidence(record.job_id)
        if evidence is None:
            raise RuntimeFailure(
                f"{record.job_id} has no stall evidence: it is taken when the job stalls (dzctl status says so)",
                fix=f"dzctl status {record.job_id} (a stalled job's evidence is taken then)",
            )
        click.echo(render_stacks(evidence))
        return
    chosen = selected_node(record.plan["nodes"], record.job_id, node, rank)
    if rank is not None:
        # A node's log holds all its ranks' lines: say which node that is.
        click.echo(f"rank {rank} runs on node {chosen} ({record.hosts[chosen]}): showing that node's output", err=True)
    nodes = None if chosen is None else [chosen]
    if is_slurm(record):
        if fetch_dir is not None:
            raise click.UsageError("--fetch: a Slurm job's outputs are already on the shared path in its record")
        slurm_backend.stream_logs(record, ranks=nodes, tail=tail, follow=follow)
        return
    with _pool(record, ssh_config, trust_new_hosts) as pool:
        if fetch_dir is not None:
            written = fetch_outputs(record, pool, fetch_dir)
            click.echo(f"copied {len(written)} file(s) from {record.hosts[0]} into {fetch_dir}")
            return
        threads = stream_logs(record, pool, ranks=nodes, tail=tail, follow=follow)
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.5)
        except KeyboardInterrupt:
            raise SystemExit(130) from None


@click.command("stop")
@click.argument("job_ref", metavar="JOB")
@ssh_options
@json_option
def stop_command(job_ref, ssh_config, trust_new_hosts, as_json):
    """Stop every node of a job at once and remove its containers."""
    with JobStore() as store:
        record = store.get(job_ref)
        supervisor = None
        if not is_slurm(record):
            record, supervisor = _stop_supervisor(record, store)
            if supervisor is not None:
                click.echo(f"supervisor: {supervisor}", err=True)
        if is_slurm(record):
            # scancel; the outcome per node as the SSH fleet reports it.
            outcomes = {h: o if o == "stopped" else DzError(o) for h, o in slurm_backend.stop(record).items()}
        else:
            with _pool(record, ssh_config, trust_new_hosts) as pool:
                status = _refresh(record, store, pool)
                ended = _nothing_to_stop(status)
                if len(ended) == len(status.nodes):
                    _say_already_ended(record, status, ended, as_json, supervisor)
                    return
                live = [n.node_rank for n in status.nodes if n.host not in ended]
                outcomes = {**stop_nodes(record, pool, remove=True, ranks=live), **ended}
        failed = {h: o for h, o in outcomes.items() if isinstance(o, DzError)}
        if not failed and record.state not in ("succeeded", "failed"):
            store.set_state(record.job_id, "stopped", reason="dzctl stop")
        result = {
            "job": record.name,
            "job_id": record.job_id,
            "hosts": {h: (o if isinstance(o, str) else f"error: {o.message}") for h, o in outcomes.items()},
        }
        if supervisor is not None:
            result["supervisor"] = supervisor
        click.echo(json.dumps(result) if as_json else "\n".join(f"{h}: {s}" for h, s in result["hosts"].items()))
        if failed:
            raise RuntimeFailure(
                f"could not stop job {record.job_id} on {', '.join(failed)}",
                fix=f"fix what each node reports above (host unreachable, its Docker daemon down, a rank that"
                f" ignores SIGKILL), then rerun `dzctl stop {record.job_id}`; `dzctl status {record.job_id}`"
                " shows what still runs",
            )


def _nothing_to_stop(status: JobStatus) -> dict[str, str]:
    """The nodes with nothing to stop, and why: an exited rank (its container and logs stay), or,
    once the job has ended, a rank no longer on its node (removed after the end)."""
    ended = {}
    for n in status.nodes:
        if n.state == "exited":
            ended[n.host] = f"already ended (exit {n.exit_code})"
        elif n.state == "missing" and status.state in FINAL_STATES:
            ended[n.host] = "already ended (no rank left on the node)"
    return ended


def _stop_supervisor(record: JobRecord, store: JobStore) -> tuple[JobRecord, str | None]:
    """A supervised job: end its supervisor first (nothing restarts after a stop), then stop its newest attempt.

    The record is marked stopped before the signal, so a supervisor between two checks (its backoff,
    a preflight) never starts the next attempt; one in the middle of a start finishes it, stops what
    it started and ends, and only then are the nodes asked here.
    """
    with SupervisionStore() as supervision:
        found = supervision.of_job(record.job_id, record.name)
        if found is None:
            return record, None
        if found.state in SUPERVISION_ENDED and found.state != "stopped":
            return store.get(found.current_job_id), None
        supervision.stop(found.lineage, "dzctl stop")
        outcome = end_supervisor(found.pid, found.lineage)
        return store.get(supervision.get(found.lineage).current_job_id), outcome


def _say_already_ended(
    record: JobRecord, status: JobStatus, ended: dict[str, str], as_json: bool, supervisor: str | None = None
) -> None:
    """Every rank had exited before `stop`: nothing was stopped or removed, and that is no error."""
    if as_json:
        shown = {"job": record.name, "job_id": record.job_id, "state": status.state, "hosts": ended}
        if supervisor is not None:
            shown["supervisor"] = supervisor
        click.echo(json.dumps(shown))
    else:
        click.echo(f"job {record.job_id} had already ended ({status.state}): nothing to stop")


def register(group: click.Group) -> None:
    group.add_command(status_command)
    group.add_command(logs_command)
    group.add_command(stop_command)
