"""The search over the choices a job leaves open: the fastest fitting micro-batch, checkpointing and offload.

``plan_memory`` tries every allowed choice from the fastest offload level down, keeps those that fit
the hardware with the stated margins, and ranks them by the expected time per token; a job that fits
nowhere gets the smallest node count that would, and (for full fine-tuning) the LoRA plan that fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ...spec.job import LoraSpec
from ..dsconfig import Resolved
from ..fusedloss import FusedLoss
from ..shape import ModelShape
from ..speed import recompute
from ..speed.fetchunit import resolve_fetch_unit
from .estimate import (
    ALLOCATOR_MARGIN,
    GIB,
    HOST_RESERVE_FRACTION,
    NON_TORCH_GPU_GIB,
    Buckets,
    Choice,
    Estimate,
    LoraShape,
    NvmeReading,
    Offload,
    PartialOffload,
    Precision,
    estimate,
    nvme_io_per_step,
    nvme_step_seconds,
)

# Candidate micro-batches when ``train.micro_batch_size: auto``: every one from 1 up to
# the first that does not fit (the peak only grows with the micro-batch, so no larger
# one would), at most MAX_AUTO_MICRO_BATCH. The fit test's margins, not the step between
# candidates, absorb the estimate's error (within 1.6 % of every 2-GPU measurement). On
# a 140 GiB H200 the largest fitting micro-batch for Qwen3-8B at seq 4096 is 6, not a
# power of two: 6,678 tokens/s/GPU against 6,399 at micro 4, one device call
# (benchmarks/results/h200x2-20261130, run 7). Without the logits (a fused loss) it is
# about 29: the search must reach well past the 64 it stopped at before.
# The ceiling only binds where no memory figure does (a CPU job with host RAM unknown):
# at 1024 rows the fixed per-micro-step cost below is under 0.1 % of the work at seq 4096.
MAX_AUTO_MICRO_BATCH = 1024


AUTO_MICRO_BATCHES = tuple(range(1, MAX_AUTO_MICRO_BATCH + 1))


# Ranking the candidates that fit: planning/speed/recompute.py (recompute FLOPs of the checkpointed
# layers against each micro-step's fixed cost, measured on one H200).


# nodes tried when looking for the smallest number that would fit
MAX_NODES_SEARCHED = 512


OFFLOAD_ORDER: tuple[Offload, ...] = ("none", "optimizer", "all")  # fastest first


@dataclass(frozen=True)
class Hardware:
    """What the nodes offer: GPUs (slots) per node, memory per GPU and host RAM per node (GiB)."""

    slots_per_node: tuple[int, ...]
    gpu_mem_gib: float | None  # None: not known (accelerator cpu)
    host_mem_gib: float | None  # None: not known; offload cannot be checked
    # What preflight measured at zero.nvme_path (None: not measured, or not usable there).
    nvme: NvmeReading | None = None
    # Host RAM the job's data takes once per node (estimate.data_node_terms): (name, bytes).
    data_terms: tuple[tuple[str, int], ...] = ()

    @property
    def data_per_node(self) -> int:
        return sum(size for _, size in self.data_terms)

    @property
    def world_size(self) -> int:
        return sum(self.slots_per_node)


@dataclass(frozen=True)
class MemoryPlan:
    fits: bool
    estimate: Estimate
    precision: Precision
    seq_len: int
    world_size: int
    gradient_accumulation_steps: int
    buckets: Buckets
    hardware: Hardware
    host_per_node: tuple[int, ...]  # bytes, per node in hostfile order
    accelerator: str = "gpu"  # "cpu": the per-"GPU" terms live in host RAM too
    reason: str = ""  # why it does not fit (empty when it fits)
    min_nodes: int | None = None  # nodes like these that would fit, when it does not
    notes: tuple[str, ...] = field(default=())
    candidates: tuple[tuple[Choice, bool, str], ...] = field(default=())  # (choice, fits, why not)
    fused_loss: FusedLoss = "none"  # train.fused_loss, resolved (orchestrator/planning/fusedloss.py)
    nvme_path: str | None = None  # zero.nvme_path, for a plan that offloads to NVMe
    # Full fine-tuning that does not fit: the LoRA plan (the job's train.lora) that would.
    lora_alternative: MemoryPlan | None = None
    # Full fine-tuning that does not fit, disk not measured: the plan offloading to NVMe, if GPUs and RAM hold it.
    nvme_alternative: MemoryPlan | None = None
    lora: LoraShape | None = None  # train.method: lora
    largest_layer_params: int = 0  # sizes DeepSpeed's NVMe parameter swap buffers
    kv_repeated: bool = False  # the attention keeps K and V per query head (estimate.repeated_kv_bytes_per_token)
    hpz_partition_size: int = 1  # ZeRO++ hpZ chosen by planning/speed/zerochoice.py (1: off)
    # The predicted step time and the ZeRO choices' reasons (planning/speed/zerochoice.py's SpeedPlan), if made.
    speed: Any = None
    # The spec key that fixed the global batch (globalbatch.py); None: micro × accumulation × world, as it falls.
    global_batch_key: str | None = None
    fetch_unit: str = "module"  # zero.fetch_unit, resolved (planning/speed/fetchunit.py): what the costs were ranked by
    # The fitting candidates of the chosen offload level, the model's fastest first (one per micro-batch: the
    # fewest checkpointed layers that fit): what `dzctl tune` measures (planning/calibration.py).
    ranked: tuple[Choice, ...] = field(default=())
    # "model": the choice is the cost model's; "calibration": a measured one (`dzctl tune`), whose record is
    # ``calibration`` (planning/calibration.py's Calibration).
    choice_source: str = "model"
    calibration: Any = None

    @property
    def nvme_step_s(self) -> float | None:
        """Expected NVMe I/O time per optimizer step, from preflight's bandwidths (None: not measured)."""
        if self.choice.offload != "nvme" or self.hardware.nvme is None:
            return None
        return nvme_step_seconds(
            self.estimate,
            self.hardware.nvme,
            ranks_per_node=max(self.hardware.slots_per_node),
            accumulation=self.gradient_accumulation_steps,
        )

    @property
    def choice(self) -> Choice:
        return self.estimate.choice

    @property
    def calibration_precision(self) -> str:
        """The precision a ``dzctl tune`` record is keyed by: pure bf16 keeps other states (other memory, other
        candidates), so its measurements are its own."""
        return f"{self.precision}-pure" if self.estimate.pure_bf16 else self.precision

    @property
    def train_batch_size(self) -> int:
        return self.choice.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    def resolved(self) -> Resolved:
        """The ``dsconfig.Resolved`` of this plan: what the DeepSpeed config is built from."""
        return Resolved(
            micro_batch_size=self.choice.micro_batch_size,
            gradient_checkpointing=self.choice.gradient_checkpointing,
            offload_optimizer=self.choice.offload_optimizer,
            offload_param=self.choice.offload_param,
            reduce_bucket_size=self.buckets.reduce,
            prefetch_bucket_size=self.buckets.prefetch,
            param_persistence_threshold=self.buckets.persistence,
            precision=self.precision,
            fused_loss=self.fused_loss,
            nvme_path=self.nvme_path if self.choice.offload == "nvme" else None,
            nvme_buffer_elements=self.largest_layer_params if self.choice.offload == "nvme" else None,
            hpz_partition_size=self.hpz_partition_size,
            checkpointed_layers=self.choice.checkpointed_layers,
        )

    def to_dict(self, ds_config: dict[str, Any] | None) -> dict[str, Any]:
        """The ``dzctl plan --json`` object (DESIGN §2)."""
        est = self.estimate
        hw = self.hardware
        return {
            "fits": self.fits,
            "per_gpu_gib": gib(est.gpu_peak),
            "per_gpu_required_gib": gib(est.gpu_required),
            "host_per_node_gib": gib(max(self.host_per_node)),
            "breakdown": {
                "gpu": {k: gib(v) for k, v in est.gpu_terms.items()},
                "gpu_peak_phase": est.peak_phase,
                # what the "logits + loss" term is made of
                "fused_loss": self.fused_loss,
                "allocator_margin_fraction": ALLOCATOR_MARGIN,
                "non_torch_gpu_gib": NON_TORCH_GPU_GIB,
                "host_per_rank": {k: gib(v) for k, v in est.host_terms_per_rank.items()},
                "host_per_node_once": {k: gib(v) for k, v in hw.data_terms},
                "host_reserve_fraction": HOST_RESERVE_FRACTION,
            },
            "micro_batch_size": self.choice.micro_batch_size,
            "gradient_checkpointing": self.choice.gradient_checkpointing,
            # of decoder_layers, how many recompute their activations (train.gradient_checkpointing: N)
            "checkpointed_layers": self.choice.layers_checkpointed(self.estimate.num_layers),
            "decoder_layers": self.estimate.num_layers,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "train_batch_size": self.train_batch_size,
            # train_batch_size × seq_len; fixed by train.global_batch_size/_tokens, else it depends on the hardware
            "global_batch_tokens": self.train_batch_size * self.seq_len,
            "global_batch_fixed_by": self.global_batch_key,
            "zero": {"offload_optimizer": self.choice.offload_optimizer, "offload_param": self.choice.offload_param},
            "offload": self.choice.offload,  # none | optimizer | all (host RAM) | nvme
            "method": self.estimate.method,
            "fetch_unit": self.fetch_unit,
            # where micro_batch_size and gradient_checkpointing come from: "model" | "calibration" (dzctl tune)
            "choice_source": self.choice_source,
            "calibration": self.calibration.to_summary(self.estimate.num_layers) if self.calibration else None,
            "trainable_params": self.estimate.trainable_params,
            "nvme": self._nvme_dict(),
            "lora_alternative": self._alternative_dict(),
            "nvme_alternative": self._nvme_alternative_dict(),
            "precision": self.precision,
            # train.pure_bf16: master weights, gradients and Adam's m and v in bf16 (the ds_config's bf16 keys)
            "pure_bf16": self.estimate.pure_bf16,
            "fused_loss": self.fused_loss,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "gpu_mem_gib": hw.gpu_mem_gib,
            "host_mem_gib": hw.host_mem_gib,
            "host_per_node_gib_each": [gib(x) for x in self.host_per_node],
            "reason": self.reason or None,
            "min_nodes": self.min_nodes,
            "notes": list(self.notes),
            "step_time": self.speed.to_dict() if self.speed is not None else None,
            "ds_config": ds_config,
        }

    def _nvme_dict(self) -> dict[str, Any] | None:
        est = self.estimate
        if self.choice.offload != "nvme":
            return None
        reading = self.hardware.nvme
        read, written = nvme_io_per_step(est, accumulation=self.gradient_accumulation_steps)
        ranks = max(self.hardware.slots_per_node)
        return {
            "path": self.nvme_path,
            "per_rank_gib": {k: gib(v) for k, v in est.nvme_terms_per_rank.items()},
            "per_node_gib": gib(ranks * est.nvme_per_rank),
            "free_gib": gib(reading.free_bytes) if reading else None,
            "read_gib_per_step_per_node": gib(ranks * read),
            "written_gib_per_step_per_node": gib(ranks * written),
            "read_mib_s": round(reading.read_bytes_per_s / 2**20, 1) if reading else None,
            "write_mib_s": round(reading.write_bytes_per_s / 2**20, 1) if reading else None,
            "expected_io_s_per_step": round(self.nvme_step_s, 2) if self.nvme_step_s is not None else None,
        }

    def _nvme_alternative_dict(self) -> dict[str, Any] | None:
        alt = self.nvme_alternative
        if alt is None:
            return None
        c = alt.choice
        return {
            "set": NVME_SETS,
            "micro_batch_size": c.micro_batch_size,
            "gradient_checkpointing": c.gradient_checkpointing,
            "per_gpu_required_gib": gib(alt.estimate.gpu_required),
            "host_per_node_gib": gib(max(alt.host_per_node)),
            "nvme_per_node_gib": gib(max(alt.hardware.slots_per_node) * alt.estimate.nvme_per_rank),
        }

    def _alternative_dict(self) -> dict[str, Any] | None:
        alt = self.lora_alternative
        if alt is None or alt.lora is None:
            return None
        c = alt.choice
        return {
            "set": lora_sets(alt.lora),
            "r": alt.lora.r,
            "target_modules": list(alt.lora.target_modules),
            "trainable_params": alt.estimate.trainable_params,
            "micro_batch_size": c.micro_batch_size,
            "gradient_checkpointing": c.gradient_checkpointing,
            "offload": c.offload,
            "per_gpu_required_gib": gib(alt.estimate.gpu_required),
            "host_per_node_gib": gib(max(alt.host_per_node)),
        }


