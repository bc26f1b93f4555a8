"""The per-node checks: each runs real commands on one node and returns ``Check`` values.

Every function here takes a connection and a ``Context`` (what the job needs of
the node) and returns checks plus the facts later cross-node checks compare.
The commands are argv lists; where a shell is needed (``sh -c SCRIPT``), the
script is a constant and every value reaches it as a positional argument, so
nothing from a spec or hostfile is ever read as shell code.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import uuid
from dataclasses import dataclass, field

from ..errors import RemoteError
from ..planning.launchplan import LaunchPlan, NodePlan, docker_ulimits
from ..spec.job import JobSpec
from ..transport.connection import Connection
from ..transport.results import Result
from . import netprobe
from . import parsers as p
from .loading.ops import CPU_ADAM
from .model import Check, fail, ok, warn

# How long a node may take per kind of command. Probing tools is quick; the
# first `docker run` of a multi-GB image on a cold page cache is not, and a
# single-rank NCCL init inside it takes several seconds more.
QUICK_S = 30.0
CONTAINER_S = 180.0

# Below this much free space at the output dir a checkpoint save fails. A
# ZeRO-3 checkpoint of an 8B model is ~100 GB (bf16 weights + fp32 Adam states),
# so GPU jobs want far more; CPU jobs here are test-sized.
DISK_FAIL_BYTES = 1 * 2**30
DISK_WARN_BYTES = {"gpu": 100 * 2**30, "cpu": 2 * 2**30}
# train.save: false writes no checkpoint and no final model: only the logs, the progress
# record and the tokenized data cache (data.cache_dir, under the output dir by default).
NO_SAVE_WARN_BYTES = 2 * 2**30
# NCCL's shared-memory transport and DeepSpeed's CPU shm op live in /dev/shm;
# Docker's default of 64 MiB makes NCCL fail with "unhandled system error".
SHM_MIN_BYTES = 1 * 2**30
GPU_BUSY_MIB = 1024

DISK_SCRIPT = (
    # For each path: the nearest existing ancestor (the dirs may not exist yet)
    # and df's data row for it, tab-separated after the path.
    'for p in "$@"; do d=$p; while [ ! -e "$d" ]; do d=$(dirname -- "$d"); done; '
    'printf \'%s\\t%s\\t\' "$p" "$d"; df -P -B1 -- "$d" | tail -n 1; done'
)
LIMITS_SCRIPT = 'echo "DZ_MEMLOCK $(ulimit -l)"; printf "DZ_SHM "; df -P -B1 /dev/shm | tail -n 1'
ENV_MARK = "DZCTL_ENV "
# Part of PYTHON_PROBE, where the plan may offload the optimizer: this host's AdamW rate and pinned copies
# (planning/speed/offload.py). Reads and writes the probe's ``out``.
HOST_ADAM_PROBE = r"""
if os.environ.get("DZ_HOST_ADAM") == "1":  # the plan may offload the optimizer: this host's AdamW and copy up
    try:
        import time
        import torch
        # 2**25 fp32 elements (512 MiB with the gradient and both moments): past every cache, so the rate is the
        # memory bandwidth's, as an offloaded step over gigabytes of states is. torch's fused CPU AdamW measured
        # the rate of DeepSpeed's CPU Adam (benchmarks/offload_rates.py), and needs no op build.
        n = 1 << 25
        w = torch.zeros(n)
        w.grad = torch.ones(n)
        opt = torch.optim.AdamW([w], lr=1e-5, fused=True)
        opt.step()
        # The fastest of five steps, each timed alone: another process's burst (a launch still exiting) only
        # slows a step. Three timed together read 2.61 G params/s on an H100 node that read 5.10 fourteen
        # minutes before and stepped as fast as ever (benchmarks/results/plans-h100x1-20261207d).
        seconds = []
        for _ in range(5):
            began = time.perf_counter()
            opt.step()
            seconds.append(time.perf_counter() - began)
        out["host_adam_params_per_s"] = n / min(seconds)
        if out.get("gpus"):
            host = torch.empty(1 << 27, dtype=torch.bfloat16, pin_memory=True)
            dev = torch.empty_like(host, device="cuda")
            dev.copy_(host)
            torch.cuda.synchronize()
            for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
                began = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                out[f"{name}_bytes_per_s"] = host.numel() * 2 / (time.perf_counter() - began)
    except Exception as exc:
        out["host_adam_error"] = f"{type(exc).__name__}: {exc}"[:300]
"""
# Runs in the image (or the node's Python for runtime: process). Prints one JSON
# line; an import failure is reported in it rather than as a traceback.
PYTHON_PROBE = (
    r"""
