"""``dzctl plan``: predicted GPU and host memory of a job on some nodes, and the configuration auto chooses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console

from .. import __version__
from ..backends.calibrationfile import calibration_input
from ..errors import InputError, RuntimeFailure
from ..planning.inputs import read_inputs
from ..planning.memory.estimate import ALLOCATOR_MARGIN, GIB, HOST_RESERVE_FRACTION, NON_TORCH_GPU_GIB
from ..planning.memory.fromjob import SpeedInputs, plan_for_job
from ..planning.memory.refusal import nodes_description, require_fit
from ..planning.memory.search import MemoryPlan
from ..planning.shape import ModelShape
from ..planning.speed.calibration import DEFAULT_TOP, choice_source_line, kind_of
from ..planning.speed.communication import Links
from ..planning.speed.offload import ASSUMED_HOST, HostOptimizer
from ..planning.speed.steptime import GPU_KINDS
from ..planning.speed.steptime import gpu_kind as lookup_gpu_kind
from ..preflight.render import print_report
from ..spec.job import JobSpec
from ..transport.pool import HostPool
from .busy import busy
from .localhw import hardware_for
from .options import (
    hardware_options,
    hosts_options,
    job_options,
    json_option,
    load_job_from_options,
    nodes_from_options,
    ssh_options,
)

if TYPE_CHECKING:
    from ..backends.tune import TuneOptions, TuneResult


# -- the step-time part (issue 30): the flags the model needs when no host was measured, and its lines --
def speed_options(func):
    """``--gpu-kind``, ``--link-gbps``, ``--intra-gbps``, ``--host-adam-rate``: what the step-time model needs when
    no host was measured."""
    func = click.option(
        "--host-adam-rate",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="G_PER_S",
        help="Each node's AdamW rate on its CPU, billions of fp32 parameters a second with all its cores "
        "(launch measures it): times the step of an offloaded optimizer.",
    )(func)
    func = click.option(
        "--intra-gbps",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="GBIT_S",
        help="Bus bandwidth of a collective within a node, Gbit/s as nccl-tests reports it (default: the GPU kind's).",
    )(func)
    func = click.option(
        "--link-gbps",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="GBIT_S",
        help="Each node's network to the others, its NICs' rated Gbit/s summed (8 × 400 Gb/s = 3200).",
    )(func)
    return click.option(
        "--gpu-kind",
        default=None,
        metavar="KIND",
        help=f"The GPUs, for the predicted step time: {', '.join(GPU_KINDS)}.",
    )(func)


def speed_inputs(
    gpu_kind: str | None, link_gbps: float | None, intra_gbps: float | None, host_adam_rate: float | None = None
) -> SpeedInputs:
    """The step-time model's inputs from the flags; an unknown GPU kind is bad input (exit 2)."""
    kind = None
    if gpu_kind is not None:
        kind = lookup_gpu_kind(gpu_kind)
        if kind is None:
            raise InputError(f"--gpu-kind {gpu_kind}: not a known GPU kind", fix=f"use one of {', '.join(GPU_KINDS)}")
    if kind is None:
        return SpeedInputs(gpu=None, links=None)
    intra = intra_gbps * 1e9 / 8 if intra_gbps is not None else kind.intra_bytes_per_s
    where = [f"--link-gbps {link_gbps:g} (rated)" if link_gbps is not None else "inter-node not given"]
    where.append(f"--intra-gbps {intra_gbps:g}" if intra_gbps is not None else f"intra-node {kind.name} default")
    host = ASSUMED_HOST  # no node is measured here: the plan names the rate as assumed
    if host_adam_rate is not None:
        host = HostOptimizer(host_adam_rate * 1e9, None, f"--host-adam-rate {host_adam_rate:g}")
    return SpeedInputs(gpu=kind, links=Links.rated(link_gbps, intra, ", ".join(where)), host=host)


