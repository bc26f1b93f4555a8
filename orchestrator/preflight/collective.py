"""The collective check: one all-reduce over every GPU (or CPU rank) of every node, through the job's own path.

Run by ``dzctl preflight`` and ``dzctl launch`` after the other checks (and after the image
was distributed), just before the model would load. It starts, per node, what the training
start runs: the launch plan's own argv (``docker run`` with the job's image, labels, network
flags and ``*_SOCKET_IFNAME``, or the process wrapper with the job's Python), only with
``orchestrator.train.collective`` as the launcher's module. So it fails where the job would:
a firewall between workers, the wrong NIC, InfiniBand unused, a node whose GPUs cannot talk.

Bounded: the ranks must form the group within ``--collective-timeout`` seconds (60 by
default, on both commands) counted from when every launcher started;
the measurement then has ``MEASURE_S`` more. Whatever happens (pass, failure, timeout,
Ctrl-C), every node's container or process tree is removed in a ``finally``, and its
check directory with it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass

from ..planning.launchplan import LaunchPlan, NodePlan, make_plan
from ..runtimes.control import logs_argv, remove_argv, stop_argv
from ..spec.hostfile import Node
from ..spec.job import JobSpec, is_secret_name
from ..transport.pool import HostPool
from .collective_result import CollectiveOutcome, NodeWatch, Settings, judge
from .model import PreflightReport, warn

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
MEASURE_S = 120.0  # after the group formed: warm-up and the timed iterations, even at 256 MiB on a slow link
START_S = 120.0  # `docker run --detach` / the process wrapper returning
CLEANUP_S = 60.0
# nccl-tests' defaults for the counts (5 warm-up, 20 timed); 20 × 256 MiB takes ~20 ms on NVLink.
GPU_BYTES, GPU_ITERS, GPU_WARMUP = 256 * 2**20, 20, 5
# CPU jobs (gloo) are small and test-sized: a few MiB proves the path and gives a figure.
CPU_BYTES, CPU_ITERS, CPU_WARMUP = 8 * 2**20, 3, 1
# Only for the check: NCCL says which transport it chose (INIT: channels and network, NET:
# the IB/socket devices, GRAPH: the path type within a node, P2P and SHM: their channel
# lines). torchrun's agent logs its rendezvous steps at INFO.
CHECK_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH,P2P,SHM", "LOGLEVEL": "INFO"}
# A check that fails on these cannot start the check's launchers, so it is not run (it would only
# add a second message). Network findings (route, master port) do not stop it: the collective is
# the ground truth for the network, and its diagnosis names the node that cannot reach the others.
NEEDS = frozenset({"ssh", "docker", "nvidia-toolkit", "image", "image-runtime", "python-env", "nvidia-smi"})
MODULE = "orchestrator.train.collective"


@dataclass(frozen=True)
class CollectiveRequest:
    timeout_s: float = DEFAULT_TIMEOUT_S
    size_bytes: int | None = None  # None: by accelerator (GPU_BYTES / CPU_BYTES)
    iters: int | None = None
    # ZeRO-3's buckets in bytes (the plan's ds_config, on GPUs): the all-gather and reduce-scatter sizes.
    gather_bytes: int | None = None
    reduce_bytes: int | None = None


def planned_bucket_bytes(ds_config: dict | None, accelerator: str) -> dict[str, int]:
    """The all-gather/reduce-scatter sizes the check times: the planned prefetch and reduce buckets, in bf16 bytes.

    Only on GPUs: CPU (gloo) jobs keep the check's small test size, so the check stays as fast as before.
    """
    zero = (ds_config or {}).get("zero_optimization") or {}
    if accelerator != "gpu" or not isinstance(zero, dict):
        return {}
    sizes = {"gather_bytes": zero.get("stage3_prefetch_bucket_size"), "reduce_bytes": zero.get("reduce_bucket_size")}
    return {
        k: int(v) * 2 for k, v in sizes.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    }


def settings_for(spec: JobSpec, request: CollectiveRequest) -> Settings:
    gpu = spec.accelerator == "gpu"
    return Settings(
        timeout_s=request.timeout_s,
        size_bytes=request.size_bytes or (GPU_BYTES if gpu else CPU_BYTES),
        iters=request.iters or (GPU_ITERS if gpu else CPU_ITERS),
        warmup=GPU_WARMUP if gpu else CPU_WARMUP,
        gather_bytes=request.gather_bytes,
        reduce_bytes=request.reduce_bytes,
    )


def check_id_for(spec: JobSpec, job_id: str | None) -> str:
    """The check's own id: container names and its directory on the nodes never clash with the job's."""
    base = job_id or f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"
    return f"{base}-nccl"


def collective_plan(
    spec: JobSpec, nodes: list[Node], report: PreflightReport, check_id: str, settings: Settings
) -> LaunchPlan:
    """The job's launch plan, as preflight would have it start the training, running the check's module instead."""
    # Secrets stay out: the check needs none, and without them the plan wants no env file on the nodes.
    env = {**{k: v for k, v in spec.launch.env.items() if not is_secret_name(k)}, **CHECK_ENV}
    check_spec = spec.model_copy(update={"launch": spec.launch.model_copy(update={"env": env})})
    entry = (
        MODULE,
        "--bytes",
        str(settings.size_bytes),
        "--iters",
        str(settings.iters),
        "--per-round",
        str(max(1, settings.iters // 5)),
        "--warmup",
        str(settings.warmup),
        "--timeout",
        str(int(settings.timeout_s + MEASURE_S)),
        *(("--gather-bytes", str(settings.gather_bytes)) if settings.gather_bytes else ()),
        *(("--reduce-bytes", str(settings.reduce_bytes)) if settings.reduce_bytes else ()),
    )
    return make_plan(
        check_spec,
        nodes,
        check_id,
        secret_names=(),
        master_addr=report.master_addr,
        interfaces=report.interfaces,
        infiniband_hosts=frozenset(h for h, devices in report.infiniband.items() if devices),
        entry=entry,
    )


def blocked_by(report: PreflightReport) -> list[str]:
    """``host: check`` for each failure that keeps the check from starting at all."""
    return [f"{host}: {check.name}" for host, check in report.failures() if check.name in NEEDS]


def run_collective_stage(
    spec: JobSpec,
    nodes: list[Node],
    pool: HostPool,
    report: PreflightReport,
    request: CollectiveRequest,
    *,
    job_id: str | None = None,
) -> CollectiveOutcome:
    """Run the check unless a failure it depends on was found; its checks join the report's hosts."""
    blockers = blocked_by(report)
    if sum(n.num_slots for n in nodes) < 2:
        skipped(report, "one rank: there is no collective to check")
        return CollectiveOutcome({}, report.collective)
    if blockers:
        fix = "fix the failures above; the collective check runs once they pass"
        outcome = CollectiveOutcome(
            {h.host: warn("collective", f"not run: {', '.join(blockers)} failed", fix) for h in report.hosts},
            {"ran": False, "ok": None, "reason": f"not run: {', '.join(blockers)} failed"},
        )
    else:
        outcome = run_collective(spec, nodes, pool, report, request, job_id=job_id)
    attach(report, outcome)
    return outcome