import json, os, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda or "cpu"
    out["cuda_available"] = torch.cuda.is_available()
    out["gpus"] = torch.cuda.device_count() if out["cuda_available"] else 0
    if out["cuda_available"] and torch.distributed.is_nccl_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if out["gpus"] and os.environ.get("DZ_NCCL_TEST") == "1":
        # One rank, one GPU: proves NCCL can initialise and run a collective here.
        import socket, torch.distributed as dist
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        try:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            t = torch.ones(1, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            out["nccl_ok"] = True
            dist.destroy_process_group()
        except Exception as exc:
            out["nccl_ok"] = False
            out["nccl_error"] = f"{type(exc).__name__}: {exc}"[:300]
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
if os.environ.get("DZ_AIO_TEST") == "1":  # zero.nvme_path: DeepSpeed's async_io op needs libaio
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        out["async_io"] = bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception as exc:
        out["async_io_error"] = f"{type(exc).__name__}: {exc}"[:300]
"""
    + HOST_ADAM_PROBE
    + r"""
try:
    import deepspeed
    out["deepspeed"] = deepspeed.__version__
except Exception as exc:
    out["deepspeed_error"] = f"{type(exc).__name__}: {exc}"[:300]
# DeepSpeed's JIT op builds lock their folder; a build killed mid-way leaves the lock, and every
# later rank waits on it forever. The folder is the trainer's (train/environment.py) unless set.
import glob, tempfile, time
ext = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(tempfile.gettempdir(), "dzctl-torch-extensions")
if os.environ.get("DZ_OPS"):  # the op builders the plan loads (preflight/loading/ops.py): as DeepSpeed's load() decides
    try:
        import shutil
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops
        from deepspeed.ops.op_builder.builder import CUDAOpBuilder, probe_is_compatible
        from torch.utils import cpp_extension
        accel, ops = get_accelerator(), {}
        for cls in os.environ["DZ_OPS"].split(","):
            builder = accel.create_op_builder(cls)
            if builder is None:
                ops[cls] = {"missing": [f"DeepSpeed's {accel._name} accelerator has no {cls}"]}
                continue
            name, missing = builder.NAME, []
            built = glob.glob(os.path.join(ext, name, name + "*.so"))
            if installed_ops.get(name) and accelerator_name == accel._name:
                ops[cls] = {"op": name, "how": "prebuilt"}
                continue
            if built:  # torch reloads it without compiling while its sources are unchanged
                ops[cls] = {"op": name, "how": "built", "dir": os.path.dirname(built[0])}
                continue
            if not probe_is_compatible(builder, False):
                why = getattr(builder, "error_log", None)
                missing.append("DeepSpeed's builder says it is not compatible here" + (f" ({why})" if why else ""))
            cxx = cpp_extension.get_cxx_compiler()
            if not shutil.which(cxx):
                missing.append(f"no C++ compiler: {cxx} ($CXX, else c++) is not on PATH")
            if not cpp_extension.is_ninja_available():
                missing.append("ninja is not on PATH")
            tools = [shutil.which(cxx) or cxx, "ninja"]
            if isinstance(builder, CUDAOpBuilder) and torch.cuda.is_available():
                nvcc = os.path.join(cpp_extension.CUDA_HOME or "/usr/local/cuda", "bin", "nvcc")
                if not os.path.exists(nvcc):
                    missing.append(f"no nvcc ({nvcc}): CUDA ops need the CUDA toolkit")
                tools.append(nvcc)
            ops[cls] = {"op": name, "how": "jit", "tools": ", ".join(tools), "missing": missing}
        out["ops"] = ops
    except Exception as exc:
        out["ops_error"] = f"{type(exc).__name__}: {exc}"[:300]
out["extension_locks"] = [[f, time.time() - os.path.getmtime(f)] for f in glob.glob(os.path.join(ext, "*", "lock"))]
print("DZCTL_ENV " + json.dumps(out))
"""
)
# A JIT op build takes minutes (async_io with cpu_adam took about 4 on a loaded 2-core machine);
# a lock older than this is left by a build that was killed.
STALE_EXTENSION_LOCK_S = 20 * 60
# In a container: limits first (any image has sh and df), then the Python probe
# with whichever interpreter the image has.
CONTAINER_SCRIPT = (
    LIMITS_SCRIPT + '; if command -v python3 >/dev/null 2>&1; then py=python3; else py=python; fi; "$py" -c "$1"'
)


@dataclass
class Context:
    """What one node must offer the job."""

    spec: JobSpec
    plan: LaunchPlan
    node: NodePlan
    image_missing_ok: bool = False  # launch distributes a missing image itself
    # DeepSpeed op builders the plan loads, and those only an offload the planner may choose loads (loading/ops.py).
    ops: list[str] = field(default_factory=list)
    maybe_ops: list[str] = field(default_factory=list)

    @property
    def gpu(self) -> bool:
        return self.spec.accelerator == "gpu"

    @property
    def docker(self) -> bool:
        return self.spec.runtime == "docker"

    def probe_env(self) -> dict[str, str]:
        """What the Python probe runs with beyond the node's own environment: as the ranks would see it."""
        env = {}
        if self.ops or self.maybe_ops:
            env["DZ_OPS"] = ",".join(self.ops + self.maybe_ops)
        if self.gpu and CPU_ADAM in self.ops + self.maybe_ops:  # the step-time model times the host's step
            env["DZ_HOST_ADAM"] = "1"
        if not self.gpu:  # the trainer sets it before DeepSpeed picks its accelerator (train/environment.py)
            env["DS_ACCELERATOR"] = "cpu"
        # The job's own settings that decide where ops are built and with what.
        for name in ("TORCH_EXTENSIONS_DIR", "CXX", "PATH", "CUDA_HOME", "DS_ACCELERATOR"):
            if name in self.spec.launch.env:
                env[name] = self.spec.launch.env[name]
        return env

    @property
    def python(self) -> str:
        """The interpreter used for probes on the node itself."""
        return self.spec.launch.python if self.spec.runtime == "process" else "python3"


@dataclass
class Facts:
    """What a node reported, for checks across nodes and for choosing the master address."""

    hostname: str | None = None
    addresses: list[tuple[str, str]] = field(default_factory=list)
    driver: str | None = None
    driver_cuda: str | None = None
    image_id: str | None = None
    image_labels: dict[str, str] = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # the Python probe's answer
    resolved_master: list[str] = field(default_factory=list)
    infiniband: list[str] = field(default_factory=list)
    container_probe_s: float | None = None
    host_mem_bytes: int | None = None
    gpu_mem_mib: int | None = None  # the smallest of the GPUs the job uses
    gpu_compute_capability: float | None = None  # the lowest of the GPUs the job uses
    gpu_name: str | None = None  # nvidia-smi's name of the GPUs the job uses; None if they differ
    nvme: dict | None = None  # zero.nvme_path's free space and bandwidths, when usable


def _run(conn: Connection, argv: list[str], timeout: float = QUICK_S, env: dict | None = None) -> Result:
    return conn.run(argv, timeout=timeout, env=env)


def _missing(result: Result) -> bool:
    return result.exit_code == 127 or "command not found" in result.stderr or "No such file" in result.stderr


def _tail(result: Result, limit: int = 300) -> str:
    text = (result.stderr.strip() or result.stdout.strip()).splitlines()
    return " ".join(text[-3:])[:limit] if text else result.how_it_ended


# -- network identity ----------------------------------------------------------
def check_identity(conn: Connection, ctx: Context, facts: Facts, master_target: str | None) -> list[Check]:
    """The node's hostname (must not resolve to loopback) and its IPv4 addresses."""
    checks = []
    name = _run(conn, ["hostname"])
    facts.hostname = name.stdout.strip() or None
    addrs = _run(conn, ["ip", "-4", "-o", "addr", "show"])
    if addrs.ok:
        facts.addresses = p.parse_addresses(addrs.stdout)
    elif _missing(addrs):  # no iproute2 on the node: its Python asks the kernel (netprobe.py)
        probe = _run(conn, netprobe.probe_argv(ctx.python))
        if not probe.ok:
            detail = f"cannot list the node's addresses: no `ip`, and {ctx.python} failed: {_tail(probe)}"
            checks.append(fail("route", detail, netprobe.IP_TOOL_FIX))
        with contextlib.suppress(p.ParseError):
            facts.addresses = netprobe.parse_addresses(probe.stdout) if probe.ok else []
    meminfo = _run(conn, ["cat", "/proc/meminfo"])
    # Without it the planner cannot check host RAM, and says so itself.
    with contextlib.suppress(p.ParseError):
        if meminfo.ok:
            facts.host_mem_bytes = p.parse_meminfo_total(meminfo.stdout)
    if master_target and not p.is_ip(master_target):
        facts.resolved_master = p.parse_getent(_run(conn, ["getent", "ahostsv4", master_target]).stdout)
    if not facts.hostname:
        return [fail("hostname", f"`hostname` failed: {_tail(name)}", "check the node's hostname setup")]
    resolved = p.parse_getent(_run(conn, ["getent", "ahostsv4", facts.hostname]).stdout)
    loopback = [a for a in resolved if p.is_loopback(a)]
    if loopback and len(ctx.plan.nodes) > 1:  # one node talks to itself: loopback is fine there
        checks.append(
            warn(
                "hostname",
                f"{facts.hostname} resolves to {', '.join(loopback)}: gloo/NCCL would advertise a loopback address",
                "dzctl sets NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME to the interface found below, which avoids it; "
                f"to fix the node itself, map {facts.hostname} to its real address in /etc/hosts",
            )
        )
    elif resolved:
        checks.append(ok("hostname", f"{facts.hostname} resolves to {', '.join(resolved)}"))
    else:
        checks.append(
            ok("hostname", f"{facts.hostname} (does not resolve; dzctl passes addresses and interface names instead)")
        )
    return checks


def check_route(
    conn: Connection, master: str, is_master: bool, facts: Facts, python: str = "python3"
) -> tuple[Check, str | None]:
    """The interface this node uses to reach the master address (NCCL/GLOO_SOCKET_IFNAME).

    ``ip route get`` where the node has iproute2, else ``python`` asks the kernel (netprobe.py)."""
    target = master
    if not p.is_ip(master):
        target = facts.resolved_master[0] if facts.resolved_master else ""
        if not target:
            return (
                fail(
                    "route",
                    f"master address {master} does not resolve on this node",
                    "use an IP address for launch.master_addr, or add the name to DNS//etc/hosts on every node",
                ),
                None,
            )
    result = _run(conn, ["ip", "route", "get", target])
    try:
        if result.ok:
            route = p.parse_route_get(result.stdout)
        elif _missing(result):
            probe = _run(conn, netprobe.probe_argv(python, target))
            if not probe.ok:
                detail = f"cannot find the route to master {target}: no `ip`, and {python} failed: {_tail(probe)}"
                return fail("route", detail, netprobe.IP_TOOL_FIX), None
            route = netprobe.parse_route(probe.stdout, target)
        else:
            return fail(
                "route", f"no route to master {target}: {_tail(result)}", "check the node's routing table"
            ), None
    except p.ParseError as exc:
        return fail("route", str(exc), "check the node's routing table (`ip route get` or /proc/net/route)"), None
    if is_master:
        own = [ifname for ifname, addr in facts.addresses if addr == target]
        if route.kind == "local" and own:
            return ok("route", f"master {target} is this node's address on {own[0]}"), own[0]
        if route.kind == "local":
            return ok("route", f"master {target} is local ({route.dev})"), route.dev
        return (
            fail(
                "route",
                f"master address {target} is not an address of node 0 (route goes out via {route.dev})",
                "set launch.master_addr to an address of the first node in the hostfile, or leave it at auto",
            ),
            None,
        )
    if route.kind == "local" or route.dev == "lo":
        return (
            fail(
                "route",
                f"master {target} is an address of this node too (route via {route.dev})",
                "each node needs its own address: check for duplicate IPs or a wrong launch.master_addr",
            ),
            None,
        )
    detail = f"reaches master {target} via {route.dev}" + (f" (src {route.src})" if route.src else "")
    if p.is_virtual_interface(route.dev):
        return (
            warn(
                "route",
                detail + ": a container/VM bridge, not a physical NIC",
                "set launch.master_addr to node 0's address on the cluster network",
            ),
            route.dev,
        )
    return ok("route", detail), route.dev


# -- storage --------------------------------------------------------------------
def check_disk(conn: Connection, ctx: Context) -> Check:
    """Free space where the run writes (the output dir, the job dir), against what this plan writes there."""
    paths = list(dict.fromkeys([ctx.node.output_dir, ctx.node.job_dir.rsplit("/jobs/", 1)[0]]))
    result = _run(conn, ["sh", "-c", DISK_SCRIPT, "sh", *paths])
    try:
        spaces = p.parse_disk_lines(result.stdout)
    except p.ParseError as exc:
        return fail("disk", str(exc), "check `df -P` on the node")
    if not spaces:
        return fail("disk", f"df failed: {_tail(result)}", "check that df (coreutils) works on the node")
    saves = ctx.spec.train.save
    need = DISK_WARN_BYTES[ctx.spec.accelerator] if saves else NO_SAVE_WARN_BYTES
    worst = min(spaces, key=lambda s: s.avail_bytes)
    detail = "; ".join(f"{s.path}: {p.gib(s.avail_bytes)} free on {s.mount}" for s in spaces)
    if worst.avail_bytes < DISK_FAIL_BYTES:
        return fail("disk", detail, f"free space on {worst.mount} or point train.output_dir elsewhere")
    if worst.avail_bytes < need:
        if not saves:
            return warn(
                "disk",
                detail + f" (train.save is false: the logs and the data cache want ≥ {p.gib(need)})",
                f"free space on {worst.mount}, or point train.output_dir (and data.cache_dir) elsewhere",
            )
        return warn(
            "disk",
            detail + f" (checkpoints want ≥ {p.gib(need)})",
            f"free space on {worst.mount}, lower train.save_total_limit, or point train.output_dir elsewhere",
        )
    return ok("disk", detail)


def check_upload(conn: Connection, ctx: Context) -> Check:
    """Write a file into the job's remote dir the way launch ships the job directory (mkdir + put with
    a mode, over SFTP or, where the server has none, exec channels), read its mode back, remove it.
    A node that cannot receive files fails here, before minutes of image distribution."""
    remote_dir = ctx.node.job_dir.rsplit("/jobs/", 1)[0]
    probe = f"{remote_dir}/.dzctl-upload-probe-{uuid.uuid4().hex[:8]}"
    fix = f"make {remote_dir} writable on the node for the SSH user, or set launch.remote_dir to a folder that is"
    try:
        conn.mkdir(remote_dir)
        conn.put(b"dzctl upload probe\n", probe, mode=0o600)
    except RemoteError as exc:
        return fail("upload", f"cannot write into {remote_dir}: {exc.message}", fix)
    seen = _run(conn, ["sh", "-c", 'stat -c %a "$1"; rm -f "$1"', "sh", probe])
    how = getattr(conn, "upload_transport", "local")
    if not seen.ok or seen.stdout.split()[:1] != ["600"]:
        return fail("upload", f"a file written to {remote_dir} ({how}) reads back as {_tail(seen)!r}", fix)
    return ok("upload", f"{remote_dir} takes files ({how}, mode set before content)")


def check_infiniband(conn: Connection, ctx: Context, facts: Facts | None = None) -> Check:
    result = _run(conn, ["ls", "/dev/infiniband"])
    devices = result.stdout.split() if result.ok else []
    if facts is not None:
        # Launch passes /dev/infiniband to the containers of nodes that have verbs devices.
        facts.infiniband = [d for d in devices if d.startswith("uverbs")]
    return infiniband_check(devices, ctx)


def infiniband_check(devices: list[str], ctx: Context) -> Check:
    """Pure: IB verbs devices on the node, and whether the container would get them."""
    verbs = [d for d in devices if d.startswith("uverbs")]
    if not verbs:
        extra = f" ({', '.join(devices)} only)" if devices else ""
        return ok("infiniband", f"no InfiniBand verbs devices{extra}; NCCL will use TCP sockets")
    if ctx.docker:
        # launch reads these facts and adds --device /dev/infiniband for this node's container.
        passed = "launch passes /dev/infiniband to the container"
        return ok("infiniband", f"InfiniBand devices: {', '.join(verbs)}; {passed}")
    return ok("infiniband", f"InfiniBand devices: {', '.join(verbs)}")


def limits_check(text: str, ctx: Context, where: str) -> Check:
    """/dev/shm size and the memlock limit, as seen ``where`` (in the container, or on the node)."""
    strict = fail if ctx.gpu else warn
    lines = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith(("DZ_MEMLOCK ", "DZ_SHM ")))
    try:
        if set(lines) != {"DZ_MEMLOCK", "DZ_SHM"}:
            raise p.ParseError(f"no limits in output: {text.strip()[-200:]!r}")
        memlock = p.parse_memlock(lines["DZ_MEMLOCK"])
        shm = int(lines["DZ_SHM"].split()[1])  # df -P -B1 row: fs, size, used, avail, use%, mount
    except (p.ParseError, IndexError, ValueError) as exc:
        return fail("shm-memlock", f"could not read limits {where}: {exc}", "check that sh and df work there")
    memlock_text = "unlimited" if memlock is None else p.human_bytes(memlock)
    detail = f"{where}: /dev/shm {p.gib(shm)}, memlock {memlock_text}"
    if shm < SHM_MIN_BYTES:
        fix = "dzctl runs containers with --ipc host; enlarge the node's /dev/shm (mount -o remount,size=…)"
        return strict("shm-memlock", detail + f" (< {p.gib(SHM_MIN_BYTES)})", fix)
    if ctx.gpu and memlock is not None and memlock < 2**30:
        # Only NCCL (GPU jobs) pins memory; gloo on CPU does not care.
        fix = (
            "set `* - memlock unlimited` in /etc/security/limits.conf (process runtime) or LimitMEMLOCK=infinity "
            "for docker.service; NCCL pins buffers and fails with ibv_reg_mr errors"
        )
        return fail("shm-memlock", detail, fix)
    return ok("shm-memlock", detail)


