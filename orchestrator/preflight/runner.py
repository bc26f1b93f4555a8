"""Run every check on every node at once and gather one report.

Phases (each a parallel fan-out over the reachable nodes, one SSH connection per node):
1. connect (the ``ssh`` check);
2. per-node checks (identity, disk, InfiniBand, GPUs, Docker/toolkit/image/container or the Python env);
3. the master address is chosen from what node 0 and the others reported; each node's route to it
   gives the interface for NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME;
4. the master port: a short-lived listener on node 0, a connection from every other node;
5. checks across nodes (same driver, NCCL, image, torch, deepspeed everywhere).
A node that fails a phase keeps the checks it has; the others go on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from ..errors import DzError, RemoteError
from ..planning.inputs import JobInputs
from ..planning.launchplan import LaunchPlan, make_plan
from ..spec.hostfile import Node
from ..spec.job import JobSpec, LoadedJob
from ..transport.connection import Connection
from ..transport.local import LocalConnection
from ..transport.pool import HostPool
from ..transport.results import Result
from . import checks as c
from . import datacheck, nvme
from . import parsers as p
from .loading import ops, weights
from .model import Check, HostReport, PreflightReport, fail, ok, warn

CHECK_ORDER = (
    "ssh",
    "hostname",
    "route",
    "master-port",
    "disk",
    "upload",
    "data",
    "weights",
    "infiniband",
    "nvidia-smi",
    "docker",
    "nvidia-toolkit",
    "image",
    "cuda-driver",
    "shm-memlock",
    "image-runtime",
    "python-env",
    "torch-extensions",
    "nvme",
    "nvme-aio",
    "deepspeed-ops",
    "same-everywhere",
    "collective",
)
log = logging.getLogger(__name__)
PORT_LISTEN_MAX_S = 60.0  # the listener's own deadline, in case the controller vanishes
PORT_CONNECT_S = 5.0

LISTENER = r"""
import os, select, socket, sys, time
port, wait = int(sys.argv[1]), float(sys.argv[2])
s = socket.socket()
# As torch's TCPStore does: a port in TIME_WAIT (e.g. from the last preflight) is free to
# bind; one another process listens on is not.
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", port))  # all interfaces, as torch's TCPStore binds the master port
except OSError as exc:
    print("DZ_BIND_FAIL", exc.errno, exc.strerror, flush=True)
    sys.exit(3)
s.listen(64)
print("DZ_READY", flush=True)
end = time.monotonic() + wait
while time.monotonic() < end:
    ready, _, _ = select.select([s, 0], [], [], 0.5)
    if s in ready:
        conn, peer = s.accept()
        print("DZ_PEER", peer[0], flush=True)
        conn.close()
    if 0 in ready and not os.read(0, 1024):
        break  # the controller closed our stdin: every worker has tried
"""
CONNECTOR = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("DZ_CONNECTED")
except OSError as exc:
    print("DZ_CONNECT_FAIL", exc)
    sys.exit(3)
"""


