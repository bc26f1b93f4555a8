"""The planner's inputs from a job (allowed choices, precision, NVMe need), and its memory plan for the job.

Everything here reads the job's ``JobInputs`` (``planning/inputs.py``), never the job's files:
they were read once, before any host was touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...errors import InputError
from ..dsconfig import (
    PURE_BF16_KEYS,
    bf16_section_to_run,
    ds_config_for,
    merge,
    offload_of,
    pure_bf16_of,
    resolve_precision,
)
from ..inputs import JobInputs
from ..preference.reference import needs_reference
from ..shape import ModelShape
from ..speed import partialchoice, purechoice
from ..speed.calibration import Calibration, CalibrationInput, key_for
from ..speed.communication import Links
from ..speed.offload import HostOptimizer
from ..speed.steptime import GpuKind
from ..speed.usersettings import user_zero_settings
from ..speed.zerochoice import choose_zero
from . import globalbatch, preference
from .estimate import Choice, LoraShape, NvmeReading, Offload, PartialOffload, Precision, data_node_terms, estimate
from .search import Allowed, Hardware, MemoryPlan, plan_memory


@dataclass(frozen=True)
class SpeedInputs:
    """What the step-time model needs beyond the plan: the GPU kind and the links (``None``: not known)."""

    gpu: GpuKind | None
    links: Links | None
    host: HostOptimizer | None = None  # the slowest node's AdamW rate, for an offloaded optimizer's step


def allowed_from(inputs: JobInputs) -> Allowed:
    """What the spec, a user ``zero.config`` and ``zero.overrides`` leave to the planner."""
    spec = inputs.spec
    train = spec.train
    micro = None if train.micro_batch_size == "auto" else int(train.micro_batch_size)
    ckpt = None if train.gradient_checkpointing == "auto" else train.gradient_checkpointing
    layers = inputs.shape.num_layers
    if not isinstance(ckpt, bool) and isinstance(ckpt, int) and ckpt > layers:
        raise InputError(
            f"{inputs.job.where('train.gradient_checkpointing')}: {ckpt} layers to checkpoint, "
            f"the model ({inputs.shape.name}) has {layers}",
            fix=f"give a number from 0 to {layers}, true (all), false (none) or auto",
        )
    offload: Offload | None = None if spec.zero.offload == "auto" else spec.zero.offload
    user = inputs.user_ds_config
    fixed = merge(user or {}, spec.zero.overrides)
    zero = fixed.get("zero_optimization")
    # A hand-written config (or an override naming a device) that says where states live decides
    # offload: the planner must estimate what DeepSpeed will actually do. An override section without
    # a device (``offload_optimizer: {ratio: 0.9}``, DeepSpeed's partial offload) tunes the offload
    # the planner chooses: it is merged onto dzctl's section, which names the device when it offloads.
    if user is not None or _names_a_device(zero):
        opt, par = offload_of(fixed)
        param_device = (zero or {}).get("offload_param") if isinstance(zero, dict) else None
        if isinstance(param_device, dict) and param_device.get("device") == "nvme":
            offload = "nvme"
        else:
            offload = "all" if par else "optimizer" if opt else "none"
    user_micro = fixed.get("train_micro_batch_size_per_gpu")
    if isinstance(user_micro, int) and not isinstance(user_micro, bool):
        micro = user_micro
    return Allowed(
        micro_batch_size=micro,
        gradient_checkpointing=ckpt,
        offload=offload,
        nvme=spec.zero.nvme_path is not None,
        partial_offload=_partial_offload(inputs, zero),
    )


def _partial_offload_note(partial: PartialOffload, plan: MemoryPlan) -> str:
    kept, groups = partial.groups_on_gpu(math.ceil(plan.estimate.trainable_params / plan.world_size))
    on_gpu = plan.estimate.optimizer_on_gpu
    if not on_gpu:  # DeepSpeed keeps whole sub-groups: a ratio near 1 over few of them keeps none
        return (
            f"partial offload ({partial.describe()}): no sub-group stays on the GPU (int((1 - {partial.ratio:g}) x "
            f"{groups} sub-groups) = 0): the whole optimizer is on the host; a smaller ratio or sub_group_size "
            "keeps some"
        )
    return (
        f"partial offload ({partial.describe()}): {kept} of {groups} sub-groups, {on_gpu / 1e9:.2f} G elements per "
        "GPU, stepped on the GPU (in the breakdown), the rest on the host"
    )


def _with_speed_note(plan: MemoryPlan, note: str | None) -> MemoryPlan:
    """``plan`` with ``note`` added to its predicted step's notes (``None``: as it is)."""
    return replace(plan, speed=replace(plan.speed, notes=(*plan.speed.notes, note))) if note else plan