def speed_lines(plan: MemoryPlan) -> list[str]:
    """The predicted step: compute, communication, the bound, and the choices' notes."""
    speed = plan.speed
    if speed is None:
        return []
    lines = [""]
    step = speed.step
    if step is None:
        return lines + [f"note: {note}" for note in speed.notes]
    comm = step.comm
    calls = ", ".join(f"{c.calls} {c.name}s" for c in comm.collectives)
    lines += [
        f"step time (predicted; {speed.gpu}, MFU {speed.mfu:.1%} {speed.mfu_source}; links: {speed.links_source}):",
        f"  compute        {step.compute_s:8.3f} s for {step.tokens:,} tokens/GPU per micro-step",
        f"  communication  {step.comm_s:8.3f} s ({comm.bandwidth_s:.3f} s bandwidth, {comm.latency_s:.3f} s latency of "
        f"{comm.calls} collectives: {calls}); {comm.inter_bytes / 1e9:.2f} GB over each node's link",
    ]
    side = "communication"
    if step.offload_trips_s:
        lines.append(
            f"  gradient trips {step.offload_trips_s:8.3f} s to the host's optimizer and back, beside the compute "
            "with the collectives"
        )
        side = "communication + gradient trips"
    lines += [
        f"  micro-step     {step.step_s:8.3f} s = max(compute, {side}) + {step.exposed_s:.3f} s not overlapped",
        f"  optimizer step {step.optimizer_step_s:8.3f} s = {step.accumulation} micro-steps + {step.optimizer_s:.3f} s "
        "for the optimizer",
        f"  {step.tokens_per_s:,.0f} tokens/s/GPU, bound: {step.bound}",
    ]
    if speed.plain is not None and speed.hpz_partition_size > 1:
        lines.append(f"  plain ZeRO-3 would take {speed.plain.step_s:.3f} s per micro-step")
    lines += [f"note: {note}" for note in speed.notes]
    if speed.warning:
        lines.append(f"warning: {speed.warning}")
    return lines


@click.command("plan")
@job_options
@hosts_options
@hardware_options
@speed_options
@json_option
def plan_command(
    job_file,
    overrides,
    runtime,
    hostfile,
    include,
    exclude,
    num_nodes,
    num_gpus,
    gpu_mem_gib,
    host_mem_gib,
    gpu_kind,
    link_gbps,
    intra_gbps,
    host_adam_rate,
    as_json,
):
    """Predict per-GPU and per-node memory and choose micro-batch, checkpointing and offload.

    Exits 2 (after printing the plan) when nothing the job allows fits these nodes.
    """
    job = load_job_from_options(job_file, overrides, runtime)
    nodes = nodes_from_options(hostfile, include, exclude, num_nodes, num_gpus)
    inputs = read_inputs(job)
    shape = inputs.shape
    slots = [n.num_slots for n in nodes]
    hardware = hardware_for(nodes, gpu_mem_gib, host_mem_gib)
    host_mem_gib = hardware.host_mem_gib
    speed = speed_inputs(gpu_kind, link_gbps, intra_gbps, host_adam_rate)
    # `dzctl tune`'s records, read once here; the GPU kind is --gpu-kind's (a CPU job's is "cpu")
    calibration = calibration_input(kind_of(job.spec.accelerator, gpu_kind))
    plan, ds_config = plan_for_job(
        inputs,
        slots,
        gpu_mem_gib=hardware.gpu_mem_gib,
        host_mem_gib=host_mem_gib,
        speed=speed,
        calibration=calibration,
    )
    if as_json:
        out = plan.to_dict(ds_config)
        out["model"] = shape.to_dict()
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(render(plan, shape, job.spec))
    require_fit(plan, nodes_description(slots, plan.hardware.gpu_mem_gib, host_mem_gib))


def _loss_key_words(loss_path: str, train) -> str:
    """What of the job chose the loss: train.fused_loss, or (TRL's head) the preference stage."""
    if loss_path == "trl":
        return f"train.stage {train.stage}: train.fused_loss not used"
    return f"train.fused_loss: {train.fused_loss}"


