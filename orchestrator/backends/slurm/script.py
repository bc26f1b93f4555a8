"""The sbatch script for a launch plan: pure text from plain values, printed by ``launch --slurm --dry-run``.

The plan is made before Slurm chooses the nodes, so it names them by rank
(``slurm-node-<rank>``) and its master address is a shell variable: inside the
allocation the script sets ``DZCTL_MASTER_ADDR`` to the first host of
``SLURM_JOB_NODELIST``, and ``srun --ntasks-per-node=1`` runs the script again
on every node (``--node``), where ``SLURM_NODEID`` picks that node's launcher
from the plan: node ranks follow Slurm's node ids, master = node 0's host.

Each node's launcher runs in the foreground under ``orchestrator.runtimes.process run``
(the Slurm step owns it), which keeps ``rank-<r>.json`` and ``rank-<r>.log`` in
the job directory, a path every node and the submit host share.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ...planning.launchplan import CONTAINER_JOB_DIR, LaunchPlan, NodePlan
from ...spec.hostfile import Node
from ...spec.job import JobSpec, parse_mount

MASTER_VAR = "DZCTL_MASTER_ADDR"
MASTER = "$" + MASTER_VAR  # what the plan carries as master address; the script expands it
IFNAME_VAR = "DZCTL_IFNAME"  # this node's NIC toward the master, as preflight found it in the allocation
NODE_NAME = "slurm-node-{rank}"  # the plan's name for a node Slurm has not chosen yet
BATCH_LOG = "slurm-%j.out"  # the batch step's own output (preflight report, srun's messages)
COMMENT = "dzctl:{job_id}"  # the Slurm job's comment: how squeue finds it before its id is known (jobid.py)


@dataclass(frozen=True)
class SlurmRequest:
    """What is asked of Slurm: the spec's ``slurm:`` section with the command line's options on top."""

    nodes: int = 1
    partition: str | None = None
    gpus_per_node: int | None = None
    time: str | None = None
    account: str | None = None
    container: str = "none"  # none | pyxis
    python: str = "python3"  # the dzctl Python the allocation's own steps run (same path on every node)


def planned_nodes(spec: JobSpec, request: SlurmRequest) -> list[Node]:
    """The nodes the plan is made for: ``request.nodes`` of them, each with the GPUs asked for (or 1 slot)."""
    slots = request.gpus_per_node if spec.accelerator == "gpu" and request.gpus_per_node else 1
    return [Node(NODE_NAME.format(rank=rank), tuple(range(slots))) for rank in range(request.nodes)]


def batch_script(plan: LaunchPlan, spec: JobSpec, request: SlurmRequest, *, script_path: str) -> str:
    """The whole sbatch script; ``script_path`` is where it is kept in the shared job directory."""
    job_dir = plan.nodes[0].job_dir
    directives = [
        ("--job-name", plan.job),
        ("--nodes", str(len(plan.nodes))),
        ("--ntasks-per-node", "1"),
        ("--output", f"{job_dir}/{BATCH_LOG}"),
        ("--comment", COMMENT.format(job_id=plan.job_id)),
    ]
    for option, value in (("--partition", request.partition), ("--account", request.account),
                          ("--time", request.time)):  # fmt: skip
        if value:
            directives.append((option, value))
    if spec.accelerator == "gpu":
        directives.append(("--gpus-per-node", str(plan.nodes[0].slots)))
    step = srun_argv(plan, spec, request, script_path)
    lines = [
        "#!/bin/bash",
        f"# dzctl job {plan.job_id}: written by `dzctl launch --slurm` from the same plan as an SSH launch.",
        *(directive(option, value) for option, value in directives),
        "",
        'if [ "${1:-}" = --node ]; then',
        "    # One task per node (srun below): SLURM_NODEID picks this node's launcher from the plan.",
        f'    export {MASTER_VAR}="$2"',
        *_interface_lines(plan, request),
        '    case "${SLURM_NODEID:?}" in',
        *(f"    {node.node_rank}) {node_line(plan, spec, node, request)} ;;" for node in plan.nodes),
        '    *) echo "dzctl: no launcher planned for node $SLURM_NODEID" >&2; exit 2 ;;',
        "    esac",
        "    exit $?  # not reached: exec replaced the shell (a failed exec ends it too)",
        "fi",
        "",
        "set -uo pipefail",
        "# The master: the allocation's first host, where node rank 0 (SLURM_NODEID 0) runs.",
        f'{MASTER_VAR}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f'echo "dzctl: job {plan.job_id} on $SLURM_JOB_NODELIST, master ${MASTER_VAR}"',
        *_preflight_lines(plan, request),
        "# One launcher per node; --kill-on-bad-exit: one node's failure ends the step on every node.",
        f'{shell_text(step)} "${MASTER_VAR}"',
        "code=$?",
        f'echo "dzctl: job {plan.job_id} ended with exit code $code"',
        'exit "$code"',
        "",
    ]
    return "\n".join(lines)


def directive(option: str, value: str) -> str:
    """One ``#SBATCH`` line. sbatch (not a shell) reads it: it splits at blanks, strips quotes and ends
    at an unquoted ``#``, so a value holding a blank, ``#`` or ``'`` is double-quoted. What it cannot
    carry at all was refused with the user's key named (``values.py``); it stops here as well."""
    if not value.isprintable() or '"' in value or "\\" in value:
        raise ValueError(f"{option} {value!r} cannot be written on an #SBATCH line")
    if any(ch in value for ch in " #'"):
        value = f'"{value}"'
    return f"#SBATCH {option}={value}"