def _with_accumulation(spec: Any, steps: int) -> Any:
    """The job's spec with the accumulation a fixed global batch gives the plan (the DeepSpeed config's)."""
    return spec.model_copy(update={"train": spec.train.model_copy(update={"gradient_accumulation_steps": steps})})


def _partial_offload_may_help(plan: MemoryPlan, allowed: Allowed, spec: Any, speed: SpeedInputs) -> bool:
    """The whole optimizer on the host, its step timed (a host rate measured, given or assumed: the plan says
    which), chosen by the model, and no ratio of the user's: a partial offload is worth planning
    (speed/partialchoice.py). SFT only: a preference stage's reference copy is placed after the plan, beside it."""
    return (
        plan.choice.offload == "optimizer"
        and allowed.partial_offload is None
        and plan.choice_source == "model"
        and spec.train.stage == "sft"
        and speed.host is not None
    )


def _pure_bf16_may_help(
    plan: MemoryPlan, asked: Allowed, inputs: JobInputs, precision: Precision, pure_bf16: bool, speed: SpeedInputs
) -> bool:
    """The whole optimizer on the host by the planner's choice (``asked``: before a global batch narrows it; offload
    ``None`` is auto), full fine-tuning in bf16 without pure bf16, chosen by the model, SFT, no ``zero.config`` file
    (its bf16 section would decide), and a host step timed: ``train.pure_bf16`` is worth planning
    (speed/purechoice.py). Not where ``zero.overrides`` would undo it (the job would be refused)."""
    spec = inputs.spec
    if not (
        plan.choice.offload == "optimizer"
        and asked.offload is None
        and spec.train.method == "full"
        and precision == "bf16"
        and not pure_bf16
        and plan.choice_source == "model"
        and spec.train.stage == "sft"
        and inputs.user_ds_config is None
        and speed.host is not None
    ):
        return False
    pure_spec = spec.model_copy(update={"train": spec.train.model_copy(update={"pure_bf16": True})})
    return pure_bf16_of(bf16_section_to_run(pure_spec, None, precision))


def _partial_offload(inputs: JobInputs, zero: Any) -> PartialOffload | None:
    """The user's ``offload_optimizer.ratio`` (DeepSpeed's partial offload), where it keeps part on the GPU."""
    section = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    ratio = section.get("ratio") if isinstance(section, dict) else None
    if ratio is None or ratio == "auto":
        return None
    group = zero.get("sub_group_size", "auto")
    if group == "auto":
        group = PartialOffload.sub_group_size
    elif isinstance(group, float) and group.is_integer():  # YAML's 5e8
        group = int(group)
    spec = inputs.spec
    where = (
        inputs.job.where("zero.overrides")
        if "ratio" in ((spec.zero.overrides.get("zero_optimization") or {}).get("offload_optimizer") or {})
        else f"zero.config {spec.zero.config}"
    )
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
        raise InputError(
            f"{where}: zero_optimization.offload_optimizer.ratio is {ratio!r}: DeepSpeed takes the share of the "
            "optimizer on the host, a number from 0 to 1",
            fix="give e.g. ratio: 0.5 (half the sub-groups stepped on the GPU), or leave it out (all on the host)",
        )
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise InputError(
            f"{where}: zero_optimization.sub_group_size is {group!r}: DeepSpeed takes a whole number of elements"
            + (" (YAML reads 5e8 without a dot as text)" if isinstance(group, str) else ""),
            fix="give e.g. sub_group_size: 500000000, or leave it out (DeepSpeed's 1e9)",
        )
    return PartialOffload(float(ratio), int(group)) if ratio < 1 else None


