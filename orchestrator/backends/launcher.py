"""The launch sequence as a library: ``prepare`` (check and plan), then ``execute`` (through a backend).

    prepared = prepare(job, nodes, pool, LaunchOptions())   # local inputs, preflight, memory plan, collective, plan
    started = execute(prepared, SshFleet(pool, store))      # record, upload, start one launcher per node

``prepare`` resolves the job once: ``prepared.job`` is a ``ResolvedJob`` (planning/resolve.py)
with every ``auto`` decided, and the job files, the record and the backends read only that.

Nothing here prints or exits: progress goes to a ``Progress`` sink (the CLI's
renders it on stderr; the default is silent), failures are the project's
errors (``errors.py``), results are plain values. ``dzctl launch`` only parses
options, calls these and renders what they return; a test, a notebook or
another backend calls them the same way (TorchX's ``dryrun`` / ``schedule``).
"""

from __future__ import annotations

import contextlib
import secrets as pysecrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import RuntimeFailure, SpecError
from ..planning.dsconfig import BF16_MIN_COMPUTE_CAPABILITY, bf16_supported_by
from ..planning.inputs import JobInputs, job_secrets, read_inputs
from ..planning.launchplan import LaunchPlan, make_plan
from ..planning.memory.fromjob import SpeedInputs, check_global_batch, nvme_reading, plan_for_job
from ..planning.memory.refusal import nodes_description, require_fit
from ..planning.memory.search import MemoryPlan
from ..planning.resolve import ResolvedJob, resolve_job
from ..planning.speed.atlaunch import measured_links_note, predicted_step_line, speed_inputs_at_launch, speed_notes
from ..planning.speed.calibration import CalibrationInput, choice_source_line, kind_of
from ..planning.speed.spacing import work_lost_per_fault
from ..spec.hostfile import Node
from ..spec.job import LoadedJob
from ..transport.openssh import client_from_env
from ..transport.pool import HostPool
from .calibrationfile import calibration_input
from .jobfiles import JobFile, job_files, node_spec
from .start import Phases, Started, probe_output_storage

if TYPE_CHECKING:
    from .slurm.script import SlurmRequest


class Progress(Protocol):
    """Where the sequence says what it does; the CLI draws it, a library caller may ignore it."""

    def note(self, text: str) -> None: ...

    def preflight(self, report, *, final: bool) -> None:
        """A preflight report: after the checks (``final=False``), and once more if a later stage failed."""

    def busy(self, what: str) -> contextlib.AbstractContextManager: ...


class Silent:
    """The default sink: says nothing."""

    def note(self, text: str) -> None:
        pass

    def preflight(self, report, *, final: bool) -> None:
        pass

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class LaunchOptions:
    replace: bool = False  # stop a running job of the same name first
    distribute: bool = True  # ship the image to nodes that lack it (docker runtime), then check again
    skip_collective: bool = False
    collective_timeout_s: float = 60.0
    ssh_config: str | None = None  # recorded with the job, for status/logs/stop
    # Plan with `dzctl tune`'s measured choice where one holds ($DZCTL_HOME/calibration.json); tune's own
    # runs do not, so that they measure the model's candidates.
    use_calibration: bool = True


@dataclass
class Prepared:
    """Everything ``execute`` needs, checked: the resolved job, each node's files, what preflight measured."""

    job: ResolvedJob
    files: dict[int, list[JobFile]]  # by node rank
    spec_record: dict  # the secret-free resolved spec kept in the job record
    preflight: object  # the PreflightReport (None for Slurm: preflight runs inside the allocation)
    options: LaunchOptions
    phases: Phases = field(default_factory=Phases)
    started_at: float = field(default_factory=time.monotonic)
    batch_script: str | None = None  # Slurm: the sbatch script made from this plan

    @property
    def plan(self) -> LaunchPlan:
        return self.job.plan


