"""The launch plan: a pure value computed from a job and its nodes.

No network, no docker, no files are touched here (TorchX's ``submit_dryrun``
idea): ``dzctl launch --dry-run`` prints this value, and the launcher applies
exactly this value. Tests compare whole plans.

Per node: one launcher (torchrun, or ``deepspeed --no_ssh``) that starts that
node's ranks; no sshd or pdsh inside containers. Secrets never appear here:
they go to a 0600 env file on each node, and the plan shows ``***``.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field

from ..spec.hostfile import Node
from ..spec.job import JobSpec, is_secret_name, parse_mount

CONTAINER_JOB_DIR = "/job"  # the job directory, mounted read-only in every container
# The 64 MiB stack NVIDIA's PyTorch containers recommend.
STACK_ULIMIT = ("--ulimit", "stack=67108864")
# Unlimited locked memory: NCCL/IB register (pin) buffers with ibv_reg_mr and fail
# with "ibv_reg_mr failed" under Docker's 64 KiB default. GPU jobs only: gloo on
# CPU pins nothing, and a daemon that may not raise memlock (a locked-down host,
# these test machines) could not start the container at all.
MEMLOCK_ULIMIT = ("--ulimit", "memlock=-1")


def docker_ulimits(spec: JobSpec) -> tuple[str, ...]:
    return (*MEMLOCK_ULIMIT, *STACK_ULIMIT) if spec.accelerator == "gpu" else STACK_ULIMIT


MASK = "***"


@dataclass(frozen=True)
class NodePlan:
    host: str
    node_rank: int
    slots: int  # processes on this node
    gpus: tuple[int, ...]  # host GPU ids this node's container sees (empty for CPU jobs)
    job_dir: str  # <remote_dir>/jobs/<job_id> on the node
    output_dir: str
    container_name: str | None  # docker runtime only
    env: dict[str, str]  # what the ranks see; secret values shown as ***
    command: tuple[str, ...]  # the launcher, as run inside the container (or on the host)
    argv: tuple[str, ...]  # what dzctl runs on the host: `docker run ...` or the process wrapper


@dataclass(frozen=True)
class LaunchPlan:
    job: str
    job_id: str
    runtime: str
    image: str | None
    accelerator: str
    world_size: int
    master_addr: str
    master_port: int
    nodes: tuple[NodePlan, ...]
    secret_env: tuple[str, ...] = field(default=())  # names only; values live in the env file

    def to_dict(self) -> dict:
        return asdict(self)


def make_plan(
    spec: JobSpec,
    nodes: list[Node],
    job_id: str,
    *,
    secret_names: tuple[str, ...] = (),
    master_addr: str | None = None,
    interfaces: dict[str, str] | None = None,
    infiniband_hosts: frozenset[str] = frozenset(),
    entry: tuple[str, ...] = (),
    predicted_step_s: float | None = None,
) -> LaunchPlan:
    """Plan a job on ``nodes`` (in rank order).

    ``secret_names``: names defined in ``launch.env_file`` (their values are not
    needed here). ``master_addr`` / ``interfaces``: what preflight found (the
    address rank 0 is reached at, each node's NIC toward it); without them the
    first node's name is the master, as written in the hostfile.
    ``infiniband_hosts``: nodes where preflight found IB verbs devices; their
    containers get ``/dev/infiniband`` so NCCL can use IB/RoCE instead of TCP.
    ``entry``: another module (and its arguments) for the launcher to run instead of the
    trainer, with everything else unchanged (the collective check uses this).
    ``predicted_step_s``: the step-time model's optimizer step, when it predicted one: the trainer
    sets its process group's timeout in training from it (train/hang/timeout.py).
    """
    interfaces = interfaces or {}
    master = master_addr or (spec.launch.master_addr if spec.launch.master_addr != "auto" else nodes[0].host)
    secrets = tuple(sorted({*secret_names, *(n for n in spec.launch.env if is_secret_name(n))}))
    planned = tuple(
        _plan_node(
            spec,
            node,
            rank,
            len(nodes),
            job_id,
            master,
            secrets,
            interfaces.get(node.host),
            node.host in infiniband_hosts,
            entry,
            predicted_step_s,
        )
        for rank, node in enumerate(nodes)
    )
    return LaunchPlan(
        job=spec.name,
        job_id=job_id,
        runtime=spec.runtime,
        image=spec.image if spec.runtime == "docker" else None,
        accelerator=spec.accelerator,
        world_size=sum(n.num_slots for n in nodes),
        master_addr=master,
        master_port=spec.launch.master_port,
        nodes=planned,
        secret_env=secrets,
    )


def remote_dir_for(spec: JobSpec, host: str) -> str:
    return spec.launch.remote_dir.replace("{host}", host)


def output_dir_for(spec: JobSpec, host: str) -> str:
    if spec.train.output_dir:
        return spec.train.output_dir.replace("{host}", host)
    # Keyed by job name, not job id: a relaunch finds the checkpoints to resume.
    return f"{remote_dir_for(spec, host)}/output/{spec.name}"


def _plan_node(
    spec: JobSpec,
    node: Node,
    rank: int,
    num_nodes: int,
    job_id: str,
    master: str,
    secrets: tuple[str, ...],
    interface: str | None,
    infiniband: bool,
    entry: tuple[str, ...] = (),
    predicted_step_s: float | None = None,
) -> NodePlan:
    job_dir = f"{remote_dir_for(spec, node.host)}/jobs/{job_id}"
    output_dir = output_dir_for(spec, node.host)
    gpus = node.slots if spec.accelerator == "gpu" else ()
    visible_env = _node_env(spec, job_id, rank, num_nodes, interface, predicted_step_s)
    shown_env = {**visible_env, **dict.fromkeys(secrets, MASK)}
    if spec.runtime == "docker":
        command = _launcher(
            spec, num_nodes, rank, node.num_slots, master, f"{CONTAINER_JOB_DIR}/job.yaml", "docker", entry
        )
        name = container_name(job_id, rank)
        argv = _docker_run(
            spec, job_id, rank, name, gpus, job_dir, output_dir, visible_env, bool(secrets), command, infiniband,
            data_cache_dir=spec.data.cache_dir.replace("{host}", node.host) if spec.data.cache_dir else None,
        )  # fmt: skip
    else:
        command = _launcher(spec, num_nodes, rank, node.num_slots, master, f"{job_dir}/job.yaml", "process", entry)
        name = None
        if spec.accelerator == "gpu":
            # No container to confine the GPUs: CUDA_VISIBLE_DEVICES does it.
            visible_env = dict(sorted({**visible_env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}.items()))
            shown_env = {**shown_env, "CUDA_VISIBLE_DEVICES": visible_env["CUDA_VISIBLE_DEVICES"]}
        argv = _process_run(spec, rank, job_dir, visible_env, bool(secrets), command)
    return NodePlan(
        host=node.host,
        node_rank=rank,
        slots=node.num_slots,
        gpus=gpus,
        job_dir=job_dir,
        output_dir=output_dir,
        container_name=name,
        env=dict(sorted(shown_env.items())),
        command=command,
        argv=argv,
    )


def container_name(job_id: str, rank: int) -> str:
    """Deterministic, so a relaunch or ``stop`` finds the container by name as well as by label."""
    return f"dzctl-{job_id}-{rank}"


def _node_env(
    spec: JobSpec, job_id: str, rank: int, num_nodes: int, interface: str | None, predicted_step_s: float | None
) -> dict[str, str]:
    env = {k: v for k, v in spec.launch.env.items() if not is_secret_name(k)}
    env.update(
        DZCTL_JOB=spec.name,
        DZCTL_JOB_ID=job_id,
        DZCTL_NODE_RANK=str(rank),
        # The trainers' gang watchdog (orchestrator/train/gang.py) watches this many nodes.
        DZCTL_NUM_NODES=str(num_nodes),
        # Unbuffered output, so `dzctl logs --follow` shows lines as they happen.
        PYTHONUNBUFFERED="1",
    )
    if predicted_step_s:
        # The process group's timeout in training: max(5 min, 20 x this) with the default stall bounds.
        env["DZCTL_PREDICTED_STEP_S"] = f"{predicted_step_s:.3f}"
    if spec.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    else:
        # A failed or stuck collective raises instead of hanging for NCCL's 30-minute default.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    if interface:
        # The NIC that routes to the master: without it NCCL/gloo may pick docker0
        # or a loopback-resolving hostname and hang in socketStartConnect.
        env["NCCL_SOCKET_IFNAME"] = interface
        env["GLOO_SOCKET_IFNAME"] = interface
    return dict(sorted(env.items()))


def _launcher(
    spec: JobSpec,
    num_nodes: int,
    rank: int,
    slots: int,
    master: str,
    job_file: str,
    runtime: str,
    entry: tuple[str, ...] = (),
) -> tuple[str, ...]:
    module = entry or ("orchestrator.train", job_file)
    if spec.launch.launcher == "deepspeed":
        head = ("deepspeed",) if runtime == "docker" else (spec.launch.python, "-m", "deepspeed.launcher.runner")
        return (
            *head,
            # --no_ssh: DeepSpeed starts only this node's ranks; it never ssh-es to the others.
            "--no_ssh",
            "--num_nodes",
            str(num_nodes),
            "--node_rank",
            str(rank),
            "--num_gpus",
            str(slots),
            "--master_addr",
            master,
            "--master_port",
            str(spec.launch.master_port),
            "--module",
            *module,
        )
    head = ("torchrun",) if runtime == "docker" else (spec.launch.python, "-m", "torch.distributed.run")
    return (
        *head,
        "--nnodes",
        str(num_nodes),
        "--node_rank",
        str(rank),
        "--nproc_per_node",
        str(slots),
        "--master_addr",
        master,
        "--master_port",
        str(spec.launch.master_port),
        "-m",
        *module,
    )


def _docker_run(
    spec: JobSpec,
    job_id: str,
    rank: int,
    name: str,
    gpus: tuple[int, ...],
    job_dir: str,
    output_dir: str,
    env: dict[str, str],
    has_secrets: bool,
    command: tuple[str, ...],
    infiniband: bool = False,
    data_cache_dir: str | None = None,
) -> tuple[str, ...]:
    argv = ["docker", "run", "--detach", "--name", name]
    argv += ["--label", f"dzctl.job={spec.name}", "--label", f"dzctl.job-id={job_id}"]
    argv += ["--label", f"dzctl.node-rank={rank}"]
    # Host networking: NCCL needs the real NICs (and IB); bridge NAT breaks rendezvous.
    # Host IPC: NCCL's shared-memory transport needs more than Docker's 64 MiB /dev/shm.
    argv += ["--network", "host", "--ipc", "host", *docker_ulimits(spec)]
    # An init as PID 1: it reaps zombies, forwards signals, and lets a rank end its
    # node by killing the launcher (PID 1 itself cannot be killed from inside).
    argv.append("--init")
    if gpus:
        # The inner quotes are part of the value: docker parses --gpus as CSV, and
        # the comma between device ids must not split it.
        argv += ["--gpus", '"device=' + ",".join(map(str, gpus)) + '"']
    if infiniband:
        # The verbs devices, not --privileged: NCCL's IB transport needs only these
        # (plus the unlimited memlock above) to register memory with the HCA.
        argv += ["--device", "/dev/infiniband"]
    if has_secrets:
        argv += ["--env-file", f"{job_dir}/env"]
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]
    argv += ["--volume", f"{job_dir}:{CONTAINER_JOB_DIR}:ro", "--volume", f"{output_dir}:{output_dir}:rw"]
    for mount in spec.launch.mounts:
        host_path, container_path, mode = parse_mount(mount)
        argv += ["--volume", f"{host_path}:{container_path}:{mode}"]
    if data_cache_dir:
        # data.cache_dir: the node's tokenized data, written by its builder (train/data/cache.py).
        argv += ["--volume", f"{data_cache_dir}:{data_cache_dir}:rw"]
    if spec.zero.nvme_path:
        # ZeRO-Infinity swaps to the node's disk: the same path inside, as the DeepSpeed config names it.
        argv += ["--volume", f"{spec.zero.nvme_path}:{spec.zero.nvme_path}:rw"]
    argv += ["--workdir", CONTAINER_JOB_DIR, spec.image, *command]
    return tuple(argv)


def _process_run(
    spec: JobSpec,
    rank: int,
    job_dir: str,
    env: dict[str, str],
    has_secrets: bool,
    command: tuple[str, ...],
) -> tuple[str, ...]:
    # orchestrator.runtimes.process detaches the launcher, sets its environment (reading
    # secrets from the 0600 file, so they never sit in argv), and records its
    # pid, log and exit code in the job directory for status/logs/stop.
    argv = [
        spec.launch.python,
        "-m",
        "orchestrator.runtimes.process",
        "start",
        "--job-dir",
        job_dir,
        "--rank",
        str(rank),
    ]
    if has_secrets:
        argv += ["--env-file", f"{job_dir}/env"]
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]
    return (*argv, "--", *command)


def shell_line(argv: tuple[str, ...] | list[str]) -> str:
    """How an argv reads in a POSIX shell: every value quoted."""
    return shlex.join(argv)