def _names_a_device(zero: Any) -> bool:
    """True when an override's ``zero_optimization`` puts a state somewhere (``device`` in an offload section)."""
    if not isinstance(zero, dict):
        return False
    return any(
        isinstance(zero.get(name), dict) and "device" in zero[name] for name in ("offload_optimizer", "offload_param")
    )


def _no_batch_in_user_config(inputs: JobInputs, batch: globalbatch.GlobalBatch) -> None:
    fixed = merge(inputs.user_ds_config or {}, inputs.spec.zero.overrides)
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        if isinstance(fixed.get(key), int) and not isinstance(fixed.get(key), bool):
            raise globalbatch.GlobalBatchImpossible(
                f"{batch.key} and the DeepSpeed config's {key} {fixed[key]} both fix the batch",
                fix=f'set {key} to "auto" in zero.config/zero.overrides, or drop {batch.key}',
            )


def check_global_batch(inputs: JobInputs, slots_per_node: Sequence[int]) -> None:
    """Refuse a global batch that cannot split on these ranks at all: the launch calls it before preflight."""
    batch = globalbatch.global_batch(inputs.spec)
    if batch is not None:
        _no_batch_in_user_config(inputs, batch)
        globalbatch.constrain(
            allowed_from(inputs), batch, sum(slots_per_node), globalbatch.fixed_accumulation(inputs.spec)
        )


def nvme_bytes_per_node(inputs: JobInputs, ranks_per_node: int, world_size: int) -> int:
    """What offload to NVMe keeps on each node's disk (it depends on the model and the GPUs, not the batch)."""
    spec = inputs.spec
    lora = LoraShape.from_spec(spec.train.lora) if spec.train.method == "lora" else None
    est = estimate(
        inputs.shape,
        Choice(1, True, "nvme"),
        seq_len=spec.train.max_seq_len,
        precision=precision_for(inputs),
        world_size=world_size,
        lora=lora,
    )
    return ranks_per_node * est.nvme_per_rank


def nvme_reading(per_host: dict[str, dict]) -> NvmeReading | None:
    """The planner's view of preflight's NVMe readings: the worst node (smallest space, slowest disk)."""
    if not per_host:
        return None
    values = list(per_host.values())
    return NvmeReading(
        free_bytes=min(v["free_bytes"] for v in values),
        read_bytes_per_s=min(v["read_bytes_per_s"] for v in values),
        write_bytes_per_s=min(v["write_bytes_per_s"] for v in values),
    )


def precision_for(inputs: JobInputs, *, bf16_supported: bool = True) -> Precision:
    """The precision DeepSpeed will run: a user config's explicit bf16/fp16 wins, else the spec's.

    ``bf16_supported``: whether the nodes' GPUs have bf16 (preflight's compute
    capability); ``precision: auto`` becomes fp16 where they have not.
    """
    fixed = merge(inputs.user_ds_config or {}, inputs.spec.zero.overrides)
    for name in ("bf16", "fp16"):
        section = fixed.get(name)
        if isinstance(section, dict) and section.get("enabled") is True:
            return name  # type: ignore[return-value]
    return resolve_precision(inputs.spec, bf16_supported=bf16_supported)


def _user_config_where(inputs: JobInputs) -> str:
    """Where the job's own DeepSpeed settings come from: its ``zero.config`` file, else ``zero.overrides``."""
    spec = inputs.spec
    return f"zero.config {spec.zero.config}" if spec.zero.config else inputs.job.where("zero.overrides")


def pure_bf16_for(inputs: JobInputs, precision: Precision) -> bool:
    """Whether DeepSpeed will keep bf16 master weights, gradients and optimizer states: read from the config the job
    will run with (``train.pure_bf16`` written by dsconfig, or a ``zero.config`` that says so itself).

    Refused, naming the keys: ``train.pure_bf16`` that the config undoes or runs without bf16.
    """
    spec = inputs.spec
    config = bf16_section_to_run(spec, inputs.user_ds_config, precision)
    pure = pure_bf16_of(config)
    if spec.train.pure_bf16 and not pure:
        bf16 = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
        undone = [key for key in ("enabled", *PURE_BF16_KEYS) if bf16.get(key) is not True]
        raise InputError(
            f"{inputs.job.where('train.pure_bf16')}: train.pure_bf16 needs the DeepSpeed config's bf16 section "
            f"with {', '.join(PURE_BF16_KEYS)} true, and {_user_config_where(inputs)} leaves bf16.{undone[0]} "
            f"{bf16.get(undone[0], 'unset')!r} (this job runs {precision})",
            fix=f'set bf16.{undone[0]} to true or "auto" there, or remove train.pure_bf16',
        )
    return pure