# -- python / torch ---------------------------------------------------------------
def env_check(name: str, env: dict, ctx: Context, where: str, fix_missing: str) -> Check:
    """torch/deepspeed importable, and for GPU jobs CUDA, GPU count and NCCL usable."""
    if "torch_error" in env or "torch" not in env:
        return fail(name, f"{where}: import torch failed: {env.get('torch_error', 'no answer')}", fix_missing)
    if "deepspeed_error" in env:
        return fail(name, f"{where}: import deepspeed failed: {env['deepspeed_error']}", fix_missing)
    detail = f"{where}: python {env.get('python')}, torch {env['torch']}, deepspeed {env.get('deepspeed')}"
    if not ctx.gpu:
        return ok(name, detail)
    detail += f", CUDA {env.get('cuda')}, NCCL {env.get('nccl', 'none')}, {env.get('gpus', 0)} GPU(s) visible"
    want = ctx.node.slots
    if not env.get("cuda_available"):
        return fail(
            name,
            detail + ": CUDA not available",
            "use a CUDA build of torch (dzctl build --flavour cuda) and check `docker run --gpus all` works",
        )
    if env.get("gpus", 0) < want:
        return fail(name, detail + f": need {want}", "check the GPUs passed in (--gpus) and CUDA_VISIBLE_DEVICES")
    if env.get("nccl_ok") is False:
        return fail(name, detail + f": NCCL failed: {env.get('nccl_error')}", "check the NCCL install in the image")
    return ok(name, detail + (", NCCL all-reduce ok" if env.get("nccl_ok") else ""))


