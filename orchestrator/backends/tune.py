"""``dzctl tune``'s side effects: run the planner's top candidates on one node, measure each, keep the fastest.

Each candidate is a real launch through the product (``launcher.prepare`` then ``execute`` through the SSH
fleet, or the local runner for localhost) of the job with ``--set`` overrides: its micro-batch and
checkpointed layers, a few steps, ``train.save=false`` and an output folder of its own under
``<launch.remote_dir>/tune/`` on the node (never the job's ``output/<name>``: no checkpoint of any run is
read or written). Its tokens/s is the median of rank 0's ``progress.jsonl`` step events after the warm-up,
as the benchmarks read a launch. A candidate that fails (does not fit, OOM, a crash, the time limit) is
recorded with its reason, the others still run, and nothing is left running. The fastest is written to
``$DZCTL_HOME/calibration.json`` (calibrationfile.py), which later plans use (planning/calibration.py).
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..errors import DzError, InputError
from ..observe.hosts import gather_status, progress_history, stop_nodes
from ..observe.store import FINAL_STATES, JobStore
from ..planning.memory.estimate import Choice
from ..planning.speed.calibration import DEFAULT_TOP, Calibration, Measured, fastest, key_for, tune_candidates
from ..spec.hostfile import Node
from ..spec.job import LoadedJob, load_job
from ..transport.pool import HostPool
from . import launcher
from .calibrationfile import write_record
from .fleet import SshFleet

POLL_S = 1.0  # how often a running candidate is asked for its state: its steps take seconds at least


@dataclass(frozen=True)
class TuneOptions:
    top: int = DEFAULT_TOP  # candidates measured, the model's choice first
    steps: int = 6  # optimizer steps each candidate runs
    warmup: int = 2  # steps left out of the median (the first steps compile, allocate and fill caches)
    timeout_s: float = 900.0  # one candidate's launch and steps; past it, it is stopped and recorded failed
    skip_collective: bool = False
    ssh_config: str | None = None
    dzctl_version: str = "unknown"
    commit: str | None = None


@dataclass
class TuneResult:
    """What a tune found: every candidate's measurement, and the record written (None: nothing to tune or
    nothing ran)."""

    job: str
    host: str
    kind: str | None
    num_layers: int
    measured: list[Measured] = field(default_factory=list)
    calibration: Calibration | None = None
    calibration_path: str | None = None
    nothing_to_tune: str | None = None  # why there was nothing to measure

    def to_dict(self) -> dict:
        fastest = self.calibration.fastest if self.calibration else None
        return {
            "job": self.job,
            "host": self.host,
            "kind": self.kind,
            "nothing_to_tune": self.nothing_to_tune,
            "candidates": [m.to_dict() for m in self.measured],
            "fastest": fastest.to_dict() if fastest else None,
            "key": self.calibration.key.text() if self.calibration else None,
            "calibration_file": self.calibration_path,
        }


def fixed_by_spec(job: LoadedJob) -> str | None:
    """Why the spec leaves nothing to measure (it fixes micro-batch and checkpointing), or None."""
    train = job.spec.train
    if train.micro_batch_size != "auto" and train.gradient_checkpointing != "auto":
        return (
            f"the job fixes train.micro_batch_size ({train.micro_batch_size}) and train.gradient_checkpointing "
            f"({str(train.gradient_checkpointing).lower()}): nothing to tune; set either to auto to measure "
            "the planner's candidates"
        )
    return None


def candidate_sets(choice: Choice, num_layers: int) -> list[str]:
    """The ``--set`` items that fix one candidate."""
    layers = choice.layers_checkpointed(num_layers)
    ckpt = "false" if layers == 0 else "true" if layers >= num_layers else str(layers)
    return [f"train.micro_batch_size={choice.micro_batch_size}", f"train.gradient_checkpointing={ckpt}"]


def run_sets(job: LoadedJob, node: Node, tune_id: str, label: str, steps: int) -> list[str]:
    """The ``--set`` items every candidate's launch gets: a few steps, no save, its own output folder."""
    base = f"{job.spec.launch.remote_dir}/tune/{tune_id}"
    return [
        f"name={job.spec.name}-tune",
        f"train.max_steps={steps}",
        "train.save=false",
        f"train.output_dir={base}/{label}",
        # one tokenized cache for all candidates: the rows are the same, only the batches differ
        f"data.cache_dir={base}/data-cache",
    ]


def median_tokens_per_s(events: list[dict], warmup: int) -> float | None:
    """The median useful tokens/s per rank over the step events after the warm-up (None: none after it)."""
    rates = [
        e["tokens_per_s"]
        for e in events
        if e.get("event") == "step" and e.get("step", 0) > warmup and isinstance(e.get("tokens_per_s"), (int, float))
    ]
    return round(statistics.median(rates), 1) if rates else None


