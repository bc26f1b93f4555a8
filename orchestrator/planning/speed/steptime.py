"""The step-time model: compute and ZeRO-3 communication of one micro-step, and which of them bounds it (pure).

    compute  = T · F / (MFU · peak)
    comm     = Σ collectives ( share · bytes / bandwidth + calls · latency )      (communication.py)
    step     = max(compute, comm + trips) + exposed
    exposed  = the forward's first all-gather + the backward's last reduce-scatter
               + (1 − overlap) · min(compute, comm + trips)

T = tokens per GPU per micro-step (micro-batch × seq_len for packed rows), F = training
FLOPs per token (ModelShape.flops_per_token: 6·(params − input embedding) + attention),
peak = the GPU kind's dense bf16 peak, MFU = the model-FLOP utilisation measured on that
kind for that loss path and method (``MFU_MEASURED``; ``DEFAULT_MFU`` elsewhere), scaled from
the measured plan to this one by the recompute cost model (``recompute.py``). With
``overlap_comm`` DeepSpeed runs the prefetched all-gathers and the reduce-scatters on
their own stream beside the compute, so the longer of the two sets the pace; the first
gather of the forward and the last reduce of the backward have nothing to hide behind.
``overlap`` is the share of the shorter side that is hidden (1: all of it; calibrated on the
shaped-link runs, ``benchmarks/results/steptime-shaped-*``). ``trips``: where the optimizer is
offloaded, each micro-step's gradient partitions go down to the host and back on the same side
stream (``offload.py``); 0 otherwise.

The model is for one micro-step: gradient accumulation repeats the gathers and the reduce,
so an optimizer step of A micro-steps takes A of them, and then the optimizer's own step:

    optimizer step = A · step + optimizer,   optimizer = (trained params / W) · B / HBM bandwidth

a memory-bound pass over each GPU's partition (the gradient norm and clipping, fused AdamW over the
fp32 master weights and moments, the cast back to the 16-bit weights, the gradients zeroed). B, the
bytes moved per parameter at the HBM's rated bandwidth, is measured on one H200 (OPTIMIZER_BYTES_PER_PARAM;
half of it with ``train.pure_bf16``'s bf16 states, not measured).
tokens/s/GPU is over the optimizer step: A · T / (A · step + optimizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..shape import ModelShape
from . import recompute
from .communication import (
    CommTime,
    Layout,
    Links,
    ZeroSettings,
    comm_time,
    gathered_per_phase,
    micro_step_collectives,
)


@dataclass(frozen=True)
class GpuKind:
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s, no sparsity
    intra_bytes_per_s: float  # bus bandwidth of a collective among the GPUs of one node
    source: str
    hbm_bytes_per_s: float = 0.0  # the datasheet's memory bandwidth (0: the optimizer step is not timed)
    pcie_bytes_per_s: float = 32e9  # the host link's rated rate each way: PCIe 4.0 x16 32 GB/s, 5.0 x16 64


# Peaks: NVIDIA's datasheets, dense (the "with sparsity" figures halved): H100 SXM 989.4 TFLOP/s
# bf16, H200 the same GH100 die and clocks (989), A100 312. Intra-node bus bandwidth: measured
# on 2×H200 (NV18; NCCL all-reduce 302 GB/s at 256 MiB, DESIGN §5) for NVLink-4 (H100/H200 SXM);
# NVLink-3 A100 SXM: NCCL's model caps sm80 at 235 GB/s bus bandwidth (src/graph/tuning.cc).
# HBM: the datasheets' 3.35 TB/s (H100 SXM), 4.8 TB/s (H200), 2.039 TB/s (A100 80GB SXM).
# Kinds dzctl never ran on take the datasheets alone (the plan says so, and its MFU is DEFAULT_MFU):
# A100 40GB 1.555 TB/s HBM2; L40S 362 TFLOP/s dense bf16, 864 GB/s GDDR6, no NVLink (PCIe 4.0 x16, 32 GB/s
# each way, as its collective bus bandwidth at best); B200 2.25 PFLOP/s dense bf16, 8 TB/s HBM3e, NVLink-5
# at 900 GB/s each way, taken at the share NVLink-4 gave on 2×H200 (302 of 450 GB/s): 604 GB/s.
GPU_KINDS: dict[str, GpuKind] = {
    "H100": GpuKind("H100", 989e12, 302e9, "NVIDIA H100 SXM datasheet; NVLink-4 as measured on 2×H200", 3.35e12, 64e9),
    "H200": GpuKind(
        "H200", 989e12, 302e9, "NVIDIA H200 datasheet; NCCL bus bandwidth measured on 2×H200", 4.8e12, 64e9
    ),
    "A100": GpuKind("A100", 312e12, 235e9, "NVIDIA A100 datasheet; NCCL's sm80 bus-bandwidth cap", 2.039e12),
    "A100-40GB": GpuKind("A100-40GB", 312e12, 235e9, "NVIDIA A100 40GB datasheet; NCCL's sm80 cap", 1.555e12),
    "L40S": GpuKind("L40S", 362e12, 32e9, "NVIDIA L40S datasheet; PCIe 4.0 x16, no NVLink", 0.864e12),
    "B200": GpuKind(
        "B200", 2250e12, 604e9, "NVIDIA B200 datasheet; NVLink-5 at NVLink-4's measured share", 8.0e12, 64e9
    ),
}


# Bytes moved per trained parameter of a GPU's partition in one optimizer step, at the HBM's rated
# bandwidth. Measured on one H200 through dzctl launch: full fine-tuning of 18 Qwen3-8B layers
# (4,717,699,584 parameters), micro 4 with none checkpointed, took 0.863 s per optimizer step at
# accumulation 1 (median of 5 launches, benchmarks/results/steady-h200x1-20261204) and 6.191 s at 8
# (median of 7, steady-h200x1-20261204-g32): a micro-step of 0.762 s and an optimizer step of 0.101 s,
# 103 bytes per parameter at 4.8 TB/s (by our count one ideal pass of AdamW, its casts and the norm
# moves about 40: the step runs at about 40 % of the rated bandwidth).
OPTIMIZER_BYTES_PER_PARAM = 103.0
# With train.pure_bf16 the step reads and writes bf16 where it moved fp32: the master copy, its gradient and
# Adam's m and v, 8 bytes of state a parameter instead of 16. Not measured: the fp32 figure scaled by that
# ratio, on the view that the step stays bound by those bytes.
PURE_BF16_OPTIMIZER_BYTES_PER_PARAM = OPTIMIZER_BYTES_PER_PARAM * (2 + 2 + 4) / (4 + 4 + 8)


def optimizer_seconds(kind: GpuKind, params_per_gpu: float, *, pure_bf16: bool = False) -> float:
    """The optimizer's own step on one GPU: its partition of the trained parameters, memory-bound."""
    if kind.hbm_bytes_per_s <= 0:
        return 0.0
    per_param = PURE_BF16_OPTIMIZER_BYTES_PER_PARAM if pure_bf16 else OPTIMIZER_BYTES_PER_PARAM
    return params_per_gpu * per_param / kind.hbm_bytes_per_s


