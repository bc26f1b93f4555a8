"""The step-time model's inputs at launch: the GPU kind preflight's nvidia-smi named, the links the check measured.

Pure. ``dzctl plan`` takes the same two inputs from flags (``--gpu-kind``, ``--link-gbps``);
``launch`` has them measured, so it plans ZeRO's settings (hpZ, buckets) on what the
nodes really have. Where one is missing, the launch keeps the memory plan's defaults and
says why in one line, as before the model existed.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..memory.fromjob import SpeedInputs
from .communication import Links
from .offload import host_optimizer_from_nodes
from .steptime import GPU_KINDS, gpu_kind
from .zerochoice import SpeedPlan


def speed_inputs_at_launch(
    collective: dict | None,
    gpu_names: Mapping[str, str],
    n_nodes: int,
    host_rates: Mapping[str, Mapping[str, float]] | None = None,
) -> tuple[SpeedInputs | None, str]:
    """The model's inputs from preflight's readings, and the launch's line about them.

    ``gpu_names``: per host, nvidia-smi's name of the GPUs the job uses. The nodes must
    share one known kind. On several nodes the links must be measured (the inter-node
    bandwidth decides everything there); on one node the kind's NVLink figure stands in
    for a check that did not run (one GPU, or ``--skip-collective``). ``host_rates``: per host, what the
    Python probe measured of the host's AdamW and copy up where the plan may offload the optimizer.
    """
    names = sorted(set(gpu_names.values()))
    if not names:
        return None, "step time: not predicted (preflight read no GPU name from nvidia-smi)"
    kinds = {gpu_kind(name) for name in names}
    if None in kinds or len(kinds) > 1:
        why = "different GPU kinds" if None not in kinds else "a GPU kind not in the step-time model's table"
        return None, (
            f"step time: not predicted ({why}: {', '.join(names)}; known: {', '.join(GPU_KINDS)}); "
            "ZeRO's settings stay the defaults"
        )
    kind = kinds.pop()
    host = host_optimizer_from_nodes(host_rates or {})
    links = Links.measured(collective, intra_bytes_per_s=kind.intra_bytes_per_s)
    if links is None:
        why = (collective or {}).get("reason") or "the collective check measured no all-gather/reduce-scatter"
        if n_nodes > 1:
            return None, (
                f"step-time links: not measured ({why}); ZeRO's settings stay the defaults "
                "(dzctl plan --link-gbps predicts the step)"
            )
        links = Links.rated(None, kind.intra_bytes_per_s, f"intra-node {kind.name} default (not measured: {why})")
        return SpeedInputs(gpu=kind, links=links, host=host), f"step-time links: {links.source}"
    return SpeedInputs(gpu=kind, links=links, host=host), measured_links_note(collective)


def measured_links_note(collective: dict | None) -> str:
    """What the step-time model's links are at launch: the check's ZeRO-3 figures, or why there are none."""
    # The intra-node side a multi-node check does not measure plays no part in this line: unbounded.
    links = Links.measured(collective, intra_bytes_per_s=float("inf"))
    if links is None:
        why = (collective or {}).get("reason") or "the collective check measured no all-gather/reduce-scatter"
        return f"step-time links: not measured ({why}); the model needs --link-gbps (dzctl plan)"
    latency = links.inter_latency_s if links.inter_bytes_per_s is not None else links.intra_latency_s
    return f"step-time links: {links.source}, per-collective latency {(latency or 0.0) * 1e6:.0f} µs"


def predicted_step_line(speed: SpeedPlan | None) -> str | None:
    """The launch's one line on the chosen settings' predicted step (None when nothing was predicted)."""
    step = speed.step if speed is not None else None
    if step is None:
        return None
    hpz = f"hpZ {speed.hpz_partition_size}" if speed.hpz_partition_size > 1 else "hpZ off"
    buckets = f"reduce bucket {speed.buckets.reduce:,}" if speed.buckets is not None else "default buckets"
    off = speed.user_settings.overlap_off
    # The one setting of the user's own config that changes the step most: named with its file here too.
    overlap = f"; overlap_comm false (from {off.source}): communication not overlapped" if off else ""
    return (
        f"predicted step: {step.step_s:.3f} s per micro-step, {step.tokens_per_s:,.0f} tokens/s/GPU, "
        f"{step.bound}-bound ({speed.gpu}, MFU {speed.mfu:.1%}; {hpz}, {buckets}{overlap})"
    )


def speed_notes(speed: SpeedPlan | None) -> list[str]:
    """The choices' notes and the communication-bound warning, as ``dzctl plan`` prints them."""
    if speed is None:
        return []
    return [f"note: {note}" for note in speed.notes] + ([f"warning: {speed.warning}"] if speed.warning else [])