def check_python_env(conn: Connection, ctx: Context, facts: Facts) -> list[Check]:
    """runtime: process — the node's Python must import torch and deepspeed."""
    env = {"DZ_NCCL_TEST": "1"} if ctx.gpu else {}
    if ctx.spec.zero.nvme_path:
        env["DZ_AIO_TEST"] = "1"
    if ctx.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ctx.node.gpus))
    env.update(ctx.probe_env())
    result = _run(conn, [ctx.python, "-c", PYTHON_PROBE], timeout=CONTAINER_S, env=env)
    fix = (
        f"install torch and deepspeed for {ctx.python} on every node, "
        "or set launch.python to an interpreter that has them"
    )
    if _missing(result):
        return [fail("python-env", f"{ctx.python} not found: {_tail(result)}", fix)]
    try:
        facts.env = p.parse_json_line(result.stdout, ENV_MARK)
    except p.ParseError:
        return [fail("python-env", f"{ctx.python} probe failed: {_tail(result)}", fix)]
    limits = _run(conn, ["sh", "-c", LIMITS_SCRIPT])
    checks = [env_check("python-env", facts.env, ctx, ctx.python, fix), limits_check(limits.stdout, ctx, "on the node")]
    return checks + extension_lock_checks(facts.env)


def extension_lock_checks(env: dict) -> list[Check]:
    """A DeepSpeed op-build lock left by a killed build: the ranks would wait on it forever, silently."""
    stale = [(path, age) for path, age in env.get("extension_locks") or [] if age > STALE_EXTENSION_LOCK_S]
    if not stale:
        return []
    listed = ", ".join(f"{path} ({age / 60:.0f} min old)" for path, age in stale)
    return [
        fail(
            "torch-extensions",
            f"a DeepSpeed op build was killed mid-way and left its lock: {listed}; every rank that needs the op "
            "would wait on it forever",
            f"remove it on this node once no build runs there: rm {' '.join(shlex.quote(p) for p, _ in stale)}",
        )
    ]


