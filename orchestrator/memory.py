"""The memory planner: per-GPU and per-node host memory of a ZeRO-3 job, and the auto choice.

Pure: numbers in, numbers out. ``dzctl plan`` feeds it flags; the launch path feeds
it preflight's readings. No torch: every term is a formula over the model's shape,
each constant stated beside it with its reason.

The model (all sizes in bytes; N = parameters, W = GPUs in the job, T = tokens
per micro-batch = micro_batch_size × seq_len, P = bytes per bf16/fp16/fp32 value):

* Model states, partitioned over all W GPUs by ZeRO-3 (ZeRO paper, §5):
  parameters P·N/W, gradients P·N/W (DeepSpeed accumulates in the model dtype by
  default), fp32 master copy 4·N/W (mixed precision only) and Adam m, v 8·N/W.
  ``offload_optimizer`` moves master, Adam and gradients to host RAM; ``offload_param``
  moves the parameter partitions too.
* ZeRO-3 working set: the largest single weight gathered whole (for these models
  the embedding/LM head, gathered again for the backward), its full gradient before
  the reduce-scatter, the prefetch bucket and the gradient bucket, and the small
  parameters kept whole on every GPU (below the persistence threshold: norms, biases).
* Activations per layer per token, counted from what autograd saves in the HF
  Llama/Qwen layers with SDPA/flash attention (no seq² term): see
  ``layer_activation_bytes_per_token``. With gradient checkpointing only each layer's
  input is kept, plus one layer's activations during its recomputation.
* Logits at the loss: see ``logits_bytes_per_token``. At seq 4096 and a 152k
  vocabulary this is the largest activation term by far. A fused loss
  (``train.fused_loss``, orchestrator/fusedloss.py) never holds them: see
  ``loss_bytes``; ``liger`` also brings Liger's RMSNorm and SwiGLU, which keep less
  per layer (``kernels="liger"``).
* Peak = states + max(forward/backward transient, optimizer-step transient).

Pinned against measurements on 2×H200 (DESIGN §5; tests/test_memory.py); the
fit test then adds a stated allocator margin and the memory CUDA itself takes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from . import fusedloss
from .dsconfig import (
    NVME_MIN_BUFFER_ELEMENTS,
    NVME_OPTIMIZER_BUFFERS,
    NVME_PARAM_BUFFERS,
    NVME_SUB_GROUP_SIZE,
    Resolved,
    job_ds_config,
    load_user_config,
    merge,
    offload_of,
    resolve_precision,
)
from .errors import InputError
from .fusedloss import FusedLoss
from .modelshape import ModelShape, shape_for_job
from .spec import LoadedJob, LoraSpec

GIB = 1024**3

Precision = Literal["bf16", "fp16", "fp32"]
# nvme: ZeRO-Infinity, parameters and optimizer states swapped to a local NVMe disk.
Offload = Literal["none", "optimizer", "all", "nvme"]

# --- stated constants -------------------------------------------------------------

# PyTorch's caching allocator holds more than it hands out (fragmentation from the
# changing tensor sizes of the loss and the gathers). In the measured runs that fit,
# reserved exceeded peak allocated by 5–20 % (115.4 vs 95.8 GiB at micro-batch 4: an outside
# raw-engine figure, design notes §5, loop not in this repo); require that much headroom
# on top of the predicted peak. The trainer
# turns on expandable segments (train/environment.py), which cut that to 13 % at
# micro-batch 6 (127.2 vs 112.2 GiB; 137.9 without them); the margin is kept for jobs
# run with another allocator setting.
ALLOCATOR_MARGIN = 0.20
# GPU memory outside PyTorch's allocator, so never in max_memory_allocated: the CUDA
# context and module images (~0.5 GiB on Hopper with lazy loading), cuBLAS/cuBLASLt
# workspaces and NCCL's communicator buffers. A stated allowance, not a measurement.
NON_TORCH_GPU_GIB = 2.0
# Host RAM of one rank besides offloaded states: CPython, torch and CUDA host
# allocations, NCCL, DeepSpeed (its CPU Adam op), and the checkpoint shard being
# loaded (HF shards are ≤ 5 GB, read through mmap). A stated allowance.
RANK_HOST_GIB = 4.0
# Share of a node's RAM left to the OS, page cache, dockerd and the data loader.
HOST_RESERVE_FRACTION = 0.10
# DeepSpeed's default ZeRO-3 sub_group_size (elements): the optimizer steps one
# sub-group at a time, and offloaded fp32 gradients are pinned per sub-group.
SUB_GROUP_SIZE = 1_000_000_000
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
# Expected-throughput model used only to rank candidates that fit (never to predict
# tokens/s): time per token ∝ k + C / T, with k = 4/3 under gradient checkpointing
# (the forward is run twice: 4 passes of work instead of 3) and C the fixed cost of
# each micro-step, mostly ZeRO-3's two all-gathers and one reduce-scatter of all
# parameters, which do not grow with the micro-batch. From the outside raw-engine figures
# (design notes §5, loop not in this repo; checkpointing on: 5,806 tokens/s at micro 2,
# 6,511 at micro 4, seq 4096):
# (4/3 + C/8192) / (4/3 + C/16384) = 6511/5806 gives C ≈ 3,000 tokens.
# Checked later through the trainer: micro 5 and 6 ran 1.020× and 1.044× micro 4's
# throughput, where this model says 1.025× and 1.042×; with Liger, micro 12 and 20 ran
# 1.044× and 1.070× micro 6's (8,662 and 8,881 against 8,300; DESIGN §5), where it says
# 1.044× and 1.062×.
MICRO_STEP_COST_TOKENS = 3000.0
# Without checkpointing the same model with C = 3,000 is far too kind: it ranks micro 1
# without checkpointing 2 % behind micro 2 with it, measured 30 % behind (4,050 against
# 5,806 tokens/s/GPU, DESIGN §5), and with Liger micro 2 without it 6 % ahead of micro 6
# with it, measured 17 % behind (6,850 against 8,300). Fitting k = 1 to those two pairs
# gives C = 5,900 and 6,300 tokens: its own fixed cost, measured twice, rounded.
MICRO_STEP_COST_TOKENS_NO_CHECKPOINTING = 6000.0
RECOMPUTE_FACTOR = 4.0 / 3.0
# nodes tried when looking for the smallest number that would fit
MAX_NODES_SEARCHED = 512

OFFLOAD_ORDER: tuple[Offload, ...] = ("none", "optimizer", "all")  # fastest first


def bytes_per_value(precision: Precision) -> int:
    return 4 if precision == "fp32" else 2


def pinned_bytes(size: int) -> int:
    """Host RAM taken by one pinned tensor of ``size`` bytes.

    ``Tensor.pin_memory()`` goes through PyTorch's CachingHostAllocator, which rounds
    every block up to the next power of two (pytorch/pytorch#95823; measured again on
    torch 2.11 in vllm-project/vllm#53042: a 2.08 GiB request takes 4 GiB). DeepSpeed
    pins its offload buffers that way.
    """
    return 0 if size <= 0 else 1 << (size - 1).bit_length()


Kernels = Literal["hf", "liger"]


def norm_bytes_per_token(width: int, act: int, *, weighted_output_saved: bool, kernels: Kernels = "hf") -> int:
    """What one RMSNorm leaves saved per token over ``width`` values.

    HF's upcasts to fp32 (kept for the variance's backward; in fp32 that is the input
    itself), keeps an fp32 1/rms per row, and keeps its normalised output in the
    activation dtype (for the weight's gradient). Liger's (ops/rms_norm.py, 0.8) keeps
    only its input in the activation dtype and the fp32 1/rms. When a linear layer
    reads the weighted output, that linear keeps the weighted output as well.
    """
    kept = act if kernels == "liger" else 4 + act
    return (kept + (act if weighted_output_saved else 0)) * width + 4


def layer_activation_bytes_per_token(shape: ModelShape, act: int, kernels: Kernels = "hf") -> int:
    """Bytes autograd keeps per token for one decoder layer without checkpointing.

    ``act`` = bytes of the activation dtype. Counted from the HF Llama/Qwen layers
    (and checked against torch's saved-tensor hooks in tests/test_memory.py):
    * input and post-attention RMSNorm: each feeds linears (see ``norm_bytes_per_token``);
    * Qwen3's q_norm and k_norm per head: their output goes through RoPE, which keeps
      only cos/sin (shared by all layers), not its input;
    * SDPA/flash attention keeps q and k after RoPE and v (GQA: k, v are kv_dim wide),
      its output, and an fp32 log-sum-exp per head and token; o_proj reads that output
      as a view (flash layouts are already token-major), so keeps no copy;
    * the SwiGLU MLP keeps gate, SiLU(gate), up and their product (intermediate wide);
      Liger's SwiGLU keeps gate and up and recomputes SiLU in the backward (ops/swiglu.py);
    * residual adds and biases keep nothing.
    With ``kernels="liger"`` (``train.fused_loss: liger``) the norms and the MLP are
    Liger's; its RoPE, like HF's, keeps only cos/sin.
    """
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    total = 2 * norm_bytes_per_token(h, act, weighted_output_saved=True, kernels=kernels)
    if shape.qk_norm:
        total += norm_bytes_per_token(shape.head_dim, act, weighted_output_saved=False, kernels=kernels) * (
            shape.num_heads + shape.num_kv_heads
        )
    total += act * (q + 2 * kv)  # q, k, v saved by attention
    total += act * q + 4 * shape.num_heads  # attention output + log-sum-exp
    total += (3 if kernels == "liger" else 4) * act * i  # gate, [silu(gate),] up, product
    return total


def logits_bytes_per_token(shape: ModelShape, act: int) -> int:
    """Bytes per token live at the loss's backward, when the logits cost most.

    The logits in the activation dtype (held as the model's output), the fp32
    log-softmax that cross-entropy saves (transformers upcasts logits to fp32 for the
    loss), the fp32 gradient of the logits, and that gradient cast back to the
    activation dtype for the LM head's backward (no cast in fp32).
    """
    v = shape.vocab_size
    return act * v + 4 * v + 4 * v + (act * v if act < 4 else 0)


def loss_bytes(shape: ModelShape, act: int, tokens: int, fused_loss: FusedLoss) -> int:
    """Bytes live at the loss's most expensive moment, beyond the final norm's saved tensors.

    * ``none``: the logits (``logits_bytes_per_token``) of every token.
    * ``liger``: the fused linear cross-entropy computes its gradients in the forward
      (ops/fused_linear_cross_entropy.py, 0.8): the hidden states' gradient (activation
      dtype), an fp32 loss per token and the target mask, and one chunk's logits in
      the activation dtype (the cross-entropy kernel writes their gradient in place).
      Its full ``lm_head`` gradient is the "its grad" of the gathered-layer term.
    * ``chunked`` (orchestrator/train/loss.py): at its backward, the hidden states'
      gradient, an fp32 log-sum-exp per token, and for one chunk the logits in the
      activation dtype, their fp32 copy turned into the gradient in place and that
      gradient cast back; the ``lm_head`` gradient is again the gathered-layer term.
    """
    h, v = shape.hidden_size, shape.vocab_size
    if fused_loss == "liger":
        chunk = fusedloss.liger_chunk_tokens(tokens, v, h)
        return (act * h + 4 + 1) * tokens + act * v * chunk
    if fused_loss == "chunked":
        chunk = fusedloss.chunk_tokens(tokens, v, h)
        return (act * h + 4) * tokens + (act + 4 + act) * v * chunk
    return logits_bytes_per_token(shape, act) * tokens


@dataclass(frozen=True)
class Buckets:
    """ZeRO-3 communication sizes in elements, from the hidden size (dsconfig.bucket_sizes)."""

    reduce: int
    prefetch: int
    persistence: int

    @classmethod
    def for_hidden(cls, hidden: int) -> Buckets:
        # The HF integration's rule for "auto" (transformers/integrations/deepspeed.py):
        # hidden², 0.9·hidden², 10·hidden: about one weight matrix per bucket.
        return cls(hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)


@dataclass(frozen=True)
class Choice:
    micro_batch_size: int
    gradient_checkpointing: bool
    offload: Offload

    @property
    def offload_optimizer(self) -> bool:
        return self.offload in ("optimizer", "all", "nvme")

    @property
    def offload_param(self) -> bool:
        return self.offload in ("all", "nvme")


@dataclass(frozen=True)
class Estimate:
    """Predicted peak per GPU and host RAM per rank, each term shown (bytes)."""

    choice: Choice
    gpu_terms: dict[str, int]  # every term of the per-GPU peak (allocated by PyTorch)
    peak_phase: str  # "forward/backward" or "optimizer step"
    host_terms_per_rank: dict[str, int]
    nvme_terms_per_rank: dict[str, int] = field(default_factory=dict)  # bytes on the NVMe disk (offload nvme)
    trainable_params: int = 0  # all parameters for full fine-tuning, the adapters for LoRA
    method: str = "full"  # or "lora"

    @property
    def nvme_per_rank(self) -> int:
        return sum(self.nvme_terms_per_rank.values())

    @property
    def gpu_peak(self) -> int:
        return sum(self.gpu_terms.values())

    @property
    def gpu_required(self) -> float:
        """Bytes a GPU must have for this to run: peak plus allocator margin plus non-PyTorch memory."""
        return self.gpu_peak * (1 + ALLOCATOR_MARGIN) + NON_TORCH_GPU_GIB * GIB

    @property
    def host_per_rank(self) -> int:
        return sum(self.host_terms_per_rank.values())


def estimate(
    shape: ModelShape,
    choice: Choice,
    *,
    seq_len: int,
    precision: Precision,
    world_size: int,
    buckets: Buckets | None = None,
    fused_loss: FusedLoss = "none",
    lora: LoraShape | None = None,
) -> Estimate:
    """Predicted peak ``torch.cuda.max_memory_allocated`` per GPU, and host RAM per rank.

    ``lora``: only adapters train (``train.method: lora``); the base weights stay
    partitioned in the model dtype and have no gradients, master copies or Adam states.
    """
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    b = buckets or Buckets.for_hidden(shape.hidden_size)
    p = bytes_per_value(precision)
    g = p  # DeepSpeed's grad_accum_dtype defaults to the model dtype
    n = shape.total_params
    shard = math.ceil(n / world_size)
    # What has gradients and optimizer states: everything, or the adapters (partitioned too).
    trainable = lora.adapter_params(shape) if lora else n
    tshard = math.ceil(trainable / world_size)
    master = 4 if p < 4 else 0  # fp32 master weights exist only in mixed precision
    adam = 8  # Adam's m and v in fp32

    gpu: dict[str, int] = {}
    host: dict[str, int] = {}
    # ZeRO-3 model states
    if choice.offload == "nvme":
        host.update(nvme_host_buffers(shape, p, tshard))
    elif choice.offload_param:
        host["params (pinned)"] = pinned_bytes(p * shard)
        # zero.Init first pins each parameter's partition on its own (partition_parameters.py),
        # then ZeRO-3 copies them into the flat buffer above; the freed pinned blocks stay
        # in PyTorch's caching host allocator, each rounded up to a power of two.
        host["per-tensor pinned partitions (zero.Init)"] = sum(
            pinned_bytes(p * math.ceil(numel / world_size))
            for numel in shape.weight_numels()
            if numel > b.persistence  # small ones persist on the GPU
        )
    else:
        gpu["params"] = p * shard
    if choice.offload == "nvme":
        host["grads (pinned)"] = pinned_bytes(g * tshard)
    elif choice.offload_optimizer:
        host["grads (pinned)"] = pinned_bytes(g * tshard)
        host["fp32 master + Adam m,v"] = (master + adam) * tshard
        # CPU Adam steps on fp32 gradients, pinned per sub-group.
        groups, last = divmod(tshard, SUB_GROUP_SIZE)
        host["fp32 grads (pinned)"] = groups * pinned_bytes(4 * SUB_GROUP_SIZE) + pinned_bytes(4 * last)
    else:
        gpu["grads"] = g * tshard
        gpu["fp32 master + Adam m,v"] = (master + adam) * tshard
    host["process"] = int(RANK_HOST_GIB * GIB)
    gpu["persistent small params"] = p * shape.num_layers * shape.small_params_per_layer
    # ZeRO-3 working set: one whole weight, its whole gradient, the buckets.
    if lora:
        # The frozen weight is gathered again for the backward (for its input's gradient), but has none.
        gpu["gathered largest layer"] = p * shape.largest_layer_params
        gpu["prefetch + reduce buckets"] = p * b.prefetch + g * min(b.reduce, trainable)
    else:
        gpu["gathered largest layer + its grad"] = (p + g) * shape.largest_layer_params
        gpu["prefetch + reduce buckets"] = p * b.prefetch + g * b.reduce

    tokens = choice.micro_batch_size * seq_len
    act = p
    kernels: Kernels = "liger" if fused_loss == "liger" else "hf"
    full_layer = layer_activation_bytes_per_token(shape, act, kernels) * tokens
    if lora:
        full_layer += lora.activation_bytes_per_token(shape, act) * tokens
    # A fused loss keeps the final norm's output itself (chunked) or not at all (Liger computes
    # its gradients in the forward): either way no LM head keeps a second copy.
    final_norm = (
        norm_bytes_per_token(shape.hidden_size, act, weighted_output_saved=fused_loss != "liger", kernels=kernels)
        * tokens
    )
    logits = loss_bytes(shape, act, tokens, fused_loss)
    if choice.gradient_checkpointing:
        kept = shape.num_layers * act * shape.hidden_size * tokens
        # During a layer's recomputation its full activations and the incoming gradient
        # exist, but by then the logits are freed: the larger of the two moments counts.
        recompute = full_layer + 2 * act * shape.hidden_size * tokens
        train_terms = {
            "activations (checkpoints)": kept + final_norm,
            "logits + loss": max(logits, recompute),
        }
    else:
        train_terms = {
            "activations (all layers)": shape.num_layers * full_layer + final_norm,
            "logits + loss": logits,
        }
    # Optimizer step: activations are gone; the fp32 gradient of one sub-group is made
    # and torch's multi-tensor AdamW needs about one more such buffer of temporaries.
    step = 0 if choice.offload_optimizer else 2 * 4 * min(tshard, SUB_GROUP_SIZE)
    if sum(train_terms.values()) >= step:
        gpu.update(train_terms)
        phase = "forward/backward"
    else:
        gpu["optimizer step temporaries"] = step
        phase = "optimizer step"
    nvme = nvme_disk_terms(p, shard, tshard, master=master) if choice.offload == "nvme" else {}
    return Estimate(
        choice=choice,
        gpu_terms=gpu,
        peak_phase=phase,
        host_terms_per_rank=host,
        nvme_terms_per_rank=nvme,
        trainable_params=trainable,
        method="lora" if lora else "full",
    )


# --- LoRA -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraShape:
    """What of ``train.lora`` decides memory: the rank, the adapted modules, dropout."""

    r: int
    target_modules: tuple[str, ...]
    dropout: float

    @classmethod
    def from_spec(cls, spec: LoraSpec) -> LoraShape:
        return cls(spec.r, tuple(spec.target_modules), spec.dropout)

    @staticmethod
    def module_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
        """(in, out) features of each Llama/Qwen projection, by its HF module name."""
        h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def adapted(self, shape: ModelShape) -> dict[str, tuple[int, int]]:
        sizes = self.module_sizes(shape)
        return {name: sizes[name] for name in self.target_modules if name in sizes}

    def adapter_params(self, shape: ModelShape) -> int:
        """A (r × in) and B (out × r) on every adapted projection of every layer."""
        return shape.num_layers * sum(self.r * (fan_in + fan_out) for fan_in, fan_out in self.adapted(shape).values())

    def activation_bytes_per_token(self, shape: ModelShape, act: int) -> int:
        """What the adapters add to a layer's saved activations, per token.

        Each adapter keeps its own dropout output (the input of A: ``in`` wide) and the
        dropout mask (one byte a value), and A's output (``r`` wide, B's input). Without
        dropout A reads the layer's input, which the base linear keeps already.
        """
        total = 0
        for fan_in, _ in self.adapted(shape).values():
            if self.dropout > 0:
                total += (act + 1) * fan_in
            total += act * self.r
        return total


# --- NVMe offload (ZeRO-Infinity) -------------------------------------------------------


def nvme_host_buffers(shape: ModelShape, p: int, tshard: int) -> dict[str, int]:
    """Pinned host buffers DeepSpeed swaps NVMe data through (dsconfig.nvme_sections sets their sizes)."""
    param_buffer = max(NVME_MIN_BUFFER_ELEMENTS, shape.largest_layer_params)
    return {
        "NVMe parameter swap buffers (pinned)": pinned_bytes(NVME_PARAM_BUFFERS * param_buffer * p),
        # One fp32 sub-group per buffer: the master weights, m and v being stepped.
        "NVMe optimizer swap buffers (pinned)": pinned_bytes(
            NVME_OPTIMIZER_BUFFERS * min(NVME_SUB_GROUP_SIZE, tshard) * 4
        ),
    }


def nvme_disk_terms(p: int, shard: int, tshard: int, *, master: int) -> dict[str, int]:
    """Bytes one rank keeps on the NVMe disk: its parameter partition and its optimizer states."""
    return {
        "params": p * shard,
        "fp32 master + Adam m,v": (master + 8) * tshard,
        "fp32 grads": 4 * tshard,
    }


@dataclass(frozen=True)
class NvmeReading:
    """What preflight found at ``zero.nvme_path``: the smallest free space and bandwidths over the nodes."""

    free_bytes: int
    read_bytes_per_s: float
    write_bytes_per_s: float


def nvme_io_per_step(est: Estimate, *, accumulation: int) -> tuple[int, int]:
    """(bytes read, bytes written) on one rank's NVMe share per optimizer step.

    Every micro-step reads the parameter partition for the forward, again for the
    backward, and once more for the recomputation under gradient checkpointing (direct
    I/O: no page cache in between). The optimizer step reads the fp32 master, Adam m, v
    and gradients of every sub-group and writes them back; full fine-tuning writes the
    updated bf16 partition too (LoRA's base never changes). The gradients are written
    once, during the backward.
    """
    disk = est.nvme_terms_per_rank
    if not disk:
        return 0, 0
    passes = 3 if est.choice.gradient_checkpointing else 2
    states, grads = disk["fp32 master + Adam m,v"], disk["fp32 grads"]
    read = accumulation * passes * disk["params"] + states + grads
    written = states + grads + (disk["params"] if est.method == "full" else 0)
    return read, written


def nvme_step_seconds(est: Estimate, reading: NvmeReading, *, ranks_per_node: int, accumulation: int) -> float:
    """Time one optimizer step spends in NVMe I/O on a node whose ranks share the disk.

    A floor under the step time, not a prediction of all of it: DeepSpeed overlaps some
    I/O with compute, and compute adds its own time. Where the I/O is far larger than
    the compute (the usual case for NVMe offload), the step takes about this long.
    """
    read, written = nvme_io_per_step(est, accumulation=accumulation)
    return ranks_per_node * (read / reading.read_bytes_per_s + written / reading.write_bytes_per_s)


# --- the plan ----------------------------------------------------------------------


class DoesNotFit(InputError):
    """No configuration the spec allows fits the given nodes. Exit code 2.

    Bad input rather than a runtime failure: nothing ran and nothing on the hosts
    failed; the job as written asks more of these nodes than they have, and only a
    change to the job or the hostfile (more nodes, shorter sequences, offload) helps.
    """


@dataclass(frozen=True)
class Hardware:
    """What the nodes offer: GPUs (slots) per node, memory per GPU and host RAM per node (GiB)."""

    slots_per_node: tuple[int, ...]
    gpu_mem_gib: float | None  # None: not known (accelerator cpu)
    host_mem_gib: float | None  # None: not known; offload cannot be checked
    # What preflight measured at zero.nvme_path (None: not measured, or not usable there).
    nvme: NvmeReading | None = None

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
    fused_loss: FusedLoss = "none"  # train.fused_loss, resolved (orchestrator/fusedloss.py)
    nvme_path: str | None = None  # zero.nvme_path, for a plan that offloads to NVMe
    # Full fine-tuning that does not fit: the LoRA plan (the job's train.lora) that would.
    lora_alternative: MemoryPlan | None = None
    lora: LoraShape | None = None  # train.method: lora
    largest_layer_params: int = 0  # sizes DeepSpeed's NVMe parameter swap buffers

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
        )

    def to_dict(self, ds_config: dict[str, Any] | None) -> dict[str, Any]:
        """The ``dzctl plan --json`` object (DESIGN §2)."""
        est = self.estimate
        hw = self.hardware
        return {
            "fits": self.fits,
            "per_gpu_gib": _gib(est.gpu_peak),
            "per_gpu_required_gib": _gib(est.gpu_required),
            "host_per_node_gib": _gib(max(self.host_per_node)),
            "breakdown": {
                "gpu": {k: _gib(v) for k, v in est.gpu_terms.items()},
                "gpu_peak_phase": est.peak_phase,
                # what the "logits + loss" term is made of
                "fused_loss": self.fused_loss,
                "allocator_margin_fraction": ALLOCATOR_MARGIN,
                "non_torch_gpu_gib": NON_TORCH_GPU_GIB,
                "host_per_rank": {k: _gib(v) for k, v in est.host_terms_per_rank.items()},
                "host_reserve_fraction": HOST_RESERVE_FRACTION,
            },
            "micro_batch_size": self.choice.micro_batch_size,
            "gradient_checkpointing": self.choice.gradient_checkpointing,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "train_batch_size": self.train_batch_size,
            "zero": {"offload_optimizer": self.choice.offload_optimizer, "offload_param": self.choice.offload_param},
            "offload": self.choice.offload,  # none | optimizer | all (host RAM) | nvme
            "method": self.estimate.method,
            "trainable_params": self.estimate.trainable_params,
            "nvme": self._nvme_dict(),
            "lora_alternative": self._alternative_dict(),
            "precision": self.precision,
            "fused_loss": self.fused_loss,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "gpu_mem_gib": hw.gpu_mem_gib,
            "host_mem_gib": hw.host_mem_gib,
            "host_per_node_gib_each": [_gib(x) for x in self.host_per_node],
            "reason": self.reason or None,
            "min_nodes": self.min_nodes,
            "notes": list(self.notes),
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
            "per_rank_gib": {k: _gib(v) for k, v in est.nvme_terms_per_rank.items()},
            "per_node_gib": _gib(ranks * est.nvme_per_rank),
            "free_gib": _gib(reading.free_bytes) if reading else None,
            "read_gib_per_step_per_node": _gib(ranks * read),
            "written_gib_per_step_per_node": _gib(ranks * written),
            "read_mib_s": round(reading.read_bytes_per_s / 2**20, 1) if reading else None,
            "write_mib_s": round(reading.write_bytes_per_s / 2**20, 1) if reading else None,
            "expected_io_s_per_step": round(self.nvme_step_s, 2) if self.nvme_step_s is not None else None,
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
            "per_gpu_required_gib": _gib(alt.estimate.gpu_required),
            "host_per_node_gib": _gib(max(alt.host_per_node)),
        }


def lora_sets(lora: LoraShape) -> str:
    """The ``--set`` that turns a job into this LoRA configuration (defaults left out)."""
    default = LoraSpec()
    sets = ["train.method=lora"]
    if lora.r != default.r:
        sets.append(f"train.lora.r={lora.r}")
    if list(lora.target_modules) != default.target_modules:
        sets.append(f"train.lora.target_modules=[{','.join(lora.target_modules)}]")
    return " ".join(f"--set {item}" for item in sets)


def _gib(value: float) -> float:
    return round(value / GIB, 2)


@dataclass(frozen=True)
class Allowed:
    """What the spec leaves to the planner: ``None`` = auto."""

    micro_batch_size: int | None = None
    gradient_checkpointing: bool | None = None
    offload: Offload | None = None
    nvme: bool = False  # the job names zero.nvme_path: auto may offload there, last

    def offloads(self, accelerator: str, nvme_usable: bool = False) -> tuple[Offload, ...]:
        if self.offload is not None:
            return (self.offload,)
        # Offloading to host RAM from a CPU rank moves nothing anywhere.
        if accelerator == "cpu":
            return ("none",)
        # NVMe only after host RAM, and only where preflight found the path usable.
        return OFFLOAD_ORDER + (("nvme",) if self.nvme and nvme_usable else ())

    def checkpointing(self) -> tuple[bool, ...]:
        return (self.gradient_checkpointing,) if self.gradient_checkpointing is not None else (True, False)

    def micro_batches(self) -> tuple[int, ...]:
        return (self.micro_batch_size,) if self.micro_batch_size is not None else AUTO_MICRO_BATCHES

    def choices(self, offload: Offload) -> list[Choice]:
        return [Choice(m, c, offload) for c in self.checkpointing() for m in self.micro_batches()]

    def least_choices(self, offload: Offload) -> list[Choice]:
        """The smallest allowed micro-batch per checkpointing setting: if none of these fits, nothing does."""
        return [Choice(min(self.micro_batches()), c, offload) for c in self.checkpointing()]


def expected_cost_per_token(choice: Choice, seq_len: int) -> float:
    """Relative time per token (lower is faster); ranks candidates of one offload level."""
    if choice.gradient_checkpointing:
        k, fixed = RECOMPUTE_FACTOR, MICRO_STEP_COST_TOKENS
    else:
        k, fixed = 1.0, MICRO_STEP_COST_TOKENS_NO_CHECKPOINTING
    return k + fixed / (choice.micro_batch_size * seq_len)


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
) -> MemoryPlan:
    """Choose the fastest configuration that fits (or evaluate the one the spec fixes).

    Order: no offload, then optimizer offload, then full offload (each step costs
    far more throughput than any micro-batch or checkpointing choice: 27× measured for
    full offload, DESIGN §5); within one offload level the candidate with the lowest
    ``expected_cost_per_token``, i.e. the largest micro-batch that fits, with
    checkpointing off only where that wins. The user's gradient_accumulation_steps is
    kept as written, so train_batch_size = micro × accumulation × world.
    """
    buckets = Buckets.for_hidden(shape.hidden_size)
    tried: list[tuple[Choice, bool, str]] = []
    best: tuple[float, Estimate] | None = None
    for offload in allowed.offloads(accelerator, hardware.nvme is not None):
        too_big: set[bool] = set()  # checkpointing settings whose micro-batch search has ended
        for choice in allowed.choices(offload):
            if choice.gradient_checkpointing in too_big:
                continue
            est = estimate(
                shape,
                choice,
                seq_len=seq_len,
                precision=precision,
                world_size=hardware.world_size,
                fused_loss=fused_loss,
                lora=lora,
            )
            ok, why = _fits(est, hardware, accelerator)
            tried.append((choice, ok, why))
            if ok:
                cost = expected_cost_per_token(choice, seq_len)
                if best is None or cost < best[0]:
                    best = (cost, est)
            else:
                # The peak only grows with the micro-batch: no larger one fits either.
                too_big.add(choice.gradient_checkpointing)
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
    )
    if best is not None:
        est = best[1]
        return MemoryPlan(fits=True, estimate=est, host_per_node=_host_per_node(est, hardware, accelerator), **common)
    # Nothing fits: report the least demanding candidate, and how many such nodes would do.
    least = _least_demanding(shape, allowed, seq_len, precision, hardware, accelerator, fused_loss, lora)
    reason = _fits(least, hardware, accelerator)[1]
    return MemoryPlan(
        fits=False,
        estimate=least,
        host_per_node=_host_per_node(least, hardware, accelerator),
        reason=reason,
        min_nodes=smallest_fitting_nodes(shape, allowed, seq_len, precision, hardware, accelerator, fused_loss, lora),
        **common,
    )


def _host_per_node(est: Estimate, hardware: Hardware, accelerator: str) -> tuple[int, ...]:
    per_rank = est.host_per_rank + (est.gpu_peak if accelerator == "cpu" else 0)
    return tuple(slots * per_rank for slots in hardware.slots_per_node)


def _fits(est: Estimate, hardware: Hardware, accelerator: str) -> tuple[bool, str]:
    if accelerator == "cpu":
        # CPU ranks keep everything in host RAM: the "GPU" terms live there too.
        if hardware.host_mem_gib is None:
            return True, ""
        need = max(hardware.slots_per_node) * (est.gpu_peak + est.host_per_rank)
        have = hardware.host_mem_gib * GIB * (1 - HOST_RESERVE_FRACTION)
        return (need <= have, "" if need <= have else f"host RAM: needs {_gib(need)} GiB per node, has {_gib(have)}")
    reasons = []
    if hardware.gpu_mem_gib is not None and est.gpu_required > hardware.gpu_mem_gib * GIB:
        reasons.append(
            f"GPU: needs {_gib(est.gpu_required)} GiB per GPU (peak {_gib(est.gpu_peak)} GiB "
            f"+ {ALLOCATOR_MARGIN:.0%} allocator margin + {NON_TORCH_GPU_GIB} GiB CUDA/NCCL), "
            f"has {hardware.gpu_mem_gib} GiB"
        )
    if hardware.host_mem_gib is not None:
        need = max(hardware.slots_per_node) * est.host_per_rank
        have = hardware.host_mem_gib * GIB * (1 - HOST_RESERVE_FRACTION)
        if need > have:
            reasons.append(
                f"host RAM: needs {_gib(need)} GiB per node ({max(hardware.slots_per_node)} ranks × "
                f"{_gib(est.host_per_rank)} GiB), has {_gib(have)} GiB usable of {hardware.host_mem_gib} "
                f"({HOST_RESERVE_FRACTION:.0%} left to the OS)"
            )
    if est.nvme_terms_per_rank and hardware.nvme is not None:
        need = max(hardware.slots_per_node) * est.nvme_per_rank
        if need > hardware.nvme.free_bytes:
            reasons.append(
                f"NVMe: needs {_gib(need)} GiB per node at zero.nvme_path, "
                f"has {_gib(hardware.nvme.free_bytes)} GiB free"
            )
    return not reasons, "; ".join(reasons)


def _least_demanding(
    shape: ModelShape,
    allowed: Allowed,
    seq_len: int,
    precision: Precision,
    hardware: Hardware,
    accelerator: str,
    fused_loss: FusedLoss = "none",
    lora: LoraShape | None = None,
) -> Estimate:
    """The allowed candidate closest to fitting: smallest overshoot of GPU or host memory."""

    def overshoot(est: Estimate) -> float:
        over = 0.0
        if hardware.gpu_mem_gib is not None and accelerator != "cpu":
            over = max(over, est.gpu_required / (hardware.gpu_mem_gib * GIB))
        if hardware.host_mem_gib is not None:
            per_node = max(hardware.slots_per_node) * (
                est.host_per_rank + (est.gpu_peak if accelerator == "cpu" else 0)
            )
            over = max(over, per_node / (hardware.host_mem_gib * GIB * (1 - HOST_RESERVE_FRACTION)))
        return over

    options = [
        estimate(
            shape,
            choice,
            seq_len=seq_len,
            precision=precision,
            world_size=hardware.world_size,
            fused_loss=fused_loss,
            lora=lora,
        )
        for offload in allowed.offloads(accelerator, hardware.nvme is not None)
        for choice in allowed.least_choices(offload)
    ]
    return min(options, key=overshoot)


def smallest_fitting_nodes(
    shape: ModelShape,
    allowed: Allowed,
    seq_len: int,
    precision: Precision,
    hardware: Hardware,
    accelerator: str,
    fused_loss: FusedLoss = "none",
    lora: LoraShape | None = None,
) -> int | None:
    """The fewest nodes like these (same GPUs per node as the smallest node) on which a candidate fits.

    ``None`` when no number of nodes helps: what does not shrink with more GPUs
    (activations, logits, the gathered layer) is already too large.
    """
    per_node = min(hardware.slots_per_node)
    for count in range(len(hardware.slots_per_node) + 1, MAX_NODES_SEARCHED + 1):
        bigger = replace(hardware, slots_per_node=(per_node,) * count)
        for offload in allowed.offloads(accelerator, hardware.nvme is not None):
            for choice in allowed.least_choices(offload):
                est = estimate(
                    shape,
                    choice,
                    seq_len=seq_len,
                    precision=precision,
                    world_size=bigger.world_size,
                    fused_loss=fused_loss,
                    lora=lora,
                )
                if _fits(est, bigger, accelerator)[0]:
                    return count
    return None


def _notes(hardware: Hardware, accelerator: str) -> tuple[str, ...]:
    notes = []
    if hardware.host_mem_gib is None:
        notes.append("host RAM not known: offloaded states were not checked against it (give --host-mem-gib)")
    if accelerator != "cpu" and hardware.gpu_mem_gib is None:
        notes.append("GPU memory not known: nothing was checked against it (give --gpu-mem-gib)")
    return tuple(notes)


def describe_fit_failure(plan: MemoryPlan, nodes_desc: str) -> str:
    """The message of a ``DoesNotFit``: what the job needs, what the nodes have, what would do."""
    est = plan.estimate
    c = est.choice
    ranks = max(plan.hardware.slots_per_node)
    lines = [
        f"the job does not fit on {nodes_desc}: {plan.reason}",
        f"least demanding allowed setup: micro-batch {c.micro_batch_size}, gradient checkpointing "
        f"{'on' if c.gradient_checkpointing else 'off'}, offload {c.offload}, seq {plan.seq_len}, {plan.precision}: "
        f"{_gib(est.gpu_required)} GiB per GPU (peak {_gib(est.gpu_peak)} + margins), "
        f"{_gib(ranks * est.host_per_rank)} GiB host RAM per node",
    ]
    if plan.min_nodes is not None:
        per = min(plan.hardware.slots_per_node)
        lines.append(f"smallest number of such nodes ({per} GPUs each) that would fit: {plan.min_nodes}")
    else:
        lines.append(
            f"no number of such nodes (up to {MAX_NODES_SEARCHED}) fits: activations, logits and the gathered "
            "layer do not shrink with more GPUs"
        )
    alt = plan.lora_alternative
    if alt is not None and alt.lora is not None:
        a, ac = alt.estimate, alt.choice
        lines.append(
            f"LoRA would fit on these nodes ({lora_sets(alt.lora)}: r {alt.lora.r} on "
            f"{', '.join(alt.lora.target_modules)}, {a.trainable_params / 1e6:.1f} M trainable parameters): "
            f"micro-batch {ac.micro_batch_size}, "
            f"gradient checkpointing {'on' if ac.gradient_checkpointing else 'off'}, "
            f"offload {ac.offload}: {_gib(a.gpu_required)} GiB per GPU (peak {_gib(a.gpu_peak)} + margins), "
            f"{_gib(max(alt.host_per_node))} GiB host RAM per node"
        )
    return "\n".join(lines)


def fit_fix(plan: MemoryPlan) -> str:
    gpu_short = "GPU:" in plan.reason
    more = "GPU memory" if gpu_short else "host RAM"
    if plan.min_nodes is not None:
        shorter = "; or shorten train.max_seq_len" if gpu_short else ""
        fix = f"use {plan.min_nodes} such nodes, or nodes with more {more}{shorter}"
    else:
        fix = (
            "lower train.max_seq_len, allow gradient checkpointing (train.gradient_checkpointing: auto), "
            "or use GPUs with more memory"
        )
    if plan.lora_alternative is not None and plan.lora_alternative.lora is not None:
        # Never chosen on its own (it changes what is trained): named, with its numbers above.
        fix += f"; or train LoRA adapters instead of all weights: {lora_sets(plan.lora_alternative.lora)}"
    return fix


def require_fit(plan: MemoryPlan, nodes_desc: str) -> None:
    """Raise ``DoesNotFit`` unless the plan fits: the launch path calls this before touching hosts."""
    if not plan.fits:
        raise DoesNotFit(describe_fit_failure(plan, nodes_desc), fix=fit_fix(plan))


def nodes_description(slots_per_node: Sequence[int], gpu_mem_gib: float | None, host_mem_gib: float | None) -> str:
    count = len(slots_per_node)
    gpus = "/".join(str(s) for s in sorted(set(slots_per_node)))
    parts = [f"{count} node(s) × {gpus} GPU(s)"]
    if gpu_mem_gib is not None:
        parts.append(f"{gpu_mem_gib} GiB per GPU")
    if host_mem_gib is not None:
        parts.append(f"{host_mem_gib} GiB host RAM per node")
    return ", ".join(parts)


# --- from a job ------------------------------------------------------------------


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