def uses_preflight(request: SlurmRequest) -> bool:
    # The checks inspect the node's own runtime (docker, the Python env); a pyxis step's is the image's.
    return request.container != "pyxis"


def _interface_lines(plan: LaunchPlan, request: SlurmRequest) -> list[str]:
    if not uses_preflight(request):
        return []
    found = shlex.quote(f"{plan.nodes[0].job_dir}/interfaces")
    return [
        "    # The NIC preflight found toward the master on this node (SLURMD_NODENAME: Slurm's name for it).",
        f'    {IFNAME_VAR}="$(awk -v node="$SLURMD_NODENAME" \'$1 == node {{print $2}}\' {found})"',
    ]


def _preflight_lines(plan: LaunchPlan, request: SlurmRequest) -> list[str]:
    if not uses_preflight(request):
        return ["# No preflight: with pyxis the image is the node's runtime (enroot), which dzctl does not check."]
    argv = [request.python, "-m", "orchestrator.backends.slurm.inside", "preflight"]
    argv += ["--job-dir", plan.nodes[0].job_dir, "--slots", str(plan.nodes[0].slots)]
    master_file = shlex.quote(f"{plan.nodes[0].job_dir}/master_addr")
    return [
        "# Preflight on the allotted nodes (srun, one step per command), before any launcher starts.",
        f"{shell_text(argv)} || {{ echo 'dzctl: preflight failed: the job ends before training'; exit 1; }}",
        "# The master address preflight chose (node 0's, as every node reaches it), not the bare host name.",
        f'{MASTER_VAR}="$(cat {master_file})"',
    ]


def srun_argv(plan: LaunchPlan, spec: JobSpec, request: SlurmRequest, script_path: str) -> list[str]:
    argv = ["srun", f"--nodes={len(plan.nodes)}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if request.container == "pyxis":
        # pyxis/enroot: the step runs in the image; the job dir at /job (read-only, as with docker) and at
        # its own path (the rank records), the output dir and the spec's mounts at theirs.
        node = plan.nodes[0]
        mounts = [f"{node.job_dir}:{CONTAINER_JOB_DIR}:ro", f"{node.job_dir}:{node.job_dir}"]
        mounts += _output_mounts(spec, node)
        argv += [f"--container-image={spec.image}", f"--container-mounts={','.join(mounts)}"]
        argv += [f"--container-workdir={CONTAINER_JOB_DIR}", "--no-container-mount-home"]
    return [*argv, "bash", script_path, "--node"]


def _output_mounts(spec: JobSpec, node: NodePlan) -> list[str]:
    mounts = [f"{node.output_dir}:{node.output_dir}"]
    for mount in spec.launch.mounts:
        host_path, container_path, mode = parse_mount(mount)
        mounts.append(f"{host_path}:{container_path}:{mode}")
    if spec.zero.nvme_path:
        mounts.append(f"{spec.zero.nvme_path}:{spec.zero.nvme_path}")
    return mounts


def node_line(plan: LaunchPlan, spec: JobSpec, node: NodePlan, request: SlurmRequest) -> str:
    """The shell line that runs one node's launcher in the foreground of its Slurm task."""
    return "exec " + shell_text(node_argv(plan, spec, node, request))


def node_argv(plan: LaunchPlan, spec: JobSpec, node: NodePlan, request: SlurmRequest) -> list[str]:
    argv = list(node.argv)
    if request.container == "pyxis":
        # Inside the image: its Python runs the wrapper and the launcher, with the plan's environment.
        env = [f"--env={key}={value}" for key, value in node.env.items() if value != "***"]
        wrapper = ["python3", "-m", "orchestrator.runtimes.process", "run", "--job-dir", node.job_dir]
        wrapper += ["--rank", str(node.node_rank), *env]
        if plan.secret_env:
            wrapper += ["--env-file", f"{node.job_dir}/env"]
        return [*wrapper, "--", *node.command]
    if plan.runtime == "docker":
        # The container in the foreground (no --detach), removed at its end; the wrapper stops it by name.
        docker = [a for a in argv if a != "--detach"]
        docker.insert(2, "--rm")
        if spec.accelerator == "gpu":
            docker[docker.index("--gpus") + 1] = '"device=$CUDA_VISIBLE_DEVICES"'  # the GPUs Slurm allotted
        wrapper = [request.python, "-m", "orchestrator.runtimes.process", "run", "--job-dir", node.job_dir]
        wrapper += ["--rank", str(node.node_rank), "--container", node.container_name]
        return [*wrapper, "--", *docker]
    # runtime: process: the plan's own wrapper, in the foreground; Slurm's CUDA_VISIBLE_DEVICES stays.
    argv[argv.index("start")] = "run"
    if spec.accelerator == "gpu":
        at = argv.index(next(a for a in argv if a.startswith("CUDA_VISIBLE_DEVICES=")))
        del argv[at - 1 : at + 1]
    return argv


def shell_text(argv: list[str]) -> str:
    """``shlex.join``, except that the master address and Slurm's GPU list expand in the shell."""
    text = shlex.join(argv)
    # shlex single-quotes any word with "$" in it: close the quote around the variable.
    for var in (MASTER_VAR, IFNAME_VAR, "CUDA_VISIBLE_DEVICES"):
        text = text.replace("$" + var, f"'\"${var}\"'")
    return text