NVME_SETS = "--set zero.offload=nvme --set zero.nvme_path=DIR"


def lora_sets(lora: LoraShape) -> str:
    """The ``--set`` that turns a job into this LoRA configuration (defaults left out)."""
    default = LoraSpec()
    sets = ["train.method=lora"]
    if lora.r != default.r:
        sets.append(f"train.lora.r={lora.r}")
    if list(lora.target_modules) != default.target_modules:
        sets.append(f"train.lora.target_modules=[{','.join(lora.target_modules)}]")
    return " ".join(f"--set {item}" for item in sets)


def gib(value: float) -> float:
    return round(value / GIB, 2)


@dataclass(frozen=True)
class Allowed:
    """What the spec leaves to the planner: ``None`` = auto.

    ``gradient_checkpointing``: ``True`` (every layer), ``False`` (none) or a number of layers
    (``train.gradient_checkpointing: N``).
    """

    micro_batch_size: int | None = None
    gradient_checkpointing: bool | int | None = None
    offload: Offload | None = None
    nvme: bool = False  # the job names zero.nvme_path: auto may offload there, last
    # The micro-batches auto may try (ascending; None: 1..MAX_AUTO_MICRO_BATCH): a fixed global batch's divisors.
    micro_candidates: tuple[int, ...] | None = None
    # The user's offload_optimizer.ratio (DeepSpeed's partial offload): what an optimizer offload keeps on the GPU.
    partial_offload: PartialOffload | None = None

    def offloads(self, accelerator: str, nvme_usable: bool = False) -> tuple[Offload, ...]:
        if self.offload is not None:
            return (self.offload,)
        # Offloading to host RAM from a CPU rank moves nothing anywhere.
        if accelerator == "cpu":
            return ("none",)
        # NVMe only after host RAM, and only where preflight found the path usable.
        return OFFLOAD_ORDER + (("nvme",) if self.nvme and nvme_usable else ())

    def layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Checkpointed layer counts allowed, fewest first (auto: any, 0 to all)."""
        ckpt = self.gradient_checkpointing
        if ckpt is None:
            return tuple(range(num_layers + 1))
        if isinstance(ckpt, bool):
            return (num_layers if ckpt else 0,)
        return (min(ckpt, num_layers),)

    def micro_batches(self) -> tuple[int, ...]:
        if self.micro_batch_size is not None:
            return (self.micro_batch_size,)
        return self.micro_candidates if self.micro_candidates is not None else AUTO_MICRO_BATCHES

    def least_choices(self, offload: Offload, num_layers: int) -> list[Choice]:
        """The least demanding allowed choice (smallest micro-batch, most layers checkpointed): if it does not fit,
        nothing does."""
        return [Choice.with_layers(min(self.micro_batches()), max(self.layer_counts(num_layers)), num_layers, offload)]


def expected_cost_per_token(
    choice: Choice,
    seq_len: int,
    num_layers: int,
    method: str = "full",
    fetch_unit: str = "module",
    gpu_kind: str | None = None,
    floor_scale: float = 1.0,
) -> float:
    """Relative time per token (lower is faster); ranks candidates of one offload level (speed/recompute.py),
    by the constants of ``gpu_kind`` where it has its own; ``floor_scale``: recompute.floor_scale of the model."""
    checkpointed = choice.layers_checkpointed(num_layers)
    costs = recompute.costs_for(method, fetch_unit, gpu_kind)
    return recompute.cost_per_token(
        choice.micro_batch_size, seq_len, checkpointed, num_layers, costs, floor_scale=floor_scale
    )


def plan_memory(
    shape: ModelShape,
    *,
    allowed: Allowed,
    seq_len: int,
    precision: Precision,
    gradient_accumulation_steps: int,
    hardware: Hardware,
    accelerator: str = "gpu",
    fused_loss: FusedLoss = "none",
    lora: LoraShape | None = None,
    nvme_path: str | None = None,
    kv_repeated: bool = False,
    fetch_unit: str = "module",  # zero.fetch_unit as the spec has it (auto: resolved per candidate)
    gpu_kind: str | None = None,  # the nodes' GPU kind (steptime.GPU_KINDS' name): whose recompute costs rank
    pure_bf16: bool = False,  # train.pure_bf16: bf16 master weights, gradients and Adam states (estimate.py)
    reference_forward: bool = False,  # a preference stage's reference runs its forward in each step (estimate.py)
) -> MemoryPlan:
    """Choose the fastest configuration that fits (or evaluate the one the spec fixes).

    Order: no offload, then optimizer offload, then full offload (each step costs
    far more throughput than any micro-batch or checkpointing choice: 27× measured for
    full offload, DESIGN §5); within one offload level the candidate with the lowest
    ``expected_cost_per_token`` among, at each micro-batch, the fewest checkpointed layers that
    fit (``kv_repeated``: the attention keeps K and V per query head, packed rows or padded pairs). The work grows
    as micro-batches × log2(layers) estimates. The user's gradient_accumulation_steps is
    kept as written, so train_batch_size = micro × accumulation × world.
    """
    buckets = Buckets.for_hidden(shape.hidden_size)
    tried: list[tuple[Choice, bool, str]] = []
    best: tuple[float, Estimate] | None = None
    layers = shape.num_layers
    counts = allowed.layer_counts(layers)
    method = "lora" if lora else "full"
    floor_scale = recompute.floor_scale(shape, seq_len)

    def unit_of(est: Estimate) -> str:
        """The fetch unit this candidate would train with (``fetch_unit``: zero.fetch_unit as the spec has it)."""
        return resolve_fetch_unit(fetch_unit, method, est.choice.offload_param)

    def estimated(choice: Choice, world_size: int = hardware.world_size) -> Estimate:
        """This job's estimate of one candidate on ``world_size`` GPUs."""
        return estimate(
            shape,
            choice,
            seq_len=seq_len,
            precision=precision,
            world_size=world_size,
            fused_loss=fused_loss,
            lora=lora,
            kv_repeated=kv_repeated,
            partial_offload=allowed.partial_offload,
            pure_bf16=pure_bf16,
            reference_forward=reference_forward,
        )

    def judged(choice: Choice) -> tuple[bool, Estimate]:
        est = estimated(choice)
        ok, why = _fits(est, hardware, accelerator)
        tried.append((choice, ok, why))
        return ok, est

    ranked: list[tuple[float, Choice]] = []  # the chosen offload level's candidates that fit, with their cost
    for offload in allowed.offloads(accelerator, hardware.nvme is not None):
        ranked = []
        for micro in allowed.micro_batches():
            # The peak only falls as more layers are checkpointed and only grows with the micro-batch,
            # while the cost grows with the layers: at each micro-batch the fewest layers that fit win.
            # Bisection over the allowed counts finds them in log2(L) estimates.
            ok, est = judged(Choice.with_layers(micro, counts[-1], layers, offload))
            if not ok:
                break  # most checkpointing does not fit: no larger micro-batch will
            lo, hi = 0, len(counts) - 1  # counts[hi] fits
            while lo < hi:
                mid = (lo + hi) // 2
                fits_mid, est_mid = judged(Choice.with_layers(micro, counts[mid], layers, offload))
                if fits_mid:
                    hi, est = mid, est_mid
                else:
                    lo = mid + 1
            cost = expected_cost_per_token(est.choice, seq_len, layers, method, unit_of(est), gpu_kind, floor_scale)
            ranked.append((cost, est.choice))
            if best is None or cost < best[0]:
                best = (cost, est)
        if best is not None:
            break
    common = dict(
        precision=precision,
        seq_len=seq_len,
        world_size=hardware.world_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        buckets=buckets,
        hardware=hardware,
        candidates=tuple(tried),
        notes=_notes(hardware, accelerator),
        accelerator=accelerator,
        fused_loss=fused_loss,
        lora=lora,
        nvme_path=nvme_path,
        largest_layer_params=shape.largest_layer_params,
        kv_repeated=kv_repeated,
    )
    if best is not None:
        est = best[1]
        return MemoryPlan(
            fits=True,
            estimate=est,
            host_per_node=_host_per_node(est, hardware, accelerator),
            fetch_unit=unit_of(est),
            # sorted() is stable: equal costs keep the search's order (smaller micro-batch first)
            ranked=tuple(choice for _, choice in sorted(ranked, key=lambda item: item[0])),
            **common,
        )
    # Nothing fits: report the least demanding candidate, and how many such nodes would do.
    least = _least_demanding(estimated, shape, allowed, hardware, accelerator)
    reason = _fits(least, hardware, accelerator)[1]
    return MemoryPlan(
        fits=False,
        estimate=least,
        fetch_unit=unit_of(least),
        host_per_node=_host_per_node(least, hardware, accelerator),
        reason=reason,
        min_nodes=smallest_fitting_nodes(estimated, shape, allowed, hardware, accelerator),
        **common,
    )


