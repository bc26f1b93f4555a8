"""The planner's inputs read from a job spec (allowed choices, precision, NVMe need), and its plan for a job."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ...errors import InputError
from ...spec.job import LoadedJob
from .. import fusedloss
from ..dsconfig import (
    job_ds_config,
    load_user_config,
    merge,
    offload_of,
    resolve_precision,
)
from ..shape import ModelShape, shape_for_job
from .estimate import Choice, LoraShape, NvmeReading, Offload, Precision, estimate
from .search import Allowed, Hardware, MemoryPlan, plan_memory


def allowed_from_job(job: LoadedJob) -> Allowed:
    """What the spec, a user ``zero.config`` and ``zero.overrides`` leave to the planner."""
    train = job.spec.train
    micro = None if train.micro_batch_size == "auto" else int(train.micro_batch_size)
    ckpt = None if train.gradient_checkpointing == "auto" else bool(train.gradient_checkpointing)
    offload: Offload | None = None if job.spec.zero.offload == "auto" else job.spec.zero.offload
    user = load_user_config(job)
    fixed = merge(user or {}, job.spec.zero.overrides)
    zero = fixed.get("zero_optimization")
    # A hand-written config (or override) that says where states live decides offload:
    # the planner must estimate what DeepSpeed will actually do.
    if user is not None or (isinstance(zero, dict) and ({"offload_optimizer", "offload_param"} & set(zero))):
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
        nvme=job.spec.zero.nvme_path is not None,
    )


def nvme_bytes_per_node(job: LoadedJob, ranks_per_node: int, world_size: int) -> int:
    """What offload to NVMe keeps on each node's disk (it depends on the model and the GPUs, not the batch)."""
    lora = LoraShape.from_spec(job.spec.train.lora) if job.spec.train.method == "lora" else None
    est = estimate(
        shape_for_job(job),
        Choice(1, True, "nvme"),
        seq_len=job.spec.train.max_seq_len,
        precision=precision_for_job(job),
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


def precision_for_job(job: LoadedJob, *, bf16_supported: bool = True) -> Precision:
    """The precision DeepSpeed will run: a user config's explicit bf16/fp16 wins, else the spec's.

    ``bf16_supported``: whether the nodes' GPUs have bf16 (preflight's compute
    capability); ``precision: auto`` becomes fp16 where they have not.
    """
    fixed = merge(load_user_config(job) or {}, job.spec.zero.overrides)
    for name in ("bf16", "fp16"):
        section = fixed.get(name)
        if isinstance(section, dict) and section.get("enabled") is True:
            return name  # type: ignore[return-value]
    return resolve_precision(job.spec, bf16_supported=bf16_supported)


def plan_for_job(
    job: LoadedJob,
    slots_per_node: Sequence[int],
    *,
    gpu_mem_gib: float | None,
    host_mem_gib: float | None,
    shape: ModelShape | None = None,
    bf16_supported: bool = True,
    nvme: NvmeReading | None = None,
) -> tuple[MemoryPlan, dict[str, Any] | None]:
    """The memory plan of a job on nodes with these slots, and its DeepSpeed config (``None`` if it does not fit).

    ``dzctl plan`` passes the flags; the launch path passes preflight's readings
    (smallest GPU memory and host RAM found, whether every GPU has bf16, and what it
    measured at ``zero.nvme_path``) and then calls ``require_fit``. Full fine-tuning
    that does not fit is also planned as LoRA (the job's ``train.lora``), so that the
    refusal can name it; the plan itself never switches method.
    """
    spec = job.spec
    if spec.accelerator == "gpu" and gpu_mem_gib is None:
        raise InputError(
            "the memory planner needs each GPU's memory",
            fix="give --gpu-mem-gib N (e.g. 140 for H200, 80 for H100/A100-80GB, 40 for A100-40GB)",
        )
    for flag, value in (("--gpu-mem-gib", gpu_mem_gib), ("--host-mem-gib", host_mem_gib)):
        if value is not None and not value > 0:
            raise InputError(f"{flag} {value}: must be a positive number of GiB")
    hardware = Hardware(
        tuple(slots_per_node), gpu_mem_gib if spec.accelerator == "gpu" else None, host_mem_gib, nvme=nvme
    )
    shape = shape or shape_for_job(job)
    lora = LoraShape.from_spec(spec.train.lora)
    fused_loss = fusedloss.resolve(spec.train.fused_loss, accelerator=spec.accelerator, model_type=shape.model_type)

    def planned(as_lora: bool) -> MemoryPlan:
        return plan_memory(
            shape,
            allowed=allowed_from_job(job),
            seq_len=spec.train.max_seq_len,
            precision=precision_for_job(job, bf16_supported=bf16_supported),
            gradient_accumulation_steps=spec.train.gradient_accumulation_steps,
            hardware=hardware,
            accelerator=spec.accelerator,
            fused_loss=fused_loss,
            lora=lora if as_lora else None,
            nvme_path=spec.zero.nvme_path,
        )

    plan = planned(spec.train.method == "lora")
    if not plan.fits and spec.train.method == "full":
        alternative = planned(True)
        if alternative.fits:
            plan = replace(plan, lora_alternative=alternative)
    ds_config = job_ds_config(job, plan.resolved(), plan.world_size) if plan.fits else None
    return plan, ds_config