def tune(
    job: LoadedJob,
    nodes: list[Node],
    pool: HostPool,
    options: TuneOptions,
    progress: launcher.Progress | None = None,
) -> TuneResult:
    """Measure the model's top candidates on the first node; write the fastest to the calibration."""
    progress = progress or launcher.Silent()
    node = nodes[0]
    if options.warmup >= options.steps:
        raise InputError(
            f"--warmup {options.warmup} leaves none of --steps {options.steps} to measure",
            fix="give more --steps than --warmup",
        )
    result = TuneResult(job=job.spec.name, host=node.host, kind=None, num_layers=0)
    why = fixed_by_spec(job)
    if why is not None:
        result.nothing_to_tune = why
        return result
    tune_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)
    # The model's plan on this node: its choice, its ranking, and preflight's GPU kind. It is also the first
    # candidate's launch: the model's choice runs as the plan made it.
    first = _job_with(job, run_sets(job, node, tune_id, "c1-model", options.steps))
    prepared = launcher.prepare(first, [node], pool, _launch_options(options, first=True), progress)
    memory = prepared.job.memory
    layers = memory.estimate.num_layers
    result.num_layers = layers
    result.kind = launcher.nodes_gpu_kind(job, prepared.preflight)
    candidates = tune_candidates(memory.ranked, memory.choice, options.top)
    if len(candidates) < 2:
        progress.note(f"only one candidate fits ({_words(memory.choice, layers)}): nothing to compare")
        result.nothing_to_tune = "only the model's choice fits these nodes: nothing to compare"
        candidates = candidates[:1]  # still measured: the calibration then says what it runs at

    launched: set[int] = set()

    def run_candidate(rank: int, choice: Choice) -> Measured:
        again = rank in launched  # the model's choice run once more, last (_first_again_if_beaten)
        launched.add(rank)
        if rank == 1 and not again:  # the model's choice: launched as the plan above made it
            return _launch_and_measure(prepared=prepared, pool=pool, options=options, progress=progress)
        label = f"c{rank}-micro{choice.micro_batch_size}-ckpt{choice.layers_checkpointed(layers)}"
        label += "-again" if again else ""
        sets = [*run_sets(job, node, tune_id, label, options.steps), *candidate_sets(choice, layers)]
        candidate = _job_with(job, sets)
        return _launch_and_measure(job=candidate, node=node, pool=pool, options=options, progress=progress, first=False)

    result.measured = measure_each(candidates, layers, run_candidate, progress)
    if any(m.tokens_per_s is not None for m in result.measured) and result.kind is not None:
        key = key_for(
            prepared.job.inputs.shape,
            kind=result.kind,
            seq_len=memory.seq_len,
            method=job.spec.train.method,
            precision=memory.calibration_precision,
            ranks_per_node=node.num_slots,
        )
        record = Calibration(
            key=key,
            measured=tuple(result.measured),
            measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
            steps=options.steps,
            warmup=options.warmup,
            dzctl_version=options.dzctl_version,
            commit=options.commit,
        )
        result.calibration = record
        result.calibration_path = str(write_record(record))
    return result


def measure_each(
    candidates: list[Choice],
    layers: int,
    run_candidate: Callable[[int, Choice], Measured],
    progress: launcher.Progress,
) -> list[Measured]:
    """Run every candidate in turn (rank 1: the model's choice). One that fails is recorded with its reason and
    the next still runs: a candidate that does not fit or crashes is an answer, not the end of the tune."""
    measured = []
    for rank, choice in enumerate(candidates, start=1):
        progress.note(f"tune: candidate {rank}/{len(candidates)}: {_words(choice, layers)}")
        try:
            outcome = _as_candidate(run_candidate(rank, choice), choice, layers, rank)
        except DzError as exc:  # it does not fit, a check failed, it crashed: recorded, the others go on
            outcome = Measured(
                choice.micro_batch_size, choice.layers_checkpointed(layers), choice.offload, rank, error=exc.message
            )
        progress.note(f"tune: candidate {rank}: " + _outcome(outcome))
        measured.append(outcome)
    return _first_again_if_beaten(measured, candidates, layers, run_candidate, progress)


