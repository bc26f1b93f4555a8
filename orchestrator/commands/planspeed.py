"""``dzctl plan``'s step-time part: the flags the model needs when no host was measured, and its lines (issue 30)."""

from __future__ import annotations

import click

from ..errors import InputError
from ..planning.memory.fromjob import SpeedInputs
from ..planning.memory.search import MemoryPlan
from ..planning.speed.communication import Links
from ..planning.speed.steptime import GPU_KINDS
from ..planning.speed.steptime import gpu_kind as lookup_gpu_kind


def speed_options(func):
    """``--gpu-kind``, ``--link-gbps``, ``--intra-gbps``: what the step-time model needs when no host was measured."""
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


def speed_inputs(gpu_kind: str | None, link_gbps: float | None, intra_gbps: float | None) -> SpeedInputs:
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
    return SpeedInputs(gpu=kind, links=Links.rated(link_gbps, intra, ", ".join(where)))


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
        f"  micro-step     {step.step_s:8.3f} s = max(compute, communication) + {step.exposed_s:.3f} s not overlapped",
        f"  {step.tokens_per_s:,.0f} tokens/s/GPU, bound: {step.bound}; optimizer step "
        f"({speed.gradient_accumulation_steps} micro-steps) {step.step_s * speed.gradient_accumulation_steps:.2f} s",
    ]
    if speed.plain is not None and speed.hpz_partition_size > 1:
        lines.append(f"  plain ZeRO-3 would take {speed.plain.step_s:.3f} s per micro-step")
    lines += [f"note: {note}" for note in speed.notes]
    if speed.warning:
        lines.append(f"warning: {speed.warning}")
    return lines