def prepared_from(job: ResolvedJob, files_for: list, **rest) -> Prepared:
    """The files of each node in ``files_for`` and the record's spec, all made from the one resolved job."""
    files = {n.node_rank: job_files(job, n) for n in files_for}
    return Prepared(job=job, files=files, spec_record=node_spec(job, job.plan.nodes[0]), **rest)


class Backend(Protocol):
    """Where a prepared job runs: the SSH fleet (``fleet.SshFleet``); Slurm submits its own way."""

    def start(self, prepared: Prepared, progress: Progress) -> Started: ...


def new_job_id(name: str, now: float | None = None) -> str:
    """``<name>-<UTC time>-<4 hex>``: sortable by start time, unique across controllers."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{name}-{stamp}-{pysecrets.token_hex(2)}"


@dataclass(frozen=True)
class DryRun:
    """What ``launch --dry-run`` shows: the launch plan, and the memory plan with its DeepSpeed config."""

    plan: LaunchPlan
    memory: MemoryPlan
    ds_config: dict
    inputs: JobInputs

    def to_dict(self) -> dict:
        # The launch plan's keys stay on top (DESIGN §2); the memory plan is `dzctl plan --json`'s object.
        return {**self.plan.to_dict(), "memory": self.memory.to_dict(self.ds_config),
                "checkpoint_spacing": self.checkpoint_spacing()}  # fmt: skip

    def checkpoint_spacing(self) -> dict:
        """The work a fault loses: before the run, the step time is unknown (NVMe's disk floor aside)."""
        train = self.inputs.spec.train
        return work_lost_per_fault(train.save_steps, train.save_minutes, self.memory.nvme_step_s)


def dry_run(
    job: LoadedJob,
    nodes: list[Node],
    job_id: str | None = None,
    *,
    gpu_mem_gib: float | None = None,
    host_mem_gib: float | None = None,
    gpu_name: str | None = None,
) -> DryRun:
    """Every check the launch makes before it touches a host, and the plan it would run (``launch --dry-run``).

    The same local inputs (``read_inputs``: spec, data, ``zero.config``, model shape) and
    the same memory plan and refusal as ``prepare``, on the hardware given here where
    ``prepare`` has preflight's readings: a job the launch refuses, the dry run refuses. ``gpu_name``: the
    nodes' GPUs where known (this machine's for a localhost hostfile), for a ``dzctl tune`` calibration.
    """
    inputs = read_inputs(job)
    calibration = calibration_input(kind_of(job.spec.accelerator, gpu_name))
    memory, ds_config = memory_choice(inputs, nodes, gpu_mem_gib, host_mem_gib, calibration=calibration)
    plan = make_plan(
        job.spec,
        nodes,
        job_id or new_job_id(job.spec.name),
        secret_names=inputs.secret_names,
        predicted_step_s=predicted_optimizer_step_s(memory),
    )
    return DryRun(plan, memory, ds_config, inputs)


def predicted_optimizer_step_s(memory: MemoryPlan) -> float | None:
    """The step-time model's optimizer step for the chosen settings; None when it predicted none."""
    step = getattr(memory.speed, "step", None)
    return step.optimizer_step_s if step is not None else None


def memory_choice(
    inputs: JobInputs,
    nodes: list[Node],
    gpu_mem_gib,
    host_mem_gib,
    compute_capability: float | None = None,
    nvme: dict[str, dict] | None = None,
    progress: Progress | None = None,
    speed: SpeedInputs | None = None,
    calibration: CalibrationInput | None = None,
) -> tuple[MemoryPlan, dict]:
    """The planner's configuration for these nodes and its DeepSpeed config, or DoesNotFit with the numbers.

    ``compute_capability`` (the lowest preflight found) decides ``precision: auto``:
    bf16 from Ampere on, fp16 before. A job that insists on bf16 there is refused
    here, before anything starts, rather than by every rank after loading the model.
    ``speed`` (the GPU kind and the measured links): the step-time model also chooses ZeRO's settings.
    """
    bf16 = bf16_supported_by(compute_capability)
    slots = [n.num_slots for n in nodes]
    job = inputs.job
    plan, ds_config = plan_for_job(
        inputs,
        slots,
        gpu_mem_gib=gpu_mem_gib,
        host_mem_gib=host_mem_gib,
        bf16_supported=bf16,
        # Only nodes where preflight found zero.nvme_path usable report it; all must.
        nvme=nvme_reading(nvme) if nvme and len(nvme) == len(nodes) else None,
        speed=speed,
        calibration=calibration,
    )
    if plan.nvme_step_s is not None and progress is not None:
        progress.note(
            f"offload to NVMe: about {plan.nvme_step_s:.1f} s of disk I/O per optimizer step (preflight's bandwidth)"
        )
    if not bf16 and plan.precision == "bf16":  # auto would have become fp16: the job forces bf16
        raise SpecError(
            f"{job.where('train.precision')}: the job asks for bf16, but the nodes' GPUs have compute "
            f"capability {compute_capability:g} and bf16 needs {BF16_MIN_COMPUTE_CAPABILITY:g} or newer "
            "(Ampere, Hopper)",
            fix="set train.precision: auto (fp16 on these GPUs), or remove bf16 from zero.config/zero.overrides",
        )
    require_fit(plan, nodes_description(slots, plan.hardware.gpu_mem_gib, host_mem_gib))
    return plan, ds_config


def prepare(
    job: LoadedJob,
    nodes: list[Node],
    pool: HostPool,
    options: LaunchOptions | None = None,
    progress: Progress | None = None,
    *,
    job_id: str | None = None,
) -> Prepared:
    """Check every node and plan the job on them; nothing is started, nothing recorded.

    The job's local inputs (read once: no host is touched when one is wrong), preflight
    (and, for the docker runtime, ship a missing image and check again),
    the memory plan from what the nodes have, the collective check across every
    rank, the launch plan with the master address and interfaces preflight found,
    the output storage probe; then the resolved job and each node's files made from it.
    Raises ``InputError`` for bad input (no host touched), ``RuntimeFailure`` when
    a node fails a check (with the report handed to ``progress.preflight`` first).
    """
    from ..preflight import run_preflight
    from ..preflight.collective import collective_unless_skipped
    from ..preflight.loading.ops import require_ops

    options = options or LaunchOptions()
    progress = progress or Silent()
    inputs = read_inputs(job)  # input errors here: no host touched, no job recorded
    check_global_batch(inputs, [n.num_slots for n in nodes])  # a global batch these ranks cannot split
    ssh_client = client_from_env()  # DZCTL_SSH_CLIENT, read before any host is touched
    job_id = job_id or new_job_id(job.spec.name)
    phases = Phases()
    started_at = time.monotonic()
    with phases.timed("preflight"), progress.busy(f"preflight: checking {len(nodes)} node(s)"):
        report = run_preflight(job, nodes, pool, inputs=inputs)
    if job.spec.runtime == "docker" and options.distribute and only_the_image_missing(report):
        # The one failure launch repairs itself: ship the image, then check again.
        with phases.timed("distribute"):
            _distribute(job, nodes, pool, progress, ssh_client)
        with phases.timed("preflight"):
            report = run_preflight(job, nodes, pool, inputs=inputs)
    progress.preflight(report, final=False)
    require_preflight(report)
    # The probe container's start and imports: container time, not dzctl's own (see the benchmark).
    phases.seconds["preflight_container_probe"] = max(report.container_probe_s.values(), default=0.0)
    gpu_mem = _min_reading(report, "gpu_mem_gib")
    host_mem = _min_reading(report, "host_mem_gib")
    capability = _min_reading(report, "gpu_compute_capability")
    calibration = calibration_input(nodes_gpu_kind(job, report)) if options.use_calibration else None
    with phases.timed("memory_plan"):
        memory, ds_config = memory_choice(
            inputs, nodes, gpu_mem, host_mem, capability, report.nvme, progress, calibration=calibration
        )
    # zero.offload: auto is decided only now: the ops the chosen config loads must load on every node.
    require_ops(report, ds_config, job.spec.accelerator)
    # Last before the start, as the model would load: every rank of every node in one all-reduce.
    with phases.timed("collective"):
        collective_unless_skipped(
            job.spec,
            nodes,
            pool,
            report,
            skip=options.skip_collective,
            timeout_s=options.collective_timeout_s,
            job_id=job_id,
            ds_config=ds_config,
        )
    if not report.ok:
        progress.preflight(report, final=True)
        require_preflight(report)
    if job.spec.accelerator == "gpu":
        # The model's inputs are measured now: ZeRO's settings (hpZ, buckets) are chosen on them.
        speed, links_line = speed_inputs_at_launch(
            report.collective, report.gpu_name, len(nodes), report.host_optimizer
        )
        progress.note(links_line)
        if speed is not None:
            with phases.timed("speed_plan"):
                memory, ds_config = memory_choice(
                    inputs, nodes, gpu_mem, host_mem, capability, report.nvme, speed=speed, calibration=calibration
                )
            predicted = predicted_step_line(memory.speed)
            for line in ([predicted] if predicted else []) + speed_notes(memory.speed):
                progress.note(line)
    else:
        progress.note(measured_links_note(report.collective))
    if calibration is not None:
        progress.note(f"choice: {choice_source_line(memory)}")
    plan = make_plan(
        job.spec,
        nodes,
        job_id,
        secret_names=inputs.secret_names,
        master_addr=report.master_addr,
        interfaces=report.interfaces,
        infiniband_hosts=frozenset(h for h, devices in report.infiniband.items() if devices),
        predicted_step_s=predicted_optimizer_step_s(memory),
    )
    storage = job.spec.train.output_storage
    if storage == "auto":
        with phases.timed("storage_probe"):
            storage = probe_output_storage(plan, pool)
    resolved = resolve_job(inputs, nodes, memory, ds_config, plan, storage)
    return prepared_from(resolved, plan.nodes, preflight=report, options=options, phases=phases, started_at=started_at)


def execute(prepared: Prepared, backend: Backend, progress: Progress | None = None) -> Started:
    """Start the prepared job through ``backend``; returns once every node runs (or raises, nothing left)."""
    progress = progress or Silent()
    started = backend.start(prepared, progress)
    prepared.phases.seconds["total_to_running"] = round(time.monotonic() - prepared.started_at, 3)
    progress.note(f"started {started.job_id} on {len(started.hosts)} node(s): {', '.join(started.hosts)}")
    return started


def nodes_gpu_kind(job: LoadedJob, report) -> str | None:
    """The calibration's GPU kind of these nodes: "cpu", or the one GPU name preflight found (None: mixed)."""
    names = set((getattr(report, "gpu_name", None) or {}).values())
    return kind_of(job.spec.accelerator, names.pop() if len(names) == 1 else None)


def require_preflight(report) -> None:
    """The same checks as `dzctl preflight`; nothing starts unless every node passes."""
    if not report.ok:
        failed = sorted({host for host, _ in report.failures()})
        raise RuntimeFailure(
            f"preflight failed on {len(failed)} of {len(report.hosts)} node(s): {', '.join(failed)}; "
            "nothing was started",
            fix="apply the fixes listed above, then launch again",
        )


def _min_reading(report, name: str) -> float | None:
    values = getattr(report, name, None)
    if isinstance(values, dict):
        values = [v for v in values.values() if v is not None]
        return min(values) if values else None
    return values


def only_the_image_missing(report) -> bool:
    """Whether shipping the image is all that stands before the start. A node that fails anything else
    (its data or weights, its disk, its Docker) is refused first: minutes of image copying would not fix it."""
    failed = {check.name for _, check in report.failures()}
    return failed == {"image"}


def _distribute(job: LoadedJob, nodes: list[Node], pool: HostPool, progress: Progress, ssh_client: str) -> None:
    from ..image.distribute import distribute_image

    progress.note(f"distributing {job.spec.image} to the nodes that lack it")
    result = distribute_image(job.spec.image, nodes, pool, ssh_client=ssh_client)
    for note in result.notes:
        progress.note(note)
    for outcome in result.hosts.values():
        if outcome.ssh_client:  # a node that was sent the image: say how, as `dzctl distribute` does
            progress.note(
                f"{outcome.host}: image {outcome.status} through {outcome.ssh_client}"
                f" ({outcome.bytes_sent / 1e6:,.1f} MB)"
            )
    result.raise_on_failure()


# -- Slurm: the same plan, submitted with sbatch (orchestrator/backends/slurm) -------------------------------
def slurm_request(job: LoadedJob, **given) -> SlurmRequest:
    """The spec's ``slurm:`` section with the options given (None = not given) on top, each value
    checked as the spec's key is (exit 2 naming the option and its allowed form)."""
    import sys

    from .slurm.script import SlurmRequest
    from .slurm.values import checked_request_values

    chosen = checked_request_values(job, given)
    chosen.pop("gpu_mem_gib", None)
    # The allocation's own steps run dzctl's Python: by default the one submitting (a shared install).
    chosen["python"] = chosen.get("python") or sys.executable
    return SlurmRequest(**{k: v for k, v in chosen.items() if v is not None})


def slurm_plan(
    job: LoadedJob, request: SlurmRequest, job_id: str | None = None, *, secret_names: tuple[str, ...] | None = None
) -> tuple[LaunchPlan, str]:
    """The plan for the nodes Slurm will allot and its batch script; pure (``launch --slurm --dry-run``).

    ``secret_names``: those of the job's ``JobInputs`` when it was read already (else read here).
    """
    from .slurm.script import IFNAME_VAR, MASTER, batch_script, planned_nodes, uses_preflight
    from .slurm.values import check_job_paths

    check_job_paths(job)
    if secret_names is None:
        secret_names = tuple(job_secrets(job))
    nodes = planned_nodes(job.spec, request)
    # Each node's interface is what preflight finds inside the allocation: a variable the node expands.
    interfaces = {n.host: "$" + IFNAME_VAR for n in nodes} if uses_preflight(request) else None
    plan = make_plan(
        job.spec,
        nodes,
        job_id or new_job_id(job.spec.name),
        secret_names=secret_names,
        master_addr=MASTER,
        interfaces=interfaces,
    )
    return plan, batch_script(plan, job.spec, request, script_path=f"{plan.nodes[0].job_dir}/job.sbatch")


def prepare_slurm(job: LoadedJob, request: SlurmRequest, *, job_id: str | None = None) -> Prepared:
    """Plan the job for a Slurm allocation: the memory plan, the job files, the batch script; nothing submitted.

    The nodes are not known yet, so the memory planner takes the GPU memory from
    ``slurm.gpu_mem_gib``; the checks that need the nodes run inside the allocation.
    """
    inputs = read_inputs(job)
    plan, script = slurm_plan(job, request, job_id, secret_names=inputs.secret_names)
    nodes = planned_nodes_of(plan)
    gpu_mem = job.spec.slurm.gpu_mem_gib if job.spec.slurm else None
    if job.spec.accelerator == "gpu" and gpu_mem is None:
        raise SpecError(
            f"{job.where('slurm')}: slurm.gpu_mem_gib is not set: the memory planner needs each GPU's memory, "
            "and Slurm has not picked the nodes yet",
            fix="set slurm.gpu_mem_gib (e.g. 140 for H200, 80 for H100/A100-80GB), or --set slurm.gpu_mem_gib=N",
        )
    memory, ds_config = memory_choice(inputs, nodes, gpu_mem, None)
    # One job dir for all nodes (shared), so the output dir is one too: checkpoints are written once.
    resolved = resolve_job(inputs, nodes, memory, ds_config, plan, "shared")
    return prepared_from(resolved, plan.nodes[:1], preflight=None, options=LaunchOptions(), batch_script=script)


def planned_nodes_of(plan: LaunchPlan) -> list[Node]:
    return [Node(n.host, tuple(range(n.slots))) for n in plan.nodes]
