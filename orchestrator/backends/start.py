"""Apply a launch plan: ship the job directory, start every node, leave nothing half-started.

The order (each step on all nodes in parallel, each step finished before the next):
1. refuse a job name that still runs (``--replace`` stops it first);
2. record the job (state ``starting``): a controller killed from here on leaves
   a record that ``status``/``stop`` reconcile with the hosts;
3. upload ``<remote_dir>/jobs/<job_id>/`` to every node (env file 0600);
4. start one container (or launcher process) per node;
5. if any node failed to start, stop and remove the ones that did, and mark the
   job failed: no half-started jobs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InputError, RemoteError, RuntimeFailure
from ..observe.hosts import gather_status, stop_nodes
from ..observe.store import JobStore
from ..planning.launchplan import LaunchPlan
from ..planning.resolve import ResolvedJob
from ..runtimes.control import list_job_containers_argv
from ..spec.job import LoadedJob
from ..transport.pool import HostPool
from .jobfiles import JobFile

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120  # `docker run --detach` returns once the container started; image load is not part of it
UPLOAD_TIMEOUT_S = 600


@dataclass(frozen=True)
class Started:
    job_id: str
    hosts: list[str]


@dataclass
class Phases:
    """Seconds spent in each launch phase, for --json and benchmarks/launch_overhead.py."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.monotonic() - started, 3)


def refuse_or_replace_running(job: LoadedJob, store: JobStore, pool: HostPool, *, replace: bool) -> None:
    """A job name runs once: a second launch would fight over the output dir and the ports."""
    for record in store.active_with_name(job.spec.name):
        with HostPool(record.hosts, ssh_config=record.ssh_config or pool.ssh_config_path) as old_pool:
            status = gather_status(record, old_pool)
            if status.state not in ("running", "pending"):
                store.set_state(record.job_id, status.state)
                continue
            if not replace:
                raise InputError(
                    f"job {job.spec.name!r} is still {status.state} as {record.job_id} on {', '.join(record.hosts)}",
                    fix=f"wait for it, `dzctl stop {record.job_id}`, or launch with --replace",
                )
            log.warning("replacing %s", record.job_id)
            stop_nodes(record, old_pool, remove=True)
            store.set_state(record.job_id, "stopped", reason="replaced by a new launch")
    if job.spec.runtime == "docker":
        # Containers with this job name that no record here knows (another controller, a lost record).
        found = pool.run_all([*list_job_containers_argv("dzctl.job", job.spec.name), "--filter", "status=running"])
        for host, outcome in found.items():
            if not isinstance(outcome, Exception) and outcome.exit_code == 0 and outcome.stdout.strip():
                names = outcome.stdout.split()
                if not replace:
                    raise InputError(
                        f"{host}: containers of job {job.spec.name!r} are running: {', '.join(names)}",
                        fix="stop them (`docker stop`), or launch with --replace",
                    )
                pool.connection(host).run(["docker", "rm", "--force", *names], timeout=120)


def upload(job: ResolvedJob, files: dict[int, list[JobFile]], pool: HostPool) -> None:
    plan = job.plan
    shipped = job.inputs.shipped  # checked before any host was touched (inputs.check_data_sources)

    def one(conn) -> None:
        node = next(n for n in plan.nodes if n.host == conn.host)
        conn.mkdir(node.job_dir)
        conn.mkdir(node.output_dir)
        for item in files[node.node_rank]:
            conn.put(item.content, f"{node.job_dir}/{item.name}", mode=item.mode)
        if shipped:
            conn.mkdir(f"{node.job_dir}/data")
        for item in shipped:
            conn.put(str(item.local), f"{node.job_dir}/{item.name}", mode=0o644)

    outcomes = pool.map(one)
    failed = outcomes.failed
    if failed:
        details = "; ".join(f"{host}: {exc}" for host, exc in failed.items())
        raise RemoteError(f"uploading the job directory failed: {details}", fix="check disk space and permissions")