def _optimizer_stays_on_the_gpus(inputs: JobInputs, allowed: Allowed) -> Allowed:
    """A pure-bf16 plan never offloads the optimizer: offload auto becomes none, and a config that offloads is refused.

    DeepSpeed would step offloaded bf16 states only with its CPU Adam built to keep them in bf16
    (``fp32_optimizer_states=False``, base_optimizer.py's _configure_master_weights), and the planner's host terms
    and the host's AdamW rate are fp32's: a path dzctl has neither planned nor run.
    """
    if allowed.offload in (None, "none"):
        return replace(allowed, offload="none")
    spec = inputs.spec
    config = _user_config_where(inputs)
    if spec.train.pure_bf16:
        asked, undo = f"{inputs.job.where('train.pure_bf16')}: train.pure_bf16 keeps", "remove train.pure_bf16"
    else:  # the user's own config asks for both
        asked, undo = f"{config}: bf16.{' and '.join(PURE_BF16_KEYS)} keep", "set them false"
    raise InputError(
        f"{asked} the optimizer on the GPUs, and {config} offloads it "
        f"(zero_optimization.offload_optimizer/offload_param: {allowed.offload})",
        fix=f"remove the offload sections from the DeepSpeed config, or {undo} (fp32 states may offload)",
    )


def data_terms(inputs: JobInputs) -> dict[str, int]:
    """The data's host RAM per node: the builder, and the mapped cache's pages (from the shipped files' size)."""
    if inputs.spec.data.synthetic:
        return {}
    return data_node_terms(sum(item.size for item in inputs.shipped) or None)