def run_preflight(
    job: LoadedJob | JobSpec,
    nodes: list[Node],
    pool: HostPool,
    *,
    plan: LaunchPlan | None = None,
    image_missing_ok: bool = False,
    inputs: JobInputs | None = None,
) -> PreflightReport:
    """Check every node of ``nodes`` (rank order) through ``pool``; never raises for a node's failure.

    ``image_missing_ok``: a node without the job's image is a warning, not a failure
    (``dzctl launch`` distributes the image after preflight). ``inputs``: the job's local
    inputs when the caller read them already (``dzctl launch``), for the NVMe space check.
    """
    spec = job.spec if isinstance(job, LoadedJob) else job
    started = time.monotonic()
    plan = plan or make_plan(spec, nodes, "preflight")
    inputs = inputs or _local_inputs(job)
    offloads = _offloads_optimizer(spec, inputs)
    sure_ops, maybe_ops = ops.ops_to_probe(spec.accelerator, offloads, bool(spec.zero.nvme_path))
    contexts = {n.host: c.Context(spec, plan, n, image_missing_ok, sure_ops, maybe_ops) for n in plan.nodes}
    reports = {n.host: HostReport(n.host, n.node_rank) for n in plan.nodes}
    hosts = [n.host for n in plan.nodes]

    # 1. connect, all at once.
    connected = pool.map(lambda conn: conn, hosts)
    reachable = []
    for host, outcome in connected.items():
        seconds = pool.connect_seconds.get(host, 0.0)
        if isinstance(outcome, Exception):
            fix = getattr(outcome, "fix", None) or "check the host and the SSH config"
            reports[host].checks.append(fail("ssh", str(outcome), fix))
        else:
            how = "local, no SSH" if isinstance(outcome, LocalConnection) else f"connected in {seconds:.2f} s"
            reports[host].checks.append(ok("ssh", how))
            reachable.append(host)

    log.debug("preflight: connect %.2f s", time.monotonic() - started)
    # 2. per-node checks.
    master_target = _master_target(spec, pool, hosts[0])
    facts = {h: c.Facts() for h in reachable}
    nvme_need = _nvme_need(job, plan, inputs)
    # What the ranks download when the hub model is not cached (weights.py); unknown without the model's shape.
    download = inputs.shape.total_params * weights.BYTES_PER_PARAM if inputs is not None else None
    per_node = pool.map(
        lambda conn: _node_checks(conn, contexts[conn.host], facts[conn.host], master_target, nvme_need, download),
        reachable,
    )
    for host, outcome in per_node.items():
        reports[host].checks += _as_checks(outcome, "checks")

    log.debug("preflight: per-node checks done at %.2f s", time.monotonic() - started)
    # 3. master address and routes.
    master, reason = choose_master(spec, hosts, master_target, facts)
    interfaces: dict[str, str] = {}
    if master is None:
        for host in reachable:
            reports[host].checks.append(fail("route", reason, "fix node 0 first, or set launch.master_addr"))
    else:

        def route(conn: Connection) -> Check:
            check, iface = c.check_route(
                conn, master, conn.host == hosts[0], facts[conn.host], contexts[conn.host].python
            )
            if iface:
                interfaces[conn.host] = iface
            return check

        for host, outcome in pool.map(route, reachable).items():
            checks = _as_checks(outcome, "route")
            if host == hosts[0] and checks and checks[0].status == "ok":
                checks = [Check("route", "ok", f"{checks[0].detail}; master address {master} ({reason})")]
            reports[host].checks += checks

        log.debug("preflight: routes done at %.2f s", time.monotonic() - started)
        # 4. master port.
        if hosts[0] in reachable:
            port_checks = check_master_port(pool, hosts, reachable, master, spec.launch.master_port, contexts)
            for host, check in port_checks.items():
                reports[host].checks.append(check)

    log.debug("preflight: master port done at %.2f s", time.monotonic() - started)
    # 5. across nodes.
    if len(reachable) > 1:
        for host, check in same_everywhere(reachable, facts, spec).items():
            reports[host].checks.append(check)

    for report in reports.values():
        report.checks.sort(key=lambda chk: CHECK_ORDER.index(chk.name) if chk.name in CHECK_ORDER else 99)
    return PreflightReport(
        hosts=[reports[h] for h in hosts],
        elapsed_s=time.monotonic() - started,
        master_addr=master,
        master_port=spec.launch.master_port,
        interfaces={h: interfaces[h] for h in hosts if h in interfaces},
        gpu_mem_gib={h: round(f.gpu_mem_mib / 1024, 1) for h, f in facts.items() if f.gpu_mem_mib},
        host_mem_gib={h: round(f.host_mem_bytes / 2**30, 1) for h, f in facts.items() if f.host_mem_bytes},
        gpu_compute_capability={
            h: f.gpu_compute_capability for h, f in facts.items() if f.gpu_compute_capability is not None
        },
        gpu_name={h: f.gpu_name for h, f in facts.items() if f.gpu_name},
        host_optimizer={
            h: {
                k: round(f.env[k])
                for k in ("host_adam_params_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s")
                if f.env.get(k)
            }
            for h, f in facts.items()
            if f.env.get("host_adam_params_per_s")
        },
        infiniband={h: f.infiniband for h, f in facts.items() if f.infiniband},
        container_probe_s={h: round(f.container_probe_s, 3) for h, f in facts.items() if f.container_probe_s},
        nvme={h: f.nvme for h, f in facts.items() if f.nvme},
        deepspeed_ops={h: f.env["ops"] for h, f in facts.items() if isinstance(f.env.get("ops"), dict)},
    )


def _as_checks(outcome, name: str) -> list[Check]:
    if isinstance(outcome, Exception):
        return [fail(name, str(outcome), getattr(outcome, "fix", None) or "rerun; check the node")]
    return [outcome] if isinstance(outcome, Check) else list(outcome)