def probe_output_storage(plan: LaunchPlan, pool: HostPool) -> str:
    """``shared`` if every node sees node 0's output dir (one filesystem), else ``node-local``.

    A probe file written on node 0 and looked for on the others: paths alone cannot
    tell an NFS mount from a local disk. The trainer needs the answer to decide
    which ranks write checkpoint metadata (see train.output_storage).
    """
    first = plan.nodes[0]
    if len(plan.nodes) == 1:
        return "shared"
    if any(n.output_dir != first.output_dir for n in plan.nodes):
        return "node-local"
    probe = f"{first.output_dir}/.dzctl-storage-probe-{plan.job_id}"
    outcomes = pool.map(lambda conn: conn.mkdir(first.output_dir))
    if outcomes.failed:
        raise RemoteError(f"cannot create the output dir: {outcomes.failed}", fix="check permissions and disk")
    node0 = pool.connection(first.host)
    node0.put(b"dzctl storage probe\n", probe, mode=0o644)
    try:
        seen = pool.run_all(["test", "-e", probe], timeout=30, hosts=[n.host for n in plan.nodes[1:]])
    finally:
        node0.run(["rm", "-f", probe], timeout=30)
    return "shared" if all(not isinstance(r, Exception) and r.exit_code == 0 for r in seen.values()) else "node-local"


def start_nodes(plan: LaunchPlan, pool: HostPool) -> tuple[list[int], dict[int, str]]:
    """Start every node at once: (ranks started, {rank: why it did not start})."""
    by_host = {n.host: n for n in plan.nodes}
    outcomes = pool.map(lambda conn: conn.run(by_host[conn.host].argv, timeout=START_TIMEOUT_S))
    started, errors = [], {}
    for host, outcome in outcomes.items():
        rank = by_host[host].node_rank
        if isinstance(outcome, Exception):
            errors[rank] = str(outcome)
        elif outcome.exit_code != 0:
            lines = (outcome.stderr.strip() or outcome.stdout.strip() or f"exit {outcome.exit_code}").splitlines()
            errors[rank] = lines[-1]
        else:
            started.append(rank)
    return sorted(started), errors


def record_plan(job: ResolvedJob) -> dict:
    """The launch plan kept with the job, and beside it the predicted step that status and the view compare with."""
    speed = job.memory.speed
    return {**job.plan.to_dict(), **({"speed": speed.to_dict()} if speed is not None else {})}


def start_job(
    job: ResolvedJob,
    files: dict[int, list[JobFile]],
    pool: HostPool,
    store: JobStore,
    *,
    spec_record: dict,
    ssh_config: str | None,
    replace: bool,
    phases: Phases | None = None,
    busy: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> Started:
    """``busy(what)``: a context around the long steps for a caller that shows progress (none by default)."""
    phases = phases or Phases()
    busy = busy or (lambda what: contextlib.nullcontext())
    plan = job.plan
    with phases.timed("refuse_running"):
        refuse_or_replace_running(job.job, store, pool, replace=replace)
    hosts = [n.host for n in plan.nodes]
    store.add(
        job_id=plan.job_id,
        name=plan.job,
        runtime=plan.runtime,
        image=plan.image,
        hosts=hosts,
        spec=spec_record,
        plan=record_plan(job),
        ssh_config=ssh_config,
    )
    try:
        with phases.timed("upload"), busy(f"uploading the job files to {len(plan.nodes)} node(s)"):
            upload(job, files, pool)
    except Exception:
        store.set_state(plan.job_id, "failed", reason="upload failed")
        raise
    with phases.timed("start_nodes"):
        _, errors = start_nodes(plan, pool)
    if errors:
        record = store.get(plan.job_id)
        # Stop what did start, and remove what a failed `docker run` may have created.
        stop_nodes(record, pool, remove=True)
        reason = "; ".join(f"rank {rank} ({plan.nodes[rank].host}): {why}" for rank, why in sorted(errors.items()))
        store.set_state(plan.job_id, "failed", reason=f"did not start: {reason}")
        raise RuntimeFailure(
            f"job {plan.job_id} did not start on every node, so no node runs it: {reason}",
            fix="`dzctl preflight` with the same job and hosts names what is missing",
        )
    store.set_state(plan.job_id, "running")
    return Started(plan.job_id, hosts)