@dataclass(frozen=True)
class MeasuredMfu:
    """A model-FLOP utilisation measured on one GPU, and the plan it was measured at.

    A plan with another micro-batch or checkpointed-layer count gets the MFU scaled by the recompute
    cost model (``recompute.cost_per_token``, the one the planner ranks candidates with): more layers
    recomputed, or a micro-batch too small to cover the fixed cost of a micro-step, lower it. Without a
    recorded plan (``micro_batch_size`` None), the figure is used as it is.
    """

    mfu: float
    method: str = "full"  # whose recompute costs scale it: "full" or "lora"
    fetch_unit: str = "module"  # zero.fetch_unit it ran with (the recompute costs are the unit's own)
    micro_batch_size: int | None = None
    checkpointed: int = 0
    num_layers: int = 0
    seq_len: int = 0
    source: str = ""


# Model-FLOP utilisation of compute alone (ZeRO-3 on ONE GPU: no collective leaves it; the optimizer's
# step apart), by loss path, method and ZeRO-3 fetch unit, FLOPs counted as ModelShape.flops_per_token
# does (6 N + attention, LoRA too). "liger": the auto plans of issue 29 through dzctl launch on one H200
# (Qwen3-8B layer shapes, seq 4096, bf16, global batch 32 rows): full fine-tuning, 18 layers, micro 4 x 8,
# none checkpointed, 61.3 %, the micro-step of 0.762 s that OPTIMIZER_BYTES_PER_PARAM's fit leaves
# (benchmarks/results/steady-h200x1-20261204-g32; 60.1 % over the whole optimizer step, synthetic rows);
# LoRA r16 on the 7 projections, 36 layers: by module, micro 8 x 4, 14 checkpointed, 62.6 % (the same
# folder); by layer, micro 4 x 8, none checkpointed, 72.0 % (fetchunit2-h200x1-20261204: 72.9, 71.5 and
# 71.6 % in three launches, the auto plan at global batch 32 in two of them). "none"/
# "chunked" (no Liger kernels): the 2xH200 trainer run with micro-batch 6 (34.8 %, DESIGN section 5;
# its NVLink traffic is under 3 % of that step), plan not recorded. H100: the same die as H200.
_LIGER_FULL = MeasuredMfu(0.613, "full", "module", 4, 0, 18, 4096, "H200, full FT micro 4, 0/18 checkpointed")
_LIGER_LORA = MeasuredMfu(0.626, "lora", "module", 8, 14, 36, 4096, "H200, LoRA micro 8, 14/36 checkpointed")
_LIGER_LORA_BY_LAYER = MeasuredMfu(
    0.720, "lora", "layer", 4, 0, 36, 4096, "H200, LoRA by layer, micro 4, 0/36 checkpointed"
)
_NO_LIGER = MeasuredMfu(0.348, source="2xH200 trainer run, micro 6")
MFU_MEASURED: dict[tuple[str, str, str, str], MeasuredMfu] = {
    (kind, loss, method, unit): point
    for kind in ("H200", "H100")
    for (loss, method, unit), point in {
        ("liger", "full", "module"): _LIGER_FULL,
        ("liger", "lora", "module"): _LIGER_LORA,
        ("liger", "lora", "layer"): _LIGER_LORA_BY_LAYER,
        ("none", "full", "module"): _NO_LIGER,
        ("chunked", "full", "module"): _NO_LIGER,
    }.items()
}
# For kinds with no measurement here: a stated default, not a measurement (large dense
# training on A100 commonly reports 40–50 % MFU; the lower end, as a bound).
DEFAULT_MFU = 0.40