_LOSS_TEXT = {
    "liger": "liger (fused linear cross-entropy and Liger's RMSNorm/SwiGLU/RoPE; no logits held)",
    "chunked": "chunked (cross-entropy over chunks of tokens, logits recomputed in the backward)",
    "none": "the model's own (full logits)",
    "trl": "TRL's own (its fused LM head: log-probs in tiles, no logits held; HF's modules, no Liger kernel)",
}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def _g(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def render(plan: MemoryPlan, shape: ModelShape, spec: JobSpec) -> str:
    est = plan.estimate
    c = est.choice
    hw = plan.hardware
    train = spec.train

    def how(value: object) -> str:
        return "auto" if value == "auto" else "set"

    cpu = plan.accelerator == "cpu"
    lines = [
        f"model {shape.name}: {_count(shape.total_params)} params, largest layer "
        f"{_count(shape.largest_layer_params)}, vocab {shape.vocab_size}, hidden {shape.hidden_size}, "
        f"{shape.num_layers} layers, {shape.num_heads} heads / {shape.num_kv_heads} KV",
        f"  shape from {shape.source}",
        f"nodes {nodes_description(hw.slots_per_node, hw.gpu_mem_gib, hw.host_mem_gib)}; "
        f"seq {plan.seq_len}, {plan.precision}"
        + (" (pure: bf16 master weights, gradients and Adam states)" if plan.estimate.pure_bf16 else ""),
        f"{'choice' if plan.fits else 'closest allowed setup'}: micro-batch {c.micro_batch_size} "
        f"({how(train.micro_batch_size)}), gradient checkpointing "
        f"{c.checkpointing_words(plan.estimate.num_layers)} ({how(train.gradient_checkpointing)}), offload {c.offload} "
        f"({how(spec.zero.offload)}); accumulation {plan.gradient_accumulation_steps} → global batch "
        f"{plan.train_batch_size}",
        *([f"  {choice_source_line(plan)}"] if plan.fits else []),
        global_batch_line(plan),
        f"loss: {_LOSS_TEXT[plan.fused_loss]} ({_loss_key_words(plan.fused_loss, train)})",
        f"ZeRO-3 fetch unit: {'each decoder layer' if plan.fetch_unit == 'layer' else 'each module'} "
        f"(zero.fetch_unit: {spec.zero.fetch_unit})",
    ]
    lines += _method_lines(plan)
    lines += [
        "",
        f"per {'rank (in host RAM: CPU ranks)' if cpu else 'GPU'}, peak allocated (during {est.peak_phase}):",
    ]
    lines += [f"  {name:40s}{_g(value)}" for name, value in est.gpu_terms.items()]
    lines.append(f"  {'total':40s}{_g(est.gpu_peak)}")
    have = f" of {hw.gpu_mem_gib} GiB" if hw.gpu_mem_gib is not None else ""
    if not cpu:
        lines.append(
            f"  + {ALLOCATOR_MARGIN:.0%} allocator margin + {NON_TORCH_GPU_GIB} GiB CUDA/NCCL = "
            f"{est.gpu_required / GIB:.2f} GiB needed{have}"
        )
    ranks = max(hw.slots_per_node)
    lines += ["", f"host RAM per node ({ranks} ranks; {HOST_RESERVE_FRACTION:.0%} of RAM left to the OS):"]
    if cpu:
        lines.append(f"  {'ranks (the terms above)':40s}{_g(est.gpu_peak * ranks)}")
    lines += [f"  {name:40s}{_g(value * ranks)}" for name, value in est.host_terms_per_rank.items()]
    lines += [f"  {name:40s}{_g(value)}" for name, value in hw.data_terms]  # once per node
    lines.append(f"  {'total':40s}{_g(max(plan.host_per_node))}")
    lines += _nvme_lines(plan)
    lines.append("")
    lines.append("fits" if plan.fits else f"does not fit: {plan.reason}")
    lines += [f"note: {note}" for note in plan.notes]
    lines += speed_lines(plan)
    return "\n".join(lines)


def global_batch_line(plan: MemoryPlan) -> str:
    """The global batch, and whether the spec fixes it or these GPUs' micro-batch decides it."""
    c = plan.choice
    rows = plan.train_batch_size
    split = (
        f"global batch {rows} rows ({rows * plan.seq_len:,} tokens at seq {plan.seq_len}) = micro-batch "
        f"{c.micro_batch_size} × accumulation {plan.gradient_accumulation_steps} × {plan.world_size} ranks"
    )
    if plan.global_batch_key is not None:
        return f"{split}, as {plan.global_batch_key} fixes it on any hardware"
    return (
        f"{split}: it depends on the hardware (other GPUs fit another micro-batch); "
        "set train.global_batch_size to keep it"
    )


def _method_lines(plan: MemoryPlan) -> list[str]:
    if plan.lora is None:
        return []
    return [
        f"method lora: r {plan.lora.r} on {', '.join(plan.lora.target_modules)}: "
        f"{_count(plan.estimate.trainable_params)} trainable params; the base stays frozen and partitioned"
    ]


def _nvme_lines(plan: MemoryPlan) -> list[str]:
    nvme = plan.to_dict(None)["nvme"]
    if nvme is None:
        return []
    ranks = max(plan.hardware.slots_per_node)
    lines = ["", f"NVMe per node at {nvme['path']} ({ranks} ranks):"]
    lines += [f"  {name:40s}{value * ranks:8.2f} GiB" for name, value in nvme["per_rank_gib"].items()]
    lines.append(f"  {'total':40s}{nvme['per_node_gib']:8.2f} GiB")
    io = f"  I/O per optimizer step: {nvme['read_gib_per_step_per_node']} GiB read, "
    io += f"{nvme['written_gib_per_step_per_node']} GiB written per node"
    if nvme["expected_io_s_per_step"] is not None:
        io += (
            f"; at the measured {nvme['read_mib_s']} MiB/s read, {nvme['write_mib_s']} MiB/s write: "
            f"about {nvme['expected_io_s_per_step']} s per step in disk I/O"
        )
    else:
        io += " (bandwidth not measured: dzctl launch's preflight measures it)"
    lines.append(io)
    return lines


# -- dzctl tune (issue 42): the planner's top candidates measured on one node; the fastest kept for later plans.
# Here rather than in a module of its own: tune is the measured side of the plan, and commands/ keeps at most
# 12 modules (tests/test_architecture.py).
class ConsoleProgress:
    """The launch sequence's progress on stderr: with --json, stdout holds exactly one object."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def note(self, text: str) -> None:
        click.echo(text, err=True)

    def preflight(self, report, *, final: bool) -> None:
        # The report is shown after the checks, except under --json where only a failure is.
        if final or not report.ok or not self.as_json:
            print_report(report, Console(stderr=True, highlight=False, soft_wrap=True))

    def busy(self, what: str):
        return busy(what)


def tune_options(func):
    """``--top``, ``--steps``, ``--warmup``, ``--timeout``: how much `tune` (and `launch --tune`) measures."""
    func = click.option(
        "--timeout",
        "tune_timeout",
        type=click.FloatRange(min=1),
        default=900.0,
        show_default=True,
        metavar="SECONDS",
        help="Most one candidate may take (its checks, start and steps); past it, it is stopped and marked failed.",
    )(func)
    func = click.option(
        "--warmup",
        type=click.IntRange(min=0),
        default=2,
        show_default=True,
        help="First steps left out of each candidate's median tokens/s.",
    )(func)
    func = click.option(
        "--steps", type=click.IntRange(min=1), default=6, show_default=True, help="Steps each candidate runs."
    )(func)
    return click.option(
        "--top",
        type=click.IntRange(min=1),
        default=DEFAULT_TOP,
        show_default=True,
        help="Candidates measured: the model's choice and the next by its ranking.",
    )(func)


def tune_settings(top, steps, warmup, timeout, ssh_config, skip_collective=False) -> TuneOptions:
    from ..backends.tune import TuneOptions  # the launch machinery loads only when a tune runs

    return TuneOptions(
        top=top,
        steps=steps,
        warmup=warmup,
        timeout_s=timeout,
        ssh_config=ssh_config,
        skip_collective=skip_collective,
        dzctl_version=__version__,
        commit=source_commit(),
    )


def run_tune(job, nodes, settings: TuneOptions, progress, trust_new_hosts: bool) -> TuneResult:
    """Tune on the first node; a tune where every candidate failed is a runtime failure (exit 1)."""
    from ..backends import tune as tuning

    first = nodes[0]
    with HostPool([first.host], ssh_config=settings.ssh_config, trust_new_hosts=trust_new_hosts) as pool:
        result = tuning.tune(job, [first], pool, settings, progress)
    if result.measured and result.calibration is None:
        reasons = "; ".join(f"candidate {m.model_rank}: {m.error}" for m in result.measured if m.error)
        raise RuntimeFailure(
            f"dzctl tune: no candidate measured on {first.host}" + (f" ({reasons})" if reasons else ""),
            fix="fix what each candidate reports (dzctl logs JOB_ID shows a run's output), then tune again",
        )
    return result


@click.command("tune")
@job_options
@hosts_options
@ssh_options
@tune_options
@json_option
def tune_command(
    job_file, overrides, runtime, hostfile, include, exclude, num_nodes, num_gpus, ssh_config, trust_new_hosts,
    top, steps, warmup, tune_timeout, as_json,
):  # fmt: skip
    """Run the planner's top candidates a few steps each on the first node; keep the fastest for later plans.

    The calibration ($DZCTL_HOME/calibration.json) holds per GPU kind, model shape, seq_len, method,
    precision and ranks per node; `plan` and `launch` then use its fastest candidate where it fits.
    """
    job = load_job_from_options(job_file, overrides, runtime)
    nodes = nodes_from_options(hostfile, include, exclude, num_nodes, num_gpus)
    settings = tune_settings(top, steps, warmup, tune_timeout, ssh_config)
    result = run_tune(job, nodes, settings, ConsoleProgress(as_json), trust_new_hosts)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else render_tune(result))


def render_tune(result: TuneResult) -> str:
    if not result.measured:
        return f"{result.job}: {result.nothing_to_tune}"
    lines = [f"tune {result.job} on {result.host} ({result.kind or 'GPU kind not known'}):"]
    fastest = result.calibration.fastest if result.calibration else None
    for m in result.measured:
        what = m.words(result.num_layers)
        outcome = f"{m.tokens_per_s:>12,.1f} tokens/s per rank" if m.tokens_per_s is not None else f"failed: {m.error}"
        mark = "  ← fastest" if m == fastest else ""
        lines.append(f"  {m.model_rank}. {what:60s}{outcome}{mark}")
    if result.nothing_to_tune:
        lines.append(f"note: {result.nothing_to_tune}")
    if result.calibration is not None:
        lines.append(f"calibration: {result.calibration.key.text()} → {result.calibration_path}")
        lines.append("later plans and launches for this key use the fastest (`dzctl plan` says so)")
    else:
        lines.append("no calibration written: the nodes' GPU kind is not known (preflight found mixed GPUs)")
    return "\n".join(lines)


def source_commit() -> str | None:
    """The git commit of this dzctl's source tree, where it runs from a checkout (read, not run: no git needed)."""
    git = Path(__file__).resolve().parents[2] / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head.removeprefix("ref: ")
        path = git / ref
        if path.exists():
            return path.read_text().strip()[:12]
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:12]
    except OSError:
        return None
    return None


def register(group: click.Group) -> None:
    group.add_command(plan_command)
    group.add_command(tune_command)