def _local_inputs(job: LoadedJob | JobSpec) -> JobInputs | None:
    """The job's local inputs, where they can be read here (launch refuses a bad one before preflight)."""
    from ..planning.inputs import read_inputs

    if not isinstance(job, LoadedJob):
        return None
    try:
        return read_inputs(job)
    except DzError:
        return None


def _offloads_optimizer(spec: JobSpec, inputs: JobInputs | None) -> bool | None:
    """Whether the plan offloads the optimizer, as the planner is allowed (None: the planner decides)."""
    from ..planning.memory.fromjob import allowed_from

    offload = allowed_from(inputs).offload if inputs is not None else None
    if inputs is None and spec.zero.config is None:
        offload = None if spec.zero.offload == "auto" else spec.zero.offload
    return None if offload is None else offload in ("optimizer", "all", "nvme")


def _nvme_need(job: LoadedJob | JobSpec, plan: LaunchPlan, inputs: JobInputs | None) -> int | None:
    """Bytes per node that offload to NVMe needs (the planner's figure), when the job fixes offload: nvme."""
    if not isinstance(job, LoadedJob) or job.spec.zero.offload != "nvme":
        return None
    from ..planning.inputs import read_inputs
    from ..planning.memory.fromjob import nvme_bytes_per_node

    try:
        inputs = inputs or read_inputs(job)
        return nvme_bytes_per_node(inputs, max(n.slots for n in plan.nodes), plan.world_size)
    except DzError:
        return None  # a local input (the model's shape) cannot be read here: launch refuses it before preflight


def _node_checks(
    conn: Connection,
    ctx: c.Context,
    facts: c.Facts,
    master_target: str | None,
    nvme_need: int | None = None,
    download_bytes: int | None = None,
) -> list[Check]:
    """One node's checks. Independent groups run at once, each on its own channel of the one connection:
    on a real cluster each command costs a round trip and a session start, so this saves most of the wait."""
    groups = [
        partial(c.safe, "hostname", c.check_identity, conn, ctx, facts, master_target),
        partial(c.safe, "disk", c.check_disk, conn, ctx),
        # The node-side data sources and the model after the upload probe, on its channel
        # (datacheck.py, loading/weights.py).
        lambda: (
            c.safe("upload", c.check_upload, conn, ctx)
            + c.safe("data", datacheck.check_data, conn, ctx)
            + c.safe("weights", weights.check_weights, conn, ctx, download_bytes)
        ),
        partial(c.safe, "infiniband", c.check_infiniband, conn, ctx, facts),
    ]
    if ctx.gpu:
        groups.append(partial(c.safe, "nvidia-smi", c.check_gpus, conn, ctx, facts))
    if ctx.docker:
        groups.append(partial(_docker_checks, conn, ctx, facts))
    else:
        groups.append(partial(c.safe, "python-env", c.check_python_env, conn, ctx, facts))
    # At most 6 groups: well under sshd's default of 10 sessions per connection.
    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix=f"dzctl-{conn.host}") as executor:
        checks = [check for found in executor.map(lambda group: group(), groups) for check in found]
    image = next((chk for chk in checks if chk.name == "image"), None)
    if ctx.gpu and image is not None and image.status == "ok":
        # Needs the driver's CUDA (nvidia-smi group) and the image's label (docker group).
        cuda = c.cuda_driver_check(facts.image_labels.get("dzctl.cuda"), facts.driver_cuda, facts.driver)
        checks += [cuda] if cuda else []
        stack = c.gpu_stack_check(facts.image_labels)
        checks += [stack] if stack else []
    where = "in the image" if ctx.docker else f"{ctx.python} on the node"
    ran_python = any(chk.name in ("image-runtime", "python-env") and chk.status != "fail" for chk in checks)
    if ran_python:  # after the group that ran the job's Python: facts.env holds its answer about the ops
        found = ops.ops_check(facts.env, ctx.ops, ctx.maybe_ops, where)
        checks += [found] if found else []
    if ctx.spec.zero.nvme_path:
        # After the group that ran the job's Python (facts.env holds its async_io answer).
        found, usable = nvme.check_nvme(conn, ctx.python, ctx.spec.zero.nvme_path, nvme_need, facts.env, where)
        checks += found
        facts.nvme = nvme.reading_dict(usable) if usable else None
    return checks


