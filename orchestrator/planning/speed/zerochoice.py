"""The ZeRO-3 settings the step-time model chooses for a job that fits: hpZ and bucket sizes (pure).

After the memory planner has chosen micro-batch, checkpointing and offload, a multi-node GPU
job with known links tries hpZ (``zero_hpz_partition_size`` = GPUs per node) and larger
buckets, each re-checked against memory (hpZ's secondary copy and the buckets are terms of
the estimate), and keeps the fastest predicted setting. ``zero.config`` and
``zero.overrides`` still decide whatever they name: the model then predicts their values
(``usersettings.py``: ``overlap_comm``, the bucket sizes, the persistence threshold, the reuse
distance, hpZ), and the plan's notes name the file and key each came from.

Never chosen: ZeRO++'s quantized weights (qwZ) and gradients (qgZ). In bf16, qwZ
dequantizes wrongly in every released DeepSpeed (the fix, deepspeedai/DeepSpeed#8215, is on
master only), and qgZ communicates gradients as fp16 whatever the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..memory.estimate import Buckets, Choice, LoraShape, estimate
from ..memory.search import MAX_AUTO_MICRO_BATCH, MemoryPlan, fits_hardware, host_per_node
from ..shape import ModelShape
from . import recompute
from .communication import RATED_LINK_EFFICIENCY, Layout, Links, ZeroSettings
from .offload import PCIE_EFFICIENCY, HostOptimizer, gradient_trips_seconds, offloaded_optimizer_seconds
from .steptime import (
    DEFAULT_OVERLAP,
    ComputePlan,
    GpuKind,
    StepTime,
    break_even_tokens,
    compute_rate,
    mfu_for,
    optimizer_seconds,
    predict,
    reference_forward_share,
)
from .usersettings import UserZeroSettings, user_zero_settings

# Bucket sizes tried on multi-node jobs, as multiples of the hidden²-sized default: fewer,
# larger reduce-scatters and gathers pay the per-collective latency fewer times; 4× costs
# 3 · 2 · hidden² · 2 bytes more GPU memory (0.4 GiB for hidden 4096), which the estimate counts.
BUCKET_MULTIPLES = (1, 2, 4)

QUANTIZED_NOTE = (
    "ZeRO++ qwZ/qgZ (quantized weights/gradients) not used: in bf16 qwZ is wrong in released DeepSpeed "
    "(the fix, DeepSpeed #8215, is on master only) and qgZ reduces gradients as fp16"
)
HPZ_VERSION_NOTE = (
    "hpZ needs DeepSpeed 0.19.5 or later in the image: 0.18.3 fixed its loss getting stuck (#7707), "
    "0.19.5 a crash on small parameters (#8210)"
)


@dataclass(frozen=True)
class SpeedPlan:
    """The predicted step of the chosen settings, the plain-ZeRO-3 one beside it, and what was decided why."""

    step: StepTime | None  # None: not predicted (see notes)
    plain: StepTime | None = None  # hpZ off, default buckets: what the choice is compared against
    gpu: str | None = None
    mfu: float | None = None
    mfu_source: str = ""
    links_source: str = ""
    gradient_accumulation_steps: int = 1
    hpz_partition_size: int = 1
    buckets: Buckets | None = None
    notes: tuple[str, ...] = field(default=())
    warning: str | None = None
    offload_modelled: bool = True  # False: the plan offloads, which the model does not time
    user_settings: UserZeroSettings = field(default_factory=UserZeroSettings)  # what the job's config fixed, where

    def to_dict(self) -> dict[str, Any]:
        step = self.step
        return {
            "predicted": step is not None,
            "gpu": self.gpu,
            "mfu": self.mfu,
            "mfu_source": self.mfu_source,
            "links": self.links_source,
            **(step.to_dict() if step is not None else {}),
            "plain_zero3_micro_step_s": round(self.plain.step_s, 4) if self.plain is not None else None,
            "hpz_partition_size": self.hpz_partition_size,
            "reduce_bucket_size": self.buckets.reduce if self.buckets else None,
            "prefetch_bucket_size": self.buckets.prefetch if self.buckets else None,
            "offload_modelled": self.offload_modelled,
            "user_settings": self.user_settings.to_list(),
            "notes": list(self.notes),
            "warning": self.warning,
        }


def _user_zero(fixed_config: dict[str, Any]) -> dict[str, Any]:
    zero = fixed_config.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def choose_zero(
    plan: MemoryPlan,
    shape: ModelShape,
    *,
    gpu: GpuKind | None,
    links: Links | None,
    fixed_config: dict[str, Any],
    lora: LoraShape | None,
    host: HostOptimizer | None = None,
    micro_auto: bool = False,
    checkpointing_auto: bool = False,
    user_settings: UserZeroSettings | None = None,
    reference_forward: bool = False,
) -> MemoryPlan:
    """The plan with hpZ and buckets chosen by the step-time model, and its ``speed`` filled in.

    ``fixed_config``: the user's ``zero.config`` merged with ``zero.overrides`` (what they force).
    ``host``: the slowest node's AdamW rate (planning/speed/offload.py), which times an offloaded optimizer.
    ``micro_auto``/``checkpointing_auto``: the spec leaves the micro-batch / the checkpointed layer
    count to the planner, so a setting that needs memory (hpZ's copy, larger buckets) may take a
    smaller micro-batch or recompute more layers; the step-time model weighs both.
    ``user_settings``: the speed-relevant keys of ``fixed_config`` with the file each came from
    (``usersettings.user_zero_settings``); None: read from ``fixed_config``, its file unnamed.
    ``reference_forward``: a preference stage whose reference policy runs its own forward each micro-step
    (the frozen copy, or LoRA's base with the adapters off); its time is in the step.
    """
    slots = plan.hardware.slots_per_node
    layout = Layout(gpus_per_node=max(slots), nodes=len(slots))
    notes: list[str] = []
    if plan.accelerator != "gpu" or not plan.fits:
        return plan
    if layout.nodes > 1 and plan.precision == "bf16":
        notes.append(QUANTIZED_NOTE)
    user = _user_zero(fixed_config)
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if user.get(key) is True and plan.precision == "bf16":
            notes.append(f"warning: {key} is set by the job in bf16: see the note on qwZ/qgZ above")
    if gpu is None:
        notes.append("step time not predicted: the GPU kind is not known (give --gpu-kind, e.g. H100)")
        return replace(plan, speed=SpeedPlan(step=None, notes=tuple(notes)))
    if links is None or (layout.nodes > 1 and links.inter_bytes_per_s is None):
        notes.append(
            "step time not predicted: the inter-node bandwidth is not known (give --link-gbps, the NIC speed "
            "per node in Gbit/s)"
        )
        return replace(plan, speed=SpeedPlan(step=None, gpu=gpu.name, notes=tuple(notes)))
    if plan.choice.offload_param:
        notes.append(
            f"offload {plan.choice.offload}: the weights' PCIe traffic and the CPU optimizer step are not in this "
            "prediction (it is a lower bound on the step time)"
        )
    elif plan.choice.offload_optimizer and host is None:
        notes.append(
            "offload optimizer: the host's AdamW step is not in this prediction (no rate measured: launch measures "
            "it on every node, dzctl plan takes --host-adam-rate); it is a lower bound on the step time"
        )
    elif plan.choice.offload_optimizer:
        notes.append(
            f"offload optimizer: the host's AdamW step is timed from the {host.describe()}; the gradients go "
            "down during the backward (overlap_comm), beside the compute"
        )
    settings = user_settings if user_settings is not None else user_zero_settings(fixed_config, None, None)
    notes += settings.notes()
    # overlap_comm false: DeepSpeed runs the collectives on the compute stream, nothing is hidden.
    overlap = 0.0 if settings.overlap_off else DEFAULT_OVERLAP
    reuse_distance = settings.integer("stage3_max_reuse_distance")
    p = 2 if plan.precision in ("bf16", "fp16") else 4
    grad_numels = _trained_numels(shape, lora)
    world = layout.nodes * layout.gpus_per_node

    def run(hpz: int, buckets: Buckets, candidate: MemoryPlan) -> StepTime:
        zero = ZeroSettings(buckets.reduce, buckets.prefetch, buckets.persistence, hpz)
        if reuse_distance is not None:
            zero = replace(zero, max_reuse_distance=reuse_distance)
        micro = candidate.choice.micro_batch_size
        return predict(
            shape,
            tokens=micro * plan.seq_len,
            seq_len=plan.seq_len,
            layout=layout,
            zero=zero,
            links=links,
            overlap=overlap,
            flops_per_s=compute_rate(gpu, plan.fused_loss, _compute_plan(candidate, shape)),
            param_bytes=p,
            grad_bytes=p,
            grad_numels=grad_numels,
            checkpointing=plan.choice.gradient_checkpointing,
            accumulation=candidate.gradient_accumulation_steps,
            optimizer_s=_optimizer_s(candidate, gpu, host, world, layout.gpus_per_node, p),
            reference_share=_reference_share(candidate) if reference_forward else 0.0,
            offload_trips_s=_gradient_trips_s(candidate, gpu, host, world, p),
        )

    default = plan.buckets
    user_persistence = settings.integer("stage3_param_persistence_threshold")
    if user_persistence is not None:  # the weights it keeps whole are neither gathered nor partitioned
        default = replace(default, persistence=user_persistence)
    user_hpz = _int_or_none(user.get("zero_hpz_partition_size"))
    user_reduce = _int_or_none(user.get("reduce_bucket_size"))
    user_prefetch = _int_or_none(user.get("stage3_prefetch_bucket_size"))
    hpz_options = [1]
    if user_hpz is not None:
        hpz_options = [user_hpz]
    elif layout.nodes > 1 and layout.gpus_per_node > 1:
        if len(set(slots)) > 1:
            notes.append("hpZ not tried: the nodes have different GPU counts (it groups the GPUs of each node)")
        elif plan.choice.offload_param:
            notes.append("hpZ not tried: parameters are offloaded (its secondary copy lives on the GPUs)")
        else:
            hpz_options.append(layout.gpus_per_node)
    multiples = (1,) if layout.nodes == 1 or (user_reduce and user_prefetch) else BUCKET_MULTIPLES
    planned_micro = plan.choice.micro_batch_size
    # With micro-batch auto, a setting that needs memory (hpZ, larger buckets) may take a smaller
    # micro-batch: the largest that still fits is tried, and compared per token.
    micro_options = _micro_options(plan, micro_auto)
    plain = run(1 if user_hpz is None else user_hpz, _buckets(default, 1, user_reduce, user_prefetch), plan)
    best: tuple[float, int, Buckets, StepTime, MemoryPlan] | None = None
    hpz_fits = False
    for hpz in hpz_options:
        for m in multiples:
            buckets = _buckets(default, m, user_reduce, user_prefetch)
            for micro in micro_options:
                candidate = _with_settings(plan, shape, hpz, buckets, lora, micro, more_layers=checkpointing_auto)
                if candidate is not None:
                    break
            if candidate is None:
                if hpz > 1 and m == 1:
                    notes.append(f"hpZ not chosen: its secondary copy does not fit ({_hpz_gib(shape, hpz, p)} GiB/GPU)")
                continue
            hpz_fits = hpz_fits or hpz > 1
            step = run(hpz, buckets, candidate)
            per_token = step.step_s / step.tokens
            # Faster per token by 1 %, or the simpler setting stays: the model is no finer than that.
            if best is None or per_token < best[0] * 0.99:
                best = (per_token, hpz, buckets, step, candidate)
    if best is None:  # not even the plan's own settings re-fit: keep the plan as it was
        speed = SpeedPlan(step=plain, plain=plain, gpu=gpu.name, notes=tuple(notes), user_settings=settings)
        return replace(plan, speed=speed)
    _, hpz, buckets, step, chosen = best
    if reference_forward:
        notes.append(
            f"preference reference: its forward is in the step time ({_reference_share(chosen):.0%} of the "
            "policy's forward and backward on the same sequences)"
        )
    mfu, mfu_source = mfu_for(gpu, plan.fused_loss, _compute_plan(chosen, shape))
    if hpz > 1 and user_hpz is None:
        moved = chosen.choice.micro_batch_size != planned_micro
        notes.append(
            f"hpZ on (zero_hpz_partition_size {hpz}): the backward's all-gather stays within each node; "
            f"predicted {plain.tokens_per_s and step.tokens_per_s / plain.tokens_per_s:.2f}× plain ZeRO-3's "
            f"tokens/s, for {_hpz_gib(shape, hpz, p)} GiB more per GPU"
            + (f" (micro-batch {chosen.choice.micro_batch_size} instead of {planned_micro})" if moved else "")
        )
        notes.append(HPZ_VERSION_NOTE)
    elif hpz_fits and user_hpz is None:
        notes.append("hpZ not chosen: not predicted faster here")
    if buckets != default and not (user_reduce and user_prefetch):
        notes.append(
            f"buckets {buckets.reduce / default.reduce:.0f}× the hidden²-sized default (reduce {buckets.reduce:,}, "
            f"prefetch {buckets.prefetch:,} elements): fewer collectives pay the per-collective latency"
        )
    speed = SpeedPlan(
        step=step,
        plain=plain,
        gpu=gpu.name,
        mfu=mfu,
        mfu_source=mfu_source,
        links_source=links.source,
        gradient_accumulation_steps=chosen.gradient_accumulation_steps,
        hpz_partition_size=hpz,
        buckets=buckets,
        notes=tuple(notes),
        user_settings=settings,
        offload_modelled=chosen.choice.offload == "none" or (host is not None and not chosen.choice.offload_param),
        warning=comm_bound_warning(
            step,
            chosen,
            links,
            hpz_tried=len(hpz_options) > 1 and not hpz_fits,
            hpz=hpz,
            largest_micro=_largest_fitting_micro(chosen, shape, hpz, buckets, lora, step),
            hpz_forced_off=user_hpz == 1 and layout.nodes > 1 and layout.gpus_per_node > 1,
        ),
    )
    return replace(chosen, speed=speed)


def _optimizer_s(
    plan: MemoryPlan, gpu: GpuKind, host: HostOptimizer | None, world: int, gpus_per_node: int, param_bytes: int
) -> float:
    """The optimizer's own step: on the GPU (memory-bound over its partition), or on the host where offloaded
    (0 where the host's rate is not known: the plan says the prediction is a lower bound)."""
    per_gpu = plan.estimate.trainable_params / world
    if not plan.choice.offload_optimizer:
        return optimizer_seconds(gpu, per_gpu, pure_bf16=plan.estimate.pure_bf16)
    if host is None or plan.choice.offload_param:
        return 0.0
    # A partial offload's sub-groups on the GPU step there, one after another with the host's (stage3.py's step).
    on_gpu = plan.estimate.optimizer_on_gpu
    return optimizer_seconds(gpu, on_gpu) + offloaded_optimizer_seconds(
        host,
        per_gpu,
        gpus_per_node,
        param_bytes,
        link_bytes_per_s=gpu.pcie_bytes_per_s * PCIE_EFFICIENCY,
        on_gpu_params=on_gpu,
    )


def _gradient_trips_s(plan: MemoryPlan, gpu: GpuKind, host: HostOptimizer | None, world: int, grad_bytes: int) -> float:
    """An offloaded optimizer's gradient trips of one micro-step (0 where the host's rates are not known, as
    for its step: the plan says the prediction is a lower bound)."""
    if not plan.choice.offload_optimizer or host is None or plan.choice.offload_param:
        return 0.0
    link = gpu.pcie_bytes_per_s * PCIE_EFFICIENCY
    return gradient_trips_seconds(host, plan.estimate.trainable_params / world, grad_bytes, link_bytes_per_s=link)


def _reference_share(plan: MemoryPlan) -> float:
    layers = plan.estimate.num_layers
    return reference_forward_share(plan.estimate.method == "lora", plan.choice.layers_checkpointed(layers), layers)


def _compute_plan(plan: MemoryPlan, shape: ModelShape) -> ComputePlan:
    """The plan's micro-batch and checkpointed layers, which the measured MFU is scaled to."""
    layers = plan.estimate.num_layers
    return ComputePlan(
        method=plan.estimate.method,
        micro_batch_size=plan.choice.micro_batch_size,
        checkpointed=plan.choice.layers_checkpointed(layers),
        num_layers=layers,
        seq_len=plan.seq_len,
        fetch_unit=plan.fetch_unit,
        floor_scale=recompute.floor_scale(shape, plan.seq_len),
    )


def _buckets(default: Buckets, m: int, reduce: int | None, prefetch: int | None) -> Buckets:
    return Buckets(
        reduce=reduce if reduce else default.reduce * m,
        prefetch=prefetch if prefetch else default.prefetch * m,
        persistence=default.persistence,
    )


def _trained_numels(shape: ModelShape, lora: LoraShape | None) -> list[int] | None:
    if lora is None:
        return None
    per_layer = [lora.r * fan_in for fan_in, _ in lora.adapted(shape).values()]
    per_layer += [lora.r * fan_out for _, fan_out in lora.adapted(shape).values()]
    return per_layer * shape.num_layers


def _hpz_gib(shape: ModelShape, hpz: int, p: int) -> str:
    return f"{p * shape.total_params / hpz / 2**30:.2f}"


def _with_settings(
    plan: MemoryPlan,
    shape: ModelShape,
    hpz: int,
    buckets: Buckets,
    lora: LoraShape | None,
    micro: int,
    *,
    every_layer: bool = False,
    more_layers: bool = False,
) -> MemoryPlan | None:
    """The plan re-estimated with these settings, or None when that no longer fits.

    ``every_layer``: checkpoint all layers where the plan checkpoints some (a larger micro-batch may
    need more of them recomputed than the plan's own micro-batch did). ``more_layers``: where the
    plan's own count no longer fits, the fewest more checkpointed layers that do (the count is auto)."""
    layers = plan.estimate.num_layers
    choice = replace(plan.choice, micro_batch_size=micro)
    if every_layer and choice.gradient_checkpointing:
        choice = replace(choice, checkpointed_layers=None)
    options = [choice]
    if more_layers and not every_layer:
        first = choice.layers_checkpointed(layers)
        options += [Choice.with_layers(micro, n, layers, choice.offload) for n in range(first + 1, layers + 1)]
    for option in options:  # fewest checkpointed layers first: the first that fits
        est = estimate(
            shape,
            option,
            seq_len=plan.seq_len,
            precision=plan.precision,
            world_size=plan.world_size,
            buckets=buckets,
            fused_loss=plan.fused_loss,
            lora=lora if plan.estimate.method == "lora" else None,
            hpz_partition_size=hpz,
            kv_repeated=plan.kv_repeated,
            partial_offload=plan.estimate.partial_offload,
            pure_bf16=plan.estimate.pure_bf16,
        )
        if fits_hardware(est, plan.hardware, plan.accelerator)[0]:
            break
    else:
        return None
    accumulation = plan.gradient_accumulation_steps
    if plan.global_batch_key is not None:  # the spec fixed the global batch: accumulation makes up for the micro-batch
        accumulation = plan.train_batch_size // (micro * plan.world_size)
    return replace(
        plan,
        estimate=est,
        gradient_accumulation_steps=accumulation,
        buckets=buckets,
        hpz_partition_size=hpz,
        host_per_node=host_per_node(est, plan.hardware, plan.accelerator),
    )


def _micro_options(plan: MemoryPlan, micro_auto: bool) -> tuple[int, ...]:
    """The micro-batches a ZeRO setting may take, the plan's own first. With a global batch the spec fixed
    (``train.global_batch_size``/``_tokens``), only those that split it exactly on these ranks."""
    planned = plan.choice.micro_batch_size
    if not micro_auto:
        return (planned,)
    if plan.global_batch_key is None:
        return tuple(range(planned, 0, -1))
    per_rank = plan.train_batch_size // plan.world_size
    return tuple(m for m in range(planned, 0, -1) if per_rank % m == 0)


def _largest_fitting_micro(
    plan: MemoryPlan, shape: ModelShape, hpz: int, buckets: Buckets, lora: LoraShape | None, step: StepTime
) -> int:
    """The largest micro-batch up to the compute-bound one that still fits with these settings."""
    if step.bound != "communication":
        return plan.choice.micro_batch_size
    wanted = min(MAX_AUTO_MICRO_BATCH, -(-break_even_tokens(step) // plan.seq_len))
    largest = plan.choice.micro_batch_size
    per_rank = plan.train_batch_size // plan.world_size
    for micro in range(largest + 1, wanted + 1):
        if plan.global_batch_key is not None and per_rank % micro:
            continue  # does not split the global batch the spec fixed
        if _with_settings(plan, shape, hpz, buckets, lora, micro, every_layer=True) is None:
            break
        largest = micro
    return largest


def comm_bound_warning(
    step: StepTime,
    plan: MemoryPlan,
    links: Links,
    *,
    hpz_tried: bool,
    hpz: int,
    largest_micro: int,
    hpz_forced_off: bool = False,
) -> str | None:
    """The plan's warning when communication bounds the step: the predicted loss and the ways out."""
    if step.bound != "communication":
        return None
    t_star = break_even_tokens(step)
    micro = plan.choice.micro_batch_size
    if largest_micro > micro:
        how = (
            f"micro-batch {largest_micro} fits: --set train.micro_batch_size={largest_micro}, with "
            "gradient_accumulation_steps lowered to keep the global batch"
        )
    else:
        how = "no larger micro-batch fits these GPUs"
    fixes = [
        f"more tokens per GPU per micro-step (compute-bound from about {t_star:,} tokens: micro-batch "
        f"{-(-t_star // plan.seq_len)} at seq {plan.seq_len}, now {micro}; {how})"
    ]
    if hpz == 1 and hpz_tried:
        fixes.append("hpZ, once its secondary copy fits (more GPUs, or a smaller micro-batch)")
    if hpz_forced_off:
        fixes.append("hpZ (the job sets zero_hpz_partition_size 1; GPUs per node turns it on)")
    if links.inter_bytes_per_s is not None and step.comm.bandwidth_s > 0:
        share = step.compute_s / max(step.comm.bandwidth_s, 1e-12)
        needed = links.inter_bytes_per_s / max(share, 1e-12)
        fixes.append(f"a faster network (about {needed * 8 / 1e9 / RATED_LINK_EFFICIENCY:,.0f} Gbit/s per node)")
    return (
        f"communication-bound: predicted at {1 - step.loss_fraction:.0%} of compute speed, "
        f"{step.loss_fraction:.0%} lost ({step.tokens / step.step_s:,.0f} against {step.tokens / step.compute_s:,.0f} "
        "tokens/s/GPU); fixes: " + "; ".join(fixes)
    )