# -- docker -------------------------------------------------------------------------
def check_docker(conn: Connection, ctx: Context) -> tuple[Check, p.DockerInfo | None]:
    result = _run(conn, ["docker", "info", "--format", "{{json .}}"])
    if _missing(result):
        return fail(
            "docker", "docker CLI not found", "install Docker Engine on the node (docs.docker.com/engine/install)"
        ), None
    text = result.stdout + result.stderr
    if "permission denied" in text.lower():
        return (
            fail("docker", f"no access to the docker daemon: {_tail(result)}", "add the SSH user to the docker group"),
            None,
        )
    try:
        info = p.parse_docker_info(result.stdout)
    except p.ParseError as exc:
        return (
            fail(
                "docker",
                f"docker daemon not reachable: {exc} {_tail(result) if not result.ok else ''}".strip(),
                "start it (systemctl start docker) and check DOCKER_HOST for the SSH user",
            ),
            None,
        )
    detail = f"Docker {info.server_version}, cgroup driver {info.cgroup_driver or '?'}"
    detail += f" (cgroup v{info.cgroup_version or '?'})"
    if ctx.gpu and info.cgroup_driver == "systemd":
        return (
            warn(
                "docker",
                detail + ": with the systemd cgroup driver, `systemctl daemon-reload` can detach GPUs from running "
                "containers (NVIDIA/nvidia-container-toolkit#48)",
                'set "exec-opts": ["native.cgroupdriver=cgroupfs"] in /etc/docker/daemon.json, '
                "or avoid daemon-reload on nodes while jobs run",
            ),
            info,
        )
    return ok("docker", detail), info