def _docker_checks(conn: Connection, ctx: c.Context, facts: c.Facts) -> list[Check]:
    """Daemon → toolkit → image → a container with the launch's flags: each step needs the one before."""
    try:
        docker, info = c.check_docker(conn, ctx)
    except RemoteError as exc:
        return [fail("docker", str(exc), exc.fix or "rerun; check the node")]
    checks = [docker]
    if info is None:
        return checks
    if ctx.gpu:
        checks += c.safe("nvidia-toolkit", c.check_toolkit, conn, ctx, info)
    image = c.safe("image", c.check_image, conn, ctx, facts)
    checks += image
    if image[0].status == "ok":
        checks += c.safe("image-runtime", c.check_container, conn, ctx, facts)
    return checks


def _master_target(spec: JobSpec, pool: HostPool, first: str) -> str | None:
    """What the others should reach node 0 at, before checking: the spec's value or node 0's SSH HostName."""
    if spec.launch.master_addr != "auto":
        return spec.launch.master_addr
    if first in ("localhost", "127.0.0.1", "::1"):
        return None
    try:
        return pool.resolve(first).hostname
    except DzError:
        return None  # its ssh check already says what is wrong with its config entry


def choose_master(
    spec: JobSpec, hosts: list[str], target: str | None, facts: dict[str, c.Facts]
) -> tuple[str | None, str]:
    """The master address and why. Never loopback for a multi-node job."""
    if spec.launch.master_addr != "auto":
        return spec.launch.master_addr, "launch.master_addr"
    first = hosts[0]
    if first not in facts:
        return None, f"node 0 ({first}) is unreachable, so no master address can be chosen"
    if len(hosts) == 1:
        return "127.0.0.1", "single node"
    own = [(ifname, addr) for ifname, addr in facts[first].addresses if not p.is_loopback(addr)]
    candidate = target if target and p.is_ip(target) else None
    if candidate is None and target:
        # As the others see it: the first reachable worker's resolution of node 0's name.
        seen = next((facts[h].resolved_master for h in hosts[1:] if h in facts and facts[h].resolved_master), [])
        candidate = seen[0] if seen else None
    if candidate and any(addr == candidate for _, addr in own):
        return candidate, f"the address {first} is reached at over SSH"
    physical = [(i, a) for i, a in own if not p.is_virtual_interface(i)]
    if physical:
        ifname, addr = physical[0]
        why = f"{target} is {candidate}, not an address of node 0" if candidate else f"{target} does not resolve"
        return addr, f"node 0's address on {ifname}; {why}"
    return None, f"node 0 ({first}) has no non-loopback IPv4 address on a physical interface"