def fits_hardware(est: Estimate, hardware: Hardware, accelerator: str) -> tuple[bool, str]:
    """Whether an estimate fits these nodes with the stated margins, and why not."""
    return _fits(est, hardware, accelerator)


def host_per_node(est: Estimate, hardware: Hardware, accelerator: str) -> tuple[int, ...]:
    """Host RAM each node needs for this estimate (bytes, hostfile order)."""
    return _host_per_node(est, hardware, accelerator)


def _host_per_node(est: Estimate, hardware: Hardware, accelerator: str) -> tuple[int, ...]:
    per_rank = est.host_per_rank + (est.gpu_peak if accelerator == "cpu" else 0)
    return tuple(slots * per_rank + hardware.data_per_node for slots in hardware.slots_per_node)


def _fits(est: Estimate, hardware: Hardware, accelerator: str) -> tuple[bool, str]:
    if accelerator == "cpu":
        # CPU ranks keep everything in host RAM: the "GPU" terms live there too.
        if hardware.host_mem_gib is None:
            return True, ""
        need = max(hardware.slots_per_node) * (est.gpu_peak + est.host_per_rank) + hardware.data_per_node
        have = hardware.host_mem_gib * GIB * (1 - HOST_RESERVE_FRACTION)
        return (need <= have, "" if need <= have else f"host RAM: needs {gib(need)} GiB per node, has {gib(have)}")
    reasons = []
    if hardware.gpu_mem_gib is not None and est.gpu_required > hardware.gpu_mem_gib * GIB:
        reasons.append(
            f"GPU: needs {gib(est.gpu_required)} GiB per GPU (peak {gib(est.gpu_peak)} GiB "
            f"+ {ALLOCATOR_MARGIN:.0%} allocator margin + {NON_TORCH_GPU_GIB} GiB CUDA/NCCL), "
            f"has {hardware.gpu_mem_gib} GiB"
        )
    if hardware.host_mem_gib is not None:
        need = max(hardware.slots_per_node) * est.host_per_rank + hardware.data_per_node
        have = hardware.host_mem_gib * GIB * (1 - HOST_RESERVE_FRACTION)
        if need > have:
            data = f" + {gib(hardware.data_per_node)} GiB data" if hardware.data_per_node else ""
            reasons.append(
                f"host RAM: needs {gib(need)} GiB per node ({max(hardware.slots_per_node)} ranks × "
                f"{gib(est.host_per_rank)} GiB{data}), has {gib(have)} GiB usable of {hardware.host_mem_gib} "
                f"({HOST_RESERVE_FRACTION:.0%} left to the OS)"
            )
    if est.nvme_terms_per_rank and hardware.nvme is not None:
        need = max(hardware.slots_per_node) * est.nvme_per_rank
        if need > hardware.nvme.free_bytes:
            reasons.append(
                f"NVMe: needs {gib(need)} GiB per node at zero.nvme_path, has {gib(hardware.nvme.free_bytes)} GiB free"
            )
    return not reasons, "; ".join(reasons)