def attach(report: PreflightReport, outcome: CollectiveOutcome) -> None:
    for host in report.hosts:
        check = outcome.checks.get(host.host)
        if check is not None:
            host.checks = [c for c in host.checks if c.name != "collective"] + [check]
    report.collective = outcome.figures


def skipped(report: PreflightReport, why: str) -> None:
    report.collective = {"ran": False, "ok": None, "reason": why}


def run_collective(
    spec: JobSpec,
    nodes: list[Node],
    pool: HostPool,
    report: PreflightReport,
    request: CollectiveRequest,
    *,
    job_id: str | None = None,
) -> CollectiveOutcome:
    settings = settings_for(spec, request)
    plan = collective_plan(spec, nodes, report, check_id_for(spec, job_id), settings)
    offsets = [sum(n.slots for n in plan.nodes[:i]) for i in range(len(plan.nodes))]
    watches = {n.host: NodeWatch(n.host, n.node_rank, n.slots, offsets[n.node_rank]) for n in plan.nodes}
    lock = threading.Lock()
    changed = threading.Event()
    followers: list[threading.Thread] = []
    began = time.monotonic()
    formed_at: float | None = None
    launchers_up: float | None = None
    try:
        _prepare(plan, pool)
        _start(plan, pool, watches)
        launchers_up = time.monotonic()
        for node in plan.nodes:
            if watches[node.host].launcher_started:
                thread = threading.Thread(
                    target=_follow,
                    args=(plan, node, pool, watches[node.host], lock, changed),
                    name=f"dzctl-collective-{node.host}",
                    daemon=True,
                )
                thread.start()
                followers.append(thread)
        form_deadline = launchers_up + settings.timeout_s
        while True:
            changed.wait(timeout=0.5)
            changed.clear()
            now = time.monotonic()
            with lock:
                states = list(watches.values())
                if formed_at is None and all(w.joined() for w in states):
                    formed_at = now
                if all(w.done() for w in states):
                    break
                if any(w.errors or w.start_error for w in states):
                    break
                if any(w.ended and not w.done() for w in states):
                    break  # a node's launcher exited without a result: the group cannot complete
            if formed_at is None and now > form_deadline:
                break
            if formed_at is not None and now > formed_at + MEASURE_S:
                break
    finally:
        with lock:
            for watch in watches.values():
                watch.closed = True
        _cleanup(plan, pool)
        for thread in followers:
            thread.join(timeout=15)
    with lock:
        ordered = [watches[n.host] for n in plan.nodes]
        return judge(
            ordered,
            settings,
            formed_in_time=formed_at is not None,
            elapsed_s=time.monotonic() - began,
            launch_to_group_s=(formed_at - launchers_up) if formed_at and launchers_up else None,
            infiniband_hosts=frozenset(h for h, devices in report.infiniband.items() if devices),
            backend_hint="nccl" if spec.accelerator == "gpu" else "gloo",
        )