def check_toolkit(conn: Connection, ctx: Context, info: p.DockerInfo) -> Check:
    """The NVIDIA Container Toolkit: what makes `docker run --gpus` work."""
    version_result = _run(conn, ["nvidia-ctk", "--version"])
    try:
        version = p.parse_nvidia_ctk_version(version_result.stdout)
    except p.ParseError:
        version = None
    hook = _run(conn, ["sh", "-c", "command -v nvidia-container-runtime-hook"]).ok
    cdi = False
    if version:
        cdi = "nvidia.com/gpu" in _run(conn, ["nvidia-ctk", "cdi", "list"]).stdout
    ways = []
    if "nvidia" in info.runtimes:
        ways.append("nvidia runtime registered" + (" (default)" if info.default_runtime == "nvidia" else ""))
    if cdi:
        ways.append("CDI specs for nvidia.com/gpu")
    if hook:
        ways.append("nvidia-container-runtime-hook")
    if not ways:
        return fail(
            "nvidia-toolkit",
            f"no NVIDIA Container Toolkit: docker runtimes {', '.join(info.runtimes) or 'none'}, no nvidia hook or CDI "
            "spec; `docker run --gpus` fails with 'could not select device driver'",
            "install nvidia-container-toolkit, then `nvidia-ctk runtime configure --runtime=docker` and restart docker",
        )
    return ok("nvidia-toolkit", f"nvidia-ctk {version or 'not found'}; " + ", ".join(ways))