def _least_demanding(
    estimated: Callable[[Choice], Estimate], shape: ModelShape, allowed: Allowed, hardware: Hardware, accelerator: str
) -> Estimate:
    """The allowed candidate closest to fitting: smallest overshoot of GPU or host memory (``estimated``: the
    job's estimate of a candidate on these nodes)."""

    def overshoot(est: Estimate) -> float:
        over = 0.0
        if hardware.gpu_mem_gib is not None and accelerator != "cpu":
            over = max(over, est.gpu_required / (hardware.gpu_mem_gib * GIB))
        if hardware.host_mem_gib is not None:
            per_node = (
                max(hardware.slots_per_node) * (est.host_per_rank + (est.gpu_peak if accelerator == "cpu" else 0))
                + hardware.data_per_node
            )
            over = max(over, per_node / (hardware.host_mem_gib * GIB * (1 - HOST_RESERVE_FRACTION)))
        return over

    options = [
        estimated(choice)
        for offload in allowed.offloads(accelerator, hardware.nvme is not None)
        for choice in allowed.least_choices(offload, shape.num_layers)
    ]
    return min(options, key=overshoot)


def smallest_fitting_nodes(
    estimated: Callable[[Choice, int], Estimate],
    shape: ModelShape,
    allowed: Allowed,
    hardware: Hardware,
    accelerator: str,
) -> int | None:
    """The fewest nodes like these (same GPUs per node as the smallest node) on which a candidate fits
    (``estimated(choice, world_size)``: the job's estimate of a candidate on that many GPUs).

    ``None`` when no number of nodes helps: what does not shrink with more GPUs
    (activations, logits, the gathered layer) is already too large.
    """
    per_node = min(hardware.slots_per_node)
    for count in range(len(hardware.slots_per_node) + 1, MAX_NODES_SEARCHED + 1):
        bigger = replace(hardware, slots_per_node=(per_node,) * count)
        for offload in allowed.offloads(accelerator, hardware.nvme is not None):
            for choice in allowed.least_choices(offload, shape.num_layers):
                if _fits(estimated(choice, bigger.world_size), bigger, accelerator)[0]:
                    return count
    return None


def _notes(hardware: Hardware, accelerator: str) -> tuple[str, ...]:
    notes = []
    if hardware.host_mem_gib is None:
        notes.append("host RAM not known: offloaded states were not checked against it (give --host-mem-gib)")
    if accelerator != "cpu" and hardware.gpu_mem_gib is None:
        notes.append("GPU memory not known: nothing was checked against it (give --gpu-mem-gib)")
    return tuple(notes)