# The share of the shorter side that overlap_comm hides. 1.0 is the ideal; the shaped-link
# runs on the CPU test hosts calibrate it there (benchmarks/steptime_shaped.py).
DEFAULT_OVERLAP = 1.0


def gpu_kind(name: str) -> GpuKind | None:
    """The table's entry for a GPU name (``H100``, ``NVIDIA H200``, ``a100-sxm4-80gb``...); None if unknown.

    The most specific key whose parts all appear wins (``NVIDIA A100-SXM4-40GB`` is ``A100-40GB``)."""
    upper = name.upper()
    for key in sorted(GPU_KINDS, key=len, reverse=True):
        if all(part in upper for part in key.split("-")):
            return GPU_KINDS[key]
    return None


@dataclass(frozen=True)
class ComputePlan:
    """What of a plan the compute rate depends on, besides the GPU kind and the loss path."""

    method: str = "full"
    micro_batch_size: int | None = None  # None: the measured MFU as it is
    checkpointed: int = 0
    num_layers: int = 0
    seq_len: int = 0
    fetch_unit: str = "module"  # zero.fetch_unit, resolved
    floor_scale: float = 1.0  # recompute.floor_scale of the model's layer (1: the shape the floors were measured on)


def mfu_for(kind: GpuKind, loss_path: str, plan: ComputePlan = ComputePlan()) -> tuple[float, str]:
    """The MFU used for this kind, loss path and plan, and where it comes from.

    A fetch unit without a measurement of its own takes the method's by module (scaled by the module
    costs); a method without one takes full fine-tuning's figure, as it is.
    """
    if loss_path == "trl":  # TRL's fused head (a preference stage): timed as the model's own loss, unfused
        loss_path = "none"
    point = MFU_MEASURED.get((kind.name, loss_path, plan.method, plan.fetch_unit))
    if point is None:
        point = MFU_MEASURED.get((kind.name, loss_path, plan.method, "module"))
    if point is None:
        point = MFU_MEASURED.get((kind.name, loss_path, "full", "module"))
        if point is None:
            return DEFAULT_MFU, (
                f"stated default: {kind.name} is the datasheet model (dzctl never measured one; its peak and "
                "memory bandwidth only)"
            )
        return point.mfu, f"measured ({kind.name}, loss {loss_path}, full fine-tuning's: {point.source})"
    where = f"measured ({kind.name}, loss {loss_path}: {point.source})"
    if point.micro_batch_size is None or plan.micro_batch_size is None:
        return point.mfu, where
    # The point's MFU carried to this kind (H100: the same die), scaled by this kind's own recompute costs.
    costs = recompute.costs_for(point.method, point.fetch_unit, kind.name)
    at_point = recompute.cost_per_token(
        point.micro_batch_size, point.seq_len, point.checkpointed, point.num_layers, costs
    )
    # the point's floor is its own shape's (Qwen3-8B's layers, scale 1); the plan's is its model's
    here = recompute.cost_per_token(
        plan.micro_batch_size, plan.seq_len, plan.checkpointed, plan.num_layers, costs, floor_scale=plan.floor_scale
    )
    if abs(here / at_point - 1) < 1e-9:
        return point.mfu, where
    return point.mfu * at_point / here, f"{where}, scaled by the recompute model to micro {plan.micro_batch_size}, " + (
        f"{plan.checkpointed}/{plan.num_layers} checkpointed"
    )