def check_image(conn: Connection, ctx: Context, facts: Facts) -> Check:
    image = ctx.spec.image
    result = _run(conn, ["docker", "image", "inspect", "--format", "{{json .}}", image])
    if not result.ok:
        if ctx.image_missing_ok:
            return warn("image", f"image {image} not on this node yet", "dzctl launch copies it before starting")
        return fail(
            "image",
            f"image {image} not on this node",
            "dzctl distribute IMAGE --hosts FILE (ships the image by ID), or build it here with dzctl build",
        )
    try:
        data = json.loads(result.stdout)
    except json.JSONDecodeError:
        return fail("image", f"docker image inspect printed no JSON: {_tail(result)}", "check the docker CLI")
    facts.image_id = data.get("Id")
    facts.image_labels = (data.get("Config") or {}).get("Labels") or {}
    cuda = facts.image_labels.get("dzctl.cuda")
    detail = f"{image} = {str(facts.image_id)[:19]}" + (f", CUDA {cuda}" if cuda else "")
    return ok("image", detail)


def check_container(conn: Connection, ctx: Context, facts: Facts) -> list[Check]:
    """One throwaway container with the launch's own flags: limits, torch, GPUs and NCCL inside."""
    argv = ["docker", "run", "--rm", "--network", "host", "--ipc", "host", *docker_ulimits(ctx.spec)]
    if ctx.gpu:
        argv += ["--gpus", '"device=' + ",".join(map(str, ctx.node.gpus)) + '"', "--env", "DZ_NCCL_TEST=1"]
    if ctx.spec.zero.nvme_path:
        argv += ["--env", "DZ_AIO_TEST=1"]
    for name, value in ctx.probe_env().items():
        argv += ["--env", f"{name}={value}"]
    argv += ["--entrypoint", "sh", ctx.spec.image, "-c", CONTAINER_SCRIPT, "sh", PYTHON_PROBE]
    result = _run(conn, argv, timeout=CONTAINER_S)
    # Mostly the container's start and its Python importing torch: reported apart from
    # dzctl's own time (benchmarks/launch_overhead.py).
    facts.container_probe_s = result.elapsed_s
    if "could not select device driver" in result.stderr:
        return [
            fail(
                "image-runtime",
                f"docker run --gpus failed: {_tail(result)}",
                "install/configure the NVIDIA Container Toolkit (see nvidia-toolkit)",
            )
        ]
    if "error setting rlimit" in result.stderr:
        # runc raises the container's hard limits; it can go above dockerd's own only with CAP_SYS_RESOURCE.
        return [
            fail(
                "image-runtime",
                "the container cannot start with the launch's --ulimit memlock=-1: dockerd's own memlock limit is "
                f"lower and it may not raise it ({_tail(result, 160)})",
                "give dockerd unlimited memlock: `systemctl edit docker` → [Service] LimitMEMLOCK=infinity, "
                "then restart docker",
            )
        ]
    if "DZ_MEMLOCK" not in result.stdout:
        return [fail("image-runtime", f"the container did not start: {_tail(result)}", "run the command by hand")]
    checks = [limits_check(result.stdout, ctx, "in the container")]
    fix = "rebuild the image with dzctl build (it installs torch and deepspeed) and distribute it again"
    try:
        facts.env = p.parse_json_line(result.stdout, ENV_MARK)
    except p.ParseError:
        checks.append(fail("image-runtime", f"no Python probe answer from the image: {_tail(result)}", fix))
        return checks
    checks.append(env_check("image-runtime", facts.env, ctx, "in the container", fix))
    return checks


# -- GPUs on the node ---------------------------------------------------------------
def check_gpus(conn: Connection, ctx: Context, facts: Facts) -> list[Check]:
    result = _run(conn, list(p.GPU_QUERY_ARGV))
    if _missing(result):
        return [
            fail(
                "nvidia-smi",
                "nvidia-smi not found: no NVIDIA driver on this node",
                "install the NVIDIA driver on the node, or run this job on CPU (accelerator: cpu)",
            )
        ]
    if not result.ok:
        return [
            fail(
                "nvidia-smi",
                f"nvidia-smi failed: {_tail(result)}",
                "check the driver (`nvidia-smi` by hand; a driver/library version mismatch needs a reboot)",
            )
        ]
    try:
        gpus = p.parse_gpu_query(result.stdout)
    except p.ParseError as exc:
        return [fail("nvidia-smi", f"unexpected nvidia-smi output: {exc}", "check `nvidia-smi --query-gpu` by hand")]
    header = _run(conn, ["nvidia-smi"])
    try:
        facts.driver, facts.driver_cuda = p.parse_smi_header(header.stdout)
    except p.ParseError:
        facts.driver = gpus[0].driver_version if gpus else None
    used = [g for g in gpus if g.index in ctx.node.gpus]
    facts.gpu_mem_mib = min((g.memory_total_mib for g in used), default=None)
    facts.gpu_compute_capability = min((cap for g in used if (cap := g.compute_capability) is not None), default=None)
    names = {g.name for g in used}
    facts.gpu_name = names.pop() if len(names) == 1 else None  # the step-time model's GPU kind
    return [gpu_inventory_check(gpus, ctx.node.gpus, facts.driver_cuda)]