def _prepare(plan: LaunchPlan, pool: HostPool) -> None:
    def one(conn) -> None:
        node = _node(plan, conn.host)
        conn.mkdir(node.job_dir)
        conn.mkdir(node.output_dir)  # the container mounts it, as the job's does

    pool.map(one).raise_on_failure()


def _start(plan: LaunchPlan, pool: HostPool, watches: dict[str, NodeWatch]) -> None:
    outcomes = pool.map(lambda conn: conn.run(_node(plan, conn.host).argv, timeout=START_S))
    for host, outcome in outcomes.items():
        watch = watches[host]
        if isinstance(outcome, Exception):
            watch.start_error = str(outcome)
        elif outcome.exit_code != 0:
            lines = (outcome.stderr.strip() or outcome.stdout.strip() or f"exit {outcome.exit_code}").splitlines()
            watch.start_error = lines[-1][-300:]
        else:
            watch.launcher_started = True


def _follow(plan, node: NodePlan, pool: HostPool, watch: NodeWatch, lock, changed) -> None:
    """Stream the node's output into its watch until the container or process ends."""
    buffers = {"out": b"", "err": b""}

    def sink(name: str):
        def take(chunk: bytes) -> None:
            data = buffers[name] + chunk
            *lines, rest = data.split(b"\n")
            buffers[name] = rest
            with lock:
                for line in lines:
                    watch.feed(line.decode(errors="replace"))
            changed.set()

        return take

    argv = logs_argv(plan.runtime, _node_dict(node), _python(plan, node), tail=None, follow=True)
    try:
        pool.connection(node.host).run(
            argv, on_stdout=sink("out"), on_stderr=sink("err"), timeout=START_S + DEFAULT_TIMEOUT_S + MEASURE_S * 4
        )
    except Exception as exc:  # the wait loop sees the node as ended; the reason goes to the log
        log.debug("following %s: %s", node.host, exc)
    finally:
        with lock:
            for rest in buffers.values():
                if rest:
                    watch.feed(rest.decode(errors="replace"))
            if not watch.closed:  # ended by itself, not by the cleanup
                watch.ended = True
        changed.set()


def _cleanup(plan: LaunchPlan, pool: HostPool) -> None:
    """Remove every node's container or process tree, then the check's directory; never raises."""

    def one(conn) -> None:
        node = _node(plan, conn.host)
        as_dict = _node_dict(node)
        removal = remove_argv(plan.runtime, as_dict)
        if removal is None:
            conn.run(stop_argv(plan.runtime, as_dict, _python(plan, node)), timeout=CLEANUP_S)
        else:
            conn.run(removal, timeout=CLEANUP_S)
        conn.run(["rm", "-rf", "--", node.job_dir], timeout=CLEANUP_S)

    for host, outcome in pool.map(one).items():
        if isinstance(outcome, Exception):
            log.warning("collective check: cleaning up on %s failed: %s", host, outcome)


def _node(plan: LaunchPlan, host: str) -> NodePlan:
    return next(n for n in plan.nodes if n.host == host)


def _node_dict(node: NodePlan) -> dict:
    return {"container_name": node.container_name, "job_dir": node.job_dir, "node_rank": node.node_rank}


def _python(plan: LaunchPlan, node: NodePlan) -> str:
    # The process runtime's wrapper is `<launch.python> -m orchestrator.runtimes.process start ...`.
    return node.argv[0] if plan.runtime == "process" else "python3"


def collective_unless_skipped(
    spec: JobSpec,
    nodes: list[Node],
    pool: HostPool,
    report: PreflightReport,
    *,
    skip: bool,
    timeout_s: float,
    job_id: str | None = None,
    ds_config: dict | None = None,
) -> None:
    """What ``preflight`` and ``launch`` call: the findings join ``report`` (hosts' checks and ``collective``).

    ``ds_config``: launch's planned config, whose bucket sizes the all-gather/reduce-scatter then take.
    """
    if skip:
        skipped(report, "skipped (--skip-collective)")
        return
    request = CollectiveRequest(timeout_s=timeout_s, **planned_bucket_bytes(ds_config, spec.accelerator))
    run_collective_stage(spec, nodes, pool, report, request, job_id=job_id)