@dataclass(frozen=True)
class StepTime:
    """One micro-step, predicted: its parts (seconds), the whole and what bounds it."""

    tokens: int  # per GPU per micro-step
    compute_s: float
    comm: CommTime
    overlap: float
    accumulation: int = 1  # micro-steps per optimizer step
    optimizer_s: float = 0.0  # the optimizer's own step (optimizer_seconds), once per optimizer step
    # An offloaded optimizer's gradient partitions down to the host and back, every micro-step, on the
    # same side stream as the reduce (offload.py::gradient_trips_seconds).
    offload_trips_s: float = 0.0

    @property
    def comm_s(self) -> float:
        return self.comm.total_s

    @property
    def side_s(self) -> float:
        """What runs beside the compute: the collectives and an offload's gradient trips."""
        return self.comm_s + self.offload_trips_s

    @property
    def exposed_s(self) -> float:
        hidden_side = min(self.compute_s, self.side_s)
        edges = self.comm.first_gather_s + self.comm.last_reduce_s if self.comm_s > 0 else 0.0
        return min(edges, hidden_side) + (1 - self.overlap) * max(0.0, hidden_side - edges)

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.side_s) + self.exposed_s

    @property
    def optimizer_step_s(self) -> float:
        """Accumulation micro-steps, then the optimizer."""
        return self.accumulation * self.step_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        """Per GPU, over an optimizer step."""
        return self.accumulation * self.tokens / self.optimizer_step_s

    @property
    def bound(self) -> str:
        """``compute`` or ``communication`` (the longer side)."""
        return "compute" if self.compute_s >= self.side_s else "communication"

    @property
    def loss_fraction(self) -> float:
        """The share of compute speed lost: 1 − compute / step."""
        return 1.0 - self.compute_s / self.step_s

    def to_dict(self) -> dict:
        return {
            "tokens_per_micro_step": self.tokens,
            "compute_s": round(self.compute_s, 4),
            "comm_s": round(self.comm_s, 4),
            "comm_bandwidth_s": round(self.comm.bandwidth_s, 4),
            "comm_latency_s": round(self.comm.latency_s, 4),
            "exposed_s": round(self.exposed_s, 4),
            "micro_step_s": round(self.step_s, 4),
            "optimizer_s": round(self.optimizer_s, 4),
            "offload_trips_s": round(self.offload_trips_s, 4),
            "optimizer_step_s": round(self.optimizer_step_s, 3),
            "tokens_per_s_per_gpu": round(self.tokens_per_s, 1),
            "bound": self.bound,
            "loss_vs_compute": round(self.loss_fraction, 4),
            "inter_node_gb_per_micro_step": round(self.comm.inter_bytes / 1e9, 3),
            "collectives_per_micro_step": {c.name: c.calls for c in self.comm.collectives},
            "overlap": self.overlap,
        }


