"""The step-time model: compute and ZeRO-3 communication of one micro-step, and which of them bounds it (pure).

    compute  = T · F / (MFU · peak)
    comm     = Σ collectives ( share · bytes / bandwidth + calls · latency )      (communication.py)
    step     = max(compute, comm) + exposed
    exposed  = the forward's first all-gather + the backward's last reduce-scatter
               + (1 − overlap) · min(compute, comm)

T = tokens per GPU per micro-step (micro-batch × seq_len for packed rows), F = training
FLOPs per token (ModelShape.flops_per_token: 6·(params − input embedding) + attention),
peak = the GPU kind's dense bf16 peak, MFU = the model-FLOP utilisation measured on that
kind for that loss path (``MFU_MEASURED``; ``DEFAULT_MFU`` elsewhere). With
``overlap_comm`` DeepSpeed runs the prefetched all-gathers and the reduce-scatters on
their own stream beside the compute, so the longer of the two sets the pace; the first
gather of the forward and the last reduce of the backward have nothing to hide behind.
``overlap`` is the share of the shorter side that is hidden (1: all of it; calibrated on the
shaped-link runs, ``benchmarks/results/steptime-shaped-*``).

The model is for one micro-step: gradient accumulation repeats the gathers and the reduce,
so an optimizer step of A micro-steps takes A times as long (the optimizer's own step is
left out: with N/W parameters per GPU it is a small memory-bound pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..shape import ModelShape
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


# Peaks: NVIDIA's datasheets, dense (the "with sparsity" figures halved): H100 SXM 989.4 TFLOP/s
# bf16, H200 the same GH100 die and clocks (989), A100 312. Intra-node bus bandwidth: measured
# on 2×H200 (NV18; NCCL all-reduce 302 GB/s at 256 MiB, DESIGN §5) for NVLink-4 (H100/H200 SXM);
# NVLink-3 A100 SXM: NCCL's model caps sm80 at 235 GB/s bus bandwidth (src/graph/tuning.cc).
GPU_KINDS: dict[str, GpuKind] = {
    "H100": GpuKind("H100", 989e12, 302e9, "NVIDIA H100 SXM datasheet; NVLink-4 as measured on 2×H200"),
    "H200": GpuKind("H200", 989e12, 302e9, "NVIDIA H200 datasheet; NCCL bus bandwidth measured on 2×H200"),
    "A100": GpuKind("A100", 312e12, 235e9, "NVIDIA A100 datasheet; NCCL's sm80 bus-bandwidth cap"),
}


# Model-FLOP utilisation of compute alone (ZeRO-3 on ONE GPU: no collective leaves it), by loss
# path, from benchmarks/results/useful-tokens-h200x1-20261201 (18 of Qwen3-8B's 36 layers,
# seq 4096, bf16, full checkpointing, micro-batch 36): "liger" is its synthetic full-row run
# (488.2 TFLOP/s, 49.4 %). "none"/"chunked" (no Liger kernels): the 2×H200 trainer run with
# micro-batch 6 (34.8 %, DESIGN §5; its NVLink traffic is under 3 % of that step). H100: the
# same die as H200, taken as equal.
MFU_MEASURED: dict[tuple[str, str], float] = {
    ("H200", "liger"): 0.494,
    ("H200", "none"): 0.348,
    ("H200", "chunked"): 0.348,
    ("H100", "liger"): 0.494,
    ("H100", "none"): 0.348,
    ("H100", "chunked"): 0.348,
}
# For kinds with no measurement here: a stated default, not a measurement (large dense
# training on A100 commonly reports 40–50 % MFU; the lower end, as a bound).
DEFAULT_MFU = 0.40


# The share of the shorter side that overlap_comm hides. 1.0 is the ideal; the shaped-link
# runs on the CPU test hosts calibrate it there (benchmarks/steptime_shaped.py).
DEFAULT_OVERLAP = 1.0


def gpu_kind(name: str) -> GpuKind | None:
    """The table's entry for a GPU name (``H100``, ``NVIDIA H200``, ``a100-sxm4-80gb``...); None if unknown."""
    upper = name.upper()
    for key, kind in GPU_KINDS.items():
        if key in upper:
            return kind
    return None


def mfu_for(kind: GpuKind, loss_path: str) -> tuple[float, str]:
    """The MFU used for this kind and loss path, and where it comes from."""
    value = MFU_MEASURED.get((kind.name, loss_path))
    if value is not None:
        return value, f"measured ({kind.name}, loss {loss_path})"
    return DEFAULT_MFU, f"stated default (no measurement for {kind.name})"


@dataclass(frozen=True)
class StepTime:
    """One micro-step, predicted: its parts (seconds), the whole and what bounds it."""

    tokens: int  # per GPU per micro-step
    compute_s: float
    comm: CommTime
    overlap: float

    @property
    def comm_s(self) -> float:
        return self.comm.total_s

    @property
    def exposed_s(self) -> float:
        hidden_side = min(self.compute_s, self.comm_s)
        edges = self.comm.first_gather_s + self.comm.last_reduce_s if self.comm_s > 0 else 0.0
        return min(edges, hidden_side) + (1 - self.overlap) * max(0.0, hidden_side - edges)

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.comm_s) + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        """Per GPU."""
        return self.tokens / self.step_s

    @property
    def bound(self) -> str:
        """``compute`` or ``communication`` (the longer side)."""
        return "compute" if self.compute_s >= self.comm_s else "communication"

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
) -> StepTime:
    """The predicted micro-step of one GPU.

    ``flops_per_s``: what one GPU (or CPU rank) sustains on this model, MFU × peak
    (``compute_rate``); ``grad_numels``: the trained tensors (``None``: every weight; LoRA
    passes its adapters'). ``tokens`` is what one GPU processes per micro-step.
    """
    weights = shape.weight_numels()
    forward, backward = gathered_per_phase(
        module_blocks(shape, zero.persistence_threshold),
        checkpointing=checkpointing,
        max_reuse_distance=zero.max_reuse_distance,
    )
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
    compute = tokens * shape.flops_per_token(seq_len) / flops_per_s
    return StepTime(tokens=tokens, compute_s=compute, comm=comm, overlap=overlap)


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


def compute_rate(kind: GpuKind, loss_path: str) -> float:
    """FLOP/s one GPU of this kind sustains on the loss path: MFU × peak."""
    return mfu_for(kind, loss_path)[0] * kind.peak_flops


def break_even_tokens(step: StepTime) -> int:
    """Tokens per GPU per micro-step at which compute would equal this communication (T*).

    Communication does not grow with the micro-batch, compute does (in proportion).
    """
    per_token = step.compute_s / step.tokens
    return int(step.comm_s / per_token) + 1 if per_token > 0 else 0