def gpu_inventory_check(gpus: list[p.Gpu], wanted: tuple[int, ...], driver_cuda: str | None) -> Check:
    """Pure: the GPUs a node has against the ids the job will use."""
    if not gpus:
        return fail("nvidia-smi", "nvidia-smi lists no GPUs", "check the driver and that the GPUs are not hidden")
    by_index = {g.index: g for g in gpus}
    models = sorted({f"{g.name} {g.memory_total_mib // 1024} GiB" for g in gpus})
    detail = f"{len(gpus)} × {', '.join(models)}, driver {gpus[0].driver_version}" + (
        f" (CUDA ≤ {driver_cuda})" if driver_cuda else ""
    )
    missing = [i for i in wanted if i not in by_index]
    if missing:
        return fail(
            "nvidia-smi",
            detail + f"; the job wants GPU ids {list(wanted)}, but {missing} do not exist",
            "lower slots= in the hostfile or pick existing ids with --include HOST:ID,ID",
        )
    ecc = [g.index for g in gpus if g.index in wanted and (g.ecc_uncorrected or 0) > 0]
    if ecc:
        return fail(
            "nvidia-smi",
            detail + f"; uncorrected ECC errors on GPU {ecc}",
            "leave those GPUs out (--exclude HOST:ID) and reset them (nvidia-smi -r) or have them replaced",
        )
    busy = [
        f"{g.index} ({g.memory_used_mib} MiB used)"
        for g in gpus
        if g.index in wanted and g.memory_used_mib > GPU_BUSY_MIB
    ]
    if busy:
        return warn(
            "nvidia-smi",
            detail + f"; GPU {', '.join(busy)} already in use",
            "stop what runs there (nvidia-smi shows the processes) or exclude those GPUs",
        )
    return ok("nvidia-smi", detail)


def cuda_driver_check(image_cuda: str | None, driver_cuda: str | None, driver: str | None) -> Check | None:
    """Pure: can this driver run the image's CUDA? None when there is nothing to compare."""
    if driver_cuda is None:
        return None
    if not image_cuda:
        return warn(
            "cuda-driver",
            f"the image has no dzctl.cuda label; driver {driver} supports CUDA ≤ {driver_cuda}",
            "build the image with dzctl build, which labels it with its CUDA version",
        )
    if image_cuda == "cpu":
        return fail(
            "cuda-driver",
            "the image is a CPU build (dzctl.cuda=cpu) but the job asks for GPUs",
            "use a CUDA image (dzctl build --flavour cuda) or set accelerator: cpu",
        )
    verdict = p.cuda_compatibility(image_cuda, driver_cuda)
    detail = f"image CUDA {image_cuda}, driver {driver} supports CUDA ≤ {driver_cuda}"
    if verdict == "ok":
        return ok("cuda-driver", detail)
    if verdict == "minor":
        return warn(
            "cuda-driver",
            detail + ": runs through CUDA minor-version compatibility (no PTX JIT of newer code)",
            "upgrade the driver, or build the image on a CUDA base no newer than the driver",
        )
    return fail(
        "cuda-driver",
        detail + ": this driver cannot run it",
        f"upgrade the NVIDIA driver to one supporting CUDA {image_cuda}, or build on an older CUDA base image",
    )


def gpu_stack_check(labels: dict[str, str]) -> Check | None:
    """Pure: can the image's GPU stack (its dzctl.* labels from the build's probe) train on GPUs?

    None for images built before these labels existed, and for CPU images (cuda_driver_check
    already refuses those for GPU jobs).
    """
    cuda, nccl = labels.get("dzctl.cuda"), labels.get("dzctl.nccl")
    if not cuda or cuda == "cpu" or nccl is None:
        return None
    if nccl == "none":
        return fail(
            "gpu-stack",
            f"the image's torch ({labels.get('dzctl.torch')}) has no NCCL: multi-GPU training cannot communicate",
            "rebuild the image with dzctl build --flavour cuda",
        )
    prebuilt, nvcc = labels.get("dzctl.deepspeed-ops-prebuilt"), labels.get("dzctl.nvcc")
    detail = f"torch {labels.get('dzctl.torch')}, NCCL {nccl}, cuDNN {labels.get('dzctl.cudnn', '?')}"
    if prebuilt == "none" and nvcc == "none":
        return warn(
            "gpu-stack",
            detail + "; DeepSpeed's ops are not prebuilt and the image has no nvcc to JIT its CUDA ops "
            "(deepspeed-ops says whether the ops this plan loads can be built)",
            "build on a CUDA devel base (dzctl build --flavour cuda with its default base) to prebuild them",
        )
    return ok("gpu-stack", detail + f"; DeepSpeed ops prebuilt: {prebuilt or '?'}")


def safe(name: str, fn, *args) -> list[Check]:
    """Run one check function; a dropped connection becomes that check's failure, not a crash."""
    try:
        out = fn(*args)
    except RemoteError as exc:
        return [fail(name, str(exc), exc.fix or "rerun; check the node")]
    if isinstance(out, Check):
        return [out]
    return list(out)