def check_master_port(
    pool: HostPool,
    hosts: list[str],
    reachable: list[str],
    master: str,
    port: int,
    contexts: dict[str, c.Context],
) -> dict[str, Check]:
    """Bind the port on node 0 (it must be free) and connect to it from every other reachable node."""
    first = hosts[0]
    workers = [h for h in hosts[1:] if h in reachable]
    conn = pool.connection(first)
    lines: list[str] = []
    ready = threading.Event()
    read_end, write_end = os.pipe()
    outcome: dict[str, object] = {}

    def on_stdout(chunk: bytes) -> None:
        lines.extend(chunk.decode(errors="replace").splitlines())
        if any(ln.startswith(("DZ_READY", "DZ_BIND_FAIL")) for ln in lines):
            ready.set()

    def listen() -> None:
        try:
            with os.fdopen(read_end, "rb", buffering=0) as stdin:
                outcome["result"] = conn.run(
                    [contexts[first].python, "-c", LISTENER, str(port), str(PORT_LISTEN_MAX_S)],
                    stdin=stdin,
                    on_stdout=on_stdout,
                    timeout=PORT_LISTEN_MAX_S + 15,
                )
        except Exception as exc:  # reported below as the check's failure
            outcome["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        ready.wait(timeout=30)
        connects = {}
        if any(ln.startswith("DZ_READY") for ln in lines) and workers:

            def connect(worker: Connection) -> Result:
                argv = [contexts[worker.host].python, "-c", CONNECTOR, master, str(port), str(PORT_CONNECT_S)]
                return worker.run(argv, timeout=PORT_CONNECT_S + 20)

            connects = pool.map(connect, workers)
    finally:
        os.close(write_end)  # EOF on the listener's stdin: it exits
        thread.join(timeout=30)

    fix_port = f"pick another port (--set launch.master_port=N) or stop what listens on {port} (ss -ltnp)"
    checks: dict[str, Check] = {}
    bind_fail = next((ln for ln in lines if ln.startswith("DZ_BIND_FAIL")), None)
    result = outcome.get("result")
    if bind_fail:
        checks[first] = fail("master-port", f"port {port} is taken on the master: {bind_fail[13:]}", fix_port)
    elif not any(ln.startswith("DZ_READY") for ln in lines):
        why = outcome.get("error") or (c._tail(result) if isinstance(result, Result) else "no answer")
        checks[first] = warn(
            "master-port",
            f"could not test port {port}: {why}",
            f"make {contexts[first].python} available on the node (the probe listener is a Python one-liner)",
        )
    else:
        peers = [ln.split()[1] for ln in lines if ln.startswith("DZ_PEER")]
        checks[first] = ok("master-port", f"port {port} free on the master; {len(peers)} worker(s) connected")
    for worker in workers:
        res = connects.get(worker)
        if first in checks and checks[first].status == "fail":
            checks[worker] = fail("master-port", f"not tested: port {port} is taken on the master", fix_port)
        elif isinstance(res, Result) and res.ok:
            checks[worker] = ok("master-port", f"reached {master}:{port}")
        elif isinstance(res, Result) and c._missing(res):
            checks[worker] = warn(
                "master-port",
                f"could not test: {contexts[worker].python} not found",
                f"make {contexts[worker].python} available on the node",
            )
        elif worker in connects:
            detail = c._tail(res) if isinstance(res, Result) else str(res)
            checks[worker] = fail(
                "master-port",
                f"cannot reach {master}:{port}: {detail}",
                f"open TCP port {port} (and NCCL's ports) from this node to the master; check firewalls",
            )
        else:
            checks[worker] = warn("master-port", "not tested (the master listener did not start)", "see node 0")
    return checks


SAME_KEYS = (
    ("driver", "driver", lambda f: f.driver),
    ("image", "image ID", lambda f: f.image_id),
    ("nccl", "NCCL", lambda f: f.env.get("nccl")),
    ("torch", "torch", lambda f: f.env.get("torch")),
    ("deepspeed", "deepspeed", lambda f: f.env.get("deepspeed")),
)


def same_everywhere(hosts: list[str], facts: dict[str, c.Facts], spec: JobSpec) -> dict[str, Check]:
    """Pure: the same driver, image, NCCL, torch and deepspeed on all nodes that reported them.

    The value most nodes share is the reference, so the odd node is blamed wherever it sits in the
    hostfile (comparing to node 0 would blame every good node when node 0 is the odd one). With no
    majority (two nodes, or a tie) there is no telling which is right: every node fails, and the
    message names each value with its nodes."""
    differences: dict[str, list[str]] = {h: [] for h in hosts}
    agreed = []
    for _key, label, get in SAME_KEYS:
        values = {h: get(facts[h]) for h in hosts if get(facts[h])}
        if not values:
            continue
        by_value: dict[object, list[str]] = {}
        for host, value in values.items():
            by_value.setdefault(value, []).append(host)
        if len(by_value) == 1:
            agreed.append(f"{label} {_short(next(iter(by_value)))}")
            continue
        ranked = sorted(by_value.items(), key=lambda item: len(item[1]), reverse=True)
        (reference, holders), runner_up = ranked[0], ranked[1]
        if len(holders) > len(runner_up[1]):
            for host, value in values.items():
                if value != reference:
                    differences[host].append(
                        f"{label} {_short(value)} here, {_short(reference)} on {_names(holders)}"
                        f" ({len(holders)} of {len(values)} nodes)"
                    )
        else:
            every = "; ".join(f"{_short(value)} on {_names(owners)}" for value, owners in by_value.items())
            for host in values:
                differences[host].append(f"{label} differs with no majority: {every}")
    out = {}
    for host in hosts:
        if differences[host]:
            fix = (
                "dzctl distribute IMAGE --hosts FILE ships one image ID everywhere"
                if spec.runtime == "docker"
                else "install the same versions on every node"
            ) + "; align NVIDIA driver versions across nodes"
            out[host] = fail("same-everywhere", "; ".join(differences[host]), fix)
        else:
            out[host] = ok("same-everywhere", ("same " + ", ".join(agreed)) if agreed else "nothing to compare")
    return out


def _short(value: object) -> str:
    """An image ID as `docker images` shows it (sha256: and 12 hex digits); versions whole."""
    return str(value)[:19]


def _names(hosts: list[str], limit: int = 4) -> str:
    shown = ", ".join(hosts[:limit])
    return shown + (f" and {len(hosts) - limit} more" if len(hosts) > limit else "")