def _first_again_if_beaten(
    measured: list[Measured],
    candidates: list[Choice],
    layers: int,
    run_candidate: Callable[[int, Choice], Measured],
    progress: launcher.Progress,
) -> list[Measured]:
    """The model's choice once more, last, where another candidate beat it; the faster of its two runs counts.

    It runs first, so it alone pays what a node's first launch does: the data cache built, kernels compiled
    for the first time, a node still freeing the memory of the job before. On one H100 it measured 10,074
    tokens/s as a tune's first launch, just after an offloaded DPO run, against 12,700 for the same plan
    launched alone (benchmarks/results/plans-h100x1-20261207b/tune-lora, plans-h100x1-20261207/lora-2),
    and lost to a candidate it beats.
    """
    first, best = measured[0], fastest(measured)
    if first.tokens_per_s is None or best is None or best.model_rank == 1:
        return measured
    progress.note(f"tune: candidate 1 again, last (another candidate was faster): {_words(candidates[0], layers)}")
    try:
        again = _as_candidate(run_candidate(1, candidates[0]), candidates[0], layers, 1)
    except DzError as exc:
        progress.note(f"tune: candidate 1 again: failed: {exc.message}")
        return measured
    progress.note("tune: candidate 1 again: " + _outcome(again))
    if again.tokens_per_s is not None and again.tokens_per_s > first.tokens_per_s:
        return [again, *measured[1:]]
    return measured


def _as_candidate(measured: Measured, choice: Choice, layers: int, rank: int) -> Measured:
    return Measured(
        choice.micro_batch_size,
        choice.layers_checkpointed(layers),
        choice.offload,
        rank,
        tokens_per_s=measured.tokens_per_s,
        error=measured.error,
        predicted_tokens_per_s=measured.predicted_tokens_per_s,
    )


def _words(choice: Choice, layers: int) -> str:
    return (
        f"micro-batch {choice.micro_batch_size}, checkpointing {choice.checkpointing_words(layers)}, "
        f"offload {choice.offload}"
    )


def _outcome(measured: Measured) -> str:
    if measured.tokens_per_s is not None:
        predicted = measured.predicted_tokens_per_s
        return f"{measured.tokens_per_s:,.1f} tokens/s per rank" + (
            f" (the model predicted {predicted:,.0f})" if predicted is not None else ""
        )
    return f"failed: {measured.error}"


def _job_with(job: LoadedJob, sets: list[str]) -> LoadedJob:
    """The job as the user gave it (their own ``--set`` items first), with these on top."""
    return load_job(job.path, [*job.overrides, *sets])


def _launch_options(options: TuneOptions, *, first: bool) -> launcher.LaunchOptions:
    return launcher.LaunchOptions(
        # the first launch checks the collective; the others run on the same node moments later
        skip_collective=options.skip_collective or not first,
        ssh_config=options.ssh_config,
        use_calibration=False,  # tune measures the model's candidates, not an earlier tune's choice
    )


def _launch_and_measure(
    *,
    pool: HostPool,
    options: TuneOptions,
    progress: launcher.Progress,
    prepared: launcher.Prepared | None = None,
    job: LoadedJob | None = None,
    node: Node | None = None,
    first: bool = True,
) -> Measured:
    """One real launch, followed until it ends (stopped past ``options.timeout_s``), and its median tokens/s."""
    deadline = time.monotonic() + options.timeout_s
    if prepared is None:
        prepared = launcher.prepare(job, [node], pool, _launch_options(options, first=first), progress)
    with JobStore() as store:
        started = launcher.execute(prepared, SshFleet(pool, store), progress)
        record = store.get(started.job_id)
        try:
            status = gather_status(record, pool)
            while status.state not in FINAL_STATES:
                if time.monotonic() > deadline:
                    _stop(record, pool, store, f"dzctl tune: past {options.timeout_s:g} s")
                    return Measured(0, 0, "none", 0, error=f"timed out after {options.timeout_s:g} s (stopped)")
                time.sleep(POLL_S)
                status = gather_status(record, pool)
        except BaseException:  # interrupted (Ctrl-C) or the node lost: nothing is left running
            _stop(record, pool, store, "dzctl tune: interrupted")
            raise
        store.set_state(record.job_id, status.state)
        if status.state != "succeeded":
            failure = status.first_failure or {}
            why = failure.get("reason") or f"exit code {failure.get('exit_code')}"
            return Measured(0, 0, "none", 0, error=f"job {record.job_id} {status.state}: {why}")
        rate = median_tokens_per_s(progress_history(record, pool), options.warmup)
        if rate is None:
            return Measured(0, 0, "none", 0, error=f"job {record.job_id}: no step after the {options.warmup} warm-up")
        return Measured(0, 0, "none", 0, tokens_per_s=rate, predicted_tokens_per_s=predicted_rate(prepared))


def predicted_rate(prepared: launcher.Prepared) -> float | None:
    """The step-time model's tokens/s per GPU for the plan this candidate launched with (None: not predicted,
    e.g. a CPU job or an unknown GPU kind): beside the measured rate, it shows the model's error per candidate."""
    step = getattr(prepared.job.memory.speed, "step", None)
    return round(step.tokens_per_s, 1) if step is not None else None


def _stop(record, pool: HostPool, store: JobStore, reason: str) -> None:
    try:
        stop_nodes(record, pool, remove=True)
    finally:
        store.set_state(record.job_id, "stopped", reason=reason)