def plan_for_job(
    inputs: JobInputs,
    slots_per_node: Sequence[int],
    *,
    gpu_mem_gib: float | None,
    host_mem_gib: float | None,
    bf16_supported: bool = True,
    nvme: NvmeReading | None = None,
    speed: SpeedInputs | None = None,
    calibration: CalibrationInput | None = None,
) -> tuple[MemoryPlan, dict[str, Any] | None]:
    """The memory plan of a job on nodes with these slots, and its DeepSpeed config (``None`` if it does not fit).

    ``dzctl plan`` passes the flags; the launch path passes preflight's readings
    (smallest GPU memory and host RAM found, whether every GPU has bf16, and what it
    measured at ``zero.nvme_path``) and then calls ``require_fit``. Full fine-tuning
    that does not fit is also planned as LoRA (the job's ``train.lora``), so that the
    refusal can name it; the plan itself never switches method. ``speed`` (the GPU kind and the
    links): the step-time model then predicts the step and chooses hpZ and bucket sizes
    (planning/speed/zerochoice.py); without it the ZeRO settings stay the defaults. ``calibration``
    (``dzctl tune``'s records, read once by the caller, and the nodes' GPU kind): where one holds for this
    job and its fastest candidate is allowed and fits, the plan takes that candidate (``choice_source``).
    """
    spec = inputs.spec
    if spec.accelerator == "gpu" and gpu_mem_gib is None:
        raise InputError(
            "the memory planner needs each GPU's memory",
            fix="give --gpu-mem-gib N (e.g. 140 for H200, 80 for H100/A100-80GB, 40 for A100-40GB)",
        )
    for flag, value in (("--gpu-mem-gib", gpu_mem_gib), ("--host-mem-gib", host_mem_gib)):
        if value is not None and not value > 0:
            raise InputError(f"{flag} {value}: must be a positive number of GiB")
    hardware = Hardware(
        tuple(slots_per_node),
        gpu_mem_gib if spec.accelerator == "gpu" else None,
        host_mem_gib,
        nvme=nvme,
        data_terms=tuple(data_terms(inputs).items()),
    )
    lora = LoraShape.from_spec(spec.train.lora)
    allowed = allowed_from(inputs)
    precision = precision_for(inputs, bf16_supported=bf16_supported)
    pure_bf16 = pure_bf16_for(inputs, precision)
    if pure_bf16:
        allowed = _optimizer_stays_on_the_gpus(inputs, allowed)
    batch = globalbatch.global_batch(spec)
    accumulation = globalbatch.fixed_accumulation(spec)
    free = allowed
    if batch is not None:
        _no_batch_in_user_config(inputs, batch)
        allowed = globalbatch.constrain(allowed, batch, hardware.world_size, accumulation)

    def planned(
        as_lora: bool, allowed: Allowed = allowed, hardware: Hardware = hardware, pure_bf16: bool = pure_bf16
    ) -> MemoryPlan:
        return plan_memory(
            inputs.shape,
            allowed=allowed,
            # train.stage dpo | kto: two sequences a row (memory/preference.py)
            seq_len=preference.planned_seq_len(spec.train.stage, spec.train.max_seq_len),
            precision=precision,
            gradient_accumulation_steps=spec.train.gradient_accumulation_steps,
            hardware=hardware,
            accelerator=spec.accelerator,
            fused_loss=preference.planned_fused_loss(spec.train.stage, inputs.fused_loss),
            lora=lora if as_lora else None,
            nvme_path=spec.zero.nvme_path,
            # Packed rows' varlen attention, or SDPA on a preference stage's padded pairs (TRL pads them)
            kv_repeated=spec.accelerator == "gpu" and (inputs.packing or spec.train.stage != "sft"),
            fetch_unit=spec.zero.fetch_unit,
            gpu_kind=speed.gpu.name if speed is not None and speed.gpu is not None else None,
            pure_bf16=pure_bf16,
            # DPO's sigmoid and ipo, KTO: the reference's forward in each step (planned so for a precomputed
            # reference too, which is chosen after: the safe side)
            reference_forward=needs_reference(spec.train.stage, spec.train.pref_loss),
        )

    plan = planned(spec.train.method == "lora")
    if allowed.partial_offload is not None and plan.choice.offload == "optimizer":
        plan = replace(plan, notes=(*plan.notes, _partial_offload_note(allowed.partial_offload, plan)))
    reference = None
    if plan.fits and spec.train.stage != "sft":  # the reference copy, where it fits beside the plan
        plan, reference = preference.with_reference(
            plan, spec.train, inputs.shape.total_params, lambda hw: planned(spec.train.method == "lora", allowed, hw)
        )
    if plan.fits and calibration is not None:
        plan = _calibrated(plan, inputs, calibration, allowed, plan.calibration_precision, planned)
    if batch is not None:
        if plan.fits:
            plan = globalbatch.with_batch(plan, batch)
            spec = _with_accumulation(spec, plan.gradient_accumulation_steps)
        else:
            unconstrained = planned(spec.train.method == "lora", free)
            largest = unconstrained.choice.micro_batch_size if unconstrained.fits else None
            globalbatch.refuse_unfit(batch, hardware.world_size, accumulation, largest)
    if not plan.fits and spec.train.method == "full":
        alternative = planned(True)
        if alternative.fits:
            plan = replace(plan, lora_alternative=alternative)
        # NVMe is named only where no disk was measured (a measured one already had its chance) and no
        # hand-written zero.config decides offload; its disk space is then preflight's to check.
        # Not for pure bf16: its optimizer stays on the GPUs (_optimizer_stays_on_the_gpus).
        if spec.accelerator == "gpu" and hardware.nvme is None and inputs.user_ds_config is None and not pure_bf16:
            on_disk = planned(False, replace(allowed, offload="nvme"))
            if on_disk.fits:
                plan = replace(plan, nvme_alternative=on_disk)
    if speed is not None and plan.fits:
        fixed = merge(inputs.user_ds_config or {}, spec.zero.overrides)
        lora_shape = lora if spec.train.method == "lora" else None

        def timed(candidate: MemoryPlan) -> MemoryPlan:
            return choose_zero(
                candidate,
                inputs.shape,
                gpu=speed.gpu,
                links=speed.links,
                host=speed.host,
                fixed_config=fixed,
                lora=lora_shape,
                # a measured choice stays as measured: the ZeRO settings do not move it
                micro_auto=allowed.micro_batch_size is None and candidate.choice_source == "model",
                checkpointing_auto=allowed.gradient_checkpointing is None and candidate.choice_source == "model",
                user_settings=user_zero_settings(inputs.user_ds_config, spec.zero.overrides, spec.zero.config),
                # DPO's and KTO's reference policy runs a forward of its own each micro-step
                reference_forward=reference in ("frozen-copy", "adapters-off"),
            )

        def batched_and_timed(candidate: MemoryPlan) -> MemoryPlan:
            """An alternative a note may name, planned as the job asking for it would be: the global batch, timed."""
            return timed(globalbatch.with_batch(candidate, batch) if batch is not None else candidate)

        plan = timed(plan)
        if _partial_offload_may_help(plan, allowed, spec, speed):

            def with_partial(partial: PartialOffload) -> MemoryPlan | None:
                candidate = planned(spec.train.method == "lora", replace(allowed, partial_offload=partial))
                if not candidate.fits or candidate.choice.offload != "optimizer":
                    return None
                return batched_and_timed(candidate)

            plan = _with_speed_note(plan, partialchoice.suggestion(plan, with_partial))
        # Cost: one more memory search and one more timing per plan that offloads the optimizer by auto's choice.
        if _pure_bf16_may_help(plan, free, inputs, precision, pure_bf16, speed):
            pure = planned(False, replace(allowed, offload="none"), pure_bf16=True)
            pure = batched_and_timed(pure) if pure.fits else pure
            plan = _with_speed_note(plan, purechoice.suggestion(plan, pure))
        if plan.global_batch_key is not None:  # a ZeRO setting may have moved the micro-batch: accumulation follows
            spec = _with_accumulation(spec, plan.gradient_accumulation_steps)
    ds_config = ds_config_for(spec, inputs.user_ds_config, plan.resolved(), plan.world_size) if plan.fits else None
    return plan, preference.with_reference_key(ds_config, reference)