def predict(
    shape: ModelShape,
    *,
    tokens: int,
    seq_len: int,
    layout: Layout,
    zero: ZeroSettings,
    links: Links,
    flops_per_s: float,
    param_bytes: int,
    grad_bytes: int,
    grad_numels: Sequence[int] | None = None,
    overlap: float = DEFAULT_OVERLAP,
    checkpointing: bool = True,
    accumulation: int = 1,
    optimizer_s: float = 0.0,
    reference_share: float = 0.0,
    offload_trips_s: float = 0.0,
) -> StepTime:
    """The predicted micro-step of one GPU.

    ``flops_per_s``: what one GPU (or CPU rank) sustains on this model, MFU × peak
    (``compute_rate``); ``grad_numels``: the trained tensors (``None``: every weight; LoRA
    passes its adapters'). ``tokens`` is what one GPU processes per micro-step; ``optimizer_s``
    the optimizer's own step (``optimizer_seconds``; 0 where it is not on the GPUs);
    ``reference_share``: a preference stage's reference forward per micro-step, as a share of the
    policy's compute (``reference_forward_share``; 0: no reference forward), whose weights are gathered
    once more in the forward order. ``offload_trips_s``: an offloaded optimizer's gradient copies of one
    micro-step (``offload.py::gradient_trips_seconds``), beside the compute with the collectives.
    """
    weights = shape.weight_numels()
    forward, backward = gathered_per_phase(
        module_blocks(shape, zero.persistence_threshold),
        checkpointing=checkpointing,
        max_reuse_distance=zero.max_reuse_distance,
    )
    if reference_share > 0:  # the frozen copy, or the policy with its adapters off, runs one more forward
        forward = forward + forward
    collectives = micro_step_collectives(
        forward,
        backward,
        weights if grad_numels is None else grad_numels,
        zero=zero,
        layout=layout,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        accumulation=accumulation,
    )
    comm = comm_time(collectives, layout=layout, links=links)
    compute = tokens * shape.flops_per_token(seq_len) / flops_per_s * (1 + reference_share)
    return StepTime(
        tokens=tokens,
        compute_s=compute,
        comm=comm,
        overlap=overlap,
        accumulation=accumulation,
        optimizer_s=optimizer_s,
        offload_trips_s=offload_trips_s,
    )


def reference_forward_share(lora: bool, checkpointed: int, num_layers: int) -> float:
    """A reference forward's time as a share of the policy's forward and backward on the same sequences.

    The forward is 2 N FLOPs a token; the policy's step does 6 N with full fine-tuning, 4 N with LoRA (the
    frozen base's weights get no gradient, only the activations do), plus 2 N per token in each recomputed
    layer's second forward. Both run at the same hardware rate (the same kernels, the same gathers). One
    H100 measured LoRA DPO, none recomputed, at 15.46 s a step where the step without the reference
    predicted 10.76 s: 1.44x, against the 1.5x this share gives (benchmarks/results/plans-h100x1-20261207).
    """
    recomputed = checkpointed / num_layers if num_layers else 0.0
    return 2.0 / ((4.0 if lora else 6.0) + 2.0 * recomputed)


def module_blocks(shape: ModelShape, persistence_threshold: int) -> list[list[tuple[int, int]]]:
    """The gathered weights by module block in forward order: embedding, each layer, the head (tied: the embedding).

    Weights at or under the persistence threshold (norms, biases) stay whole on every GPU and are left out.
    """
    weights = shape.weight_numels()  # embedding, layers, final norm, [head]
    per_layer = (len(weights) - 2 - (0 if shape.tied_embeddings else 1)) // shape.num_layers
    blocks: list[list[tuple[int, int]]] = [[(0, weights[0])]]
    for layer in range(shape.num_layers):
        start = 1 + layer * per_layer
        blocks.append([(i, weights[i]) for i in range(start, start + per_layer) if weights[i] > persistence_threshold])
    blocks.append([(0, weights[0])] if shape.tied_embeddings else [(len(weights) - 1, weights[-1])])
    return blocks


def compute_rate(kind: GpuKind, loss_path: str, plan: ComputePlan = ComputePlan()) -> float:
    """FLOP/s one GPU of this kind sustains on the loss path and plan: MFU × peak."""
    return mfu_for(kind, loss_path, plan)[0] * kind.peak_flops


def break_even_tokens(step: StepTime) -> int:
    """Tokens per GPU per micro-step at which compute would equal this communication (T*).

    Communication does not grow with the micro-batch, compute does (in proportion).
    """
    per_token = step.compute_s / step.tokens
    return int(step.comm_s / per_token) + 1 if per_token > 0 else 0