def calibration_for(
    plan: MemoryPlan, shape: ModelShape, calibration: CalibrationInput, precision: str, method: str
) -> Calibration | None:
    """The record of ``dzctl tune`` that holds for this plan (GPU kind, model shape, seq_len, method, precision,
    ranks per node), if any."""
    if calibration.kind is None:
        return None
    key = key_for(
        shape,
        kind=calibration.kind,
        seq_len=plan.seq_len,
        method=method,
        precision=precision,
        # the tuned node's ranks: one node of the hostfile, so the largest (the planner's worst case)
        ranks_per_node=max(plan.hardware.slots_per_node),
    )
    return calibration.lookup(key)


def _calibrated(plan, inputs, calibration, allowed, precision, planned) -> MemoryPlan:
    """The plan with the calibration's fastest candidate where it applies: the spec allows it and it fits these
    nodes (the model's plan otherwise, unchanged)."""
    method = inputs.spec.train.method
    found = calibration_for(plan, inputs.shape, calibration, precision, method)
    if found is None:
        return plan
    best = found.fastest
    layers = plan.estimate.num_layers
    offload = plan.choice.offload
    if (
        best.offload != offload
        or best.micro_batch_size not in allowed.micro_batches()
        or min(best.checkpointed_layers, layers) not in allowed.layer_counts(layers)
    ):
        return plan  # the spec no longer allows it (or the offload level changed): the model decides
    fixed = replace(
        allowed,
        micro_batch_size=best.micro_batch_size,
        gradient_checkpointing=min(best.checkpointed_layers, layers),
        offload=offload,
        micro_candidates=None,
    )
    measured = planned(method == "lora", fixed)
    if not measured.fits:
        return plan  # these nodes have less memory than the tuned one: the model decides
    return replace(
        measured, candidates=plan.candidates, ranked=plan.ranked, choice_source="calibration", calibration=found
    )
