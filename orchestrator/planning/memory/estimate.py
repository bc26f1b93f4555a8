"""The memory planner: per-GPU and per-node host memory of a ZeRO-3 job, and the auto choice.

Pure: numbers in, numbers out. ``dzctl plan`` feeds it flags; the launch path feeds
it preflight's readings. No torch: every term is a formula over the model's shape,
each constant stated beside it with its reason.

The model (all sizes in bytes; N = parameters, W = GPUs in the job, T = tokens
per micro-batch = micro_batch_size × seq_len, P = bytes per bf16/fp16/fp32 value):

* Model states, partitioned over all W GPUs by ZeRO-3 (ZeRO paper, §5):
  parameters P·N/W, gradients P·N/W (DeepSpeed accumulates in the model dtype by
  default), fp32 master copy 4·N/W (mixed precision only) and Adam m, v 8·N/W; with
  ``train.pure_bf16`` a bf16 master copy 2·N/W and Adam m, v 4·N/W (``OptimizerStates``).
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
  (``train.fused_loss``, orchestrator/planning/fusedloss.py) never holds them: see
  ``loss_bytes``; ``liger`` also brings Liger's RMSNorm and SwiGLU, which keep less
  per layer (``kernels="liger"``).
* Peak = states + max(forward/backward transient, optimizer-step transient).

Pinned against measurements on 2×H200 (DESIGN §5; tests/test_memory.py); the
fit test then adds a stated allocator margin and the memory CUDA itself takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ...spec.job import LoraSpec
from .. import fusedloss
from ..dsconfig import NVME_MIN_BUFFER_ELEMENTS, NVME_OPTIMIZER_BUFFERS, NVME_PARAM_BUFFERS, NVME_SUB_GROUP_SIZE
from ..fusedloss import FusedLoss
from ..shape import ModelShape
from ..speed.communication import hpz_secondary_bytes

GIB = 1024**3


Precision = Literal["bf16", "fp16", "fp32"]


# nvme: ZeRO-Infinity, parameters and optimizer states swapped to a local NVMe disk.
Offload = Literal["none", "optimizer", "all", "nvme"]


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


# Training data (orchestrator/train/data/): each rank maps the node's cache read-only, so its
# own (private) memory for the data is what a micro-batch decodes plus the index pages only it
# touched; benchmarks/results/data-scale-20261202 measured at most 0.03 GiB more per rank at
# 1 M rows than at 1 k. The allowance keeps a margin for long runs touching more pages.
DATA_RANK_PRIVATE_GIB = 0.25
# The node's builder (local rank 0, before the model loads) at its peak: the rank itself
# (bounded by streaming; measured 0.48 GiB at 1 M rows, the bar is 2 GiB) and each
# worker of its pool (measured 0.08 GiB a worker; 0.15 for longer rows and larger
# tokenizers), at most data/build.py's MAX_WORKERS.
DATA_BUILDER_GIB = 2.0
DATA_WORKER_GIB = 0.15
DATA_MAX_WORKERS = 32
# The mapped cache's pages, counted once per node (page cache): ids of 2 or 4 bytes for
# tokens of 1 to 4 characters, at most about twice the bytes of the data files.
DATA_CACHE_BYTES_PER_DATA_BYTE = 2.0


def data_node_terms(shipped_bytes: int | None) -> dict[str, int]:
    """Host RAM per node for the data, counted once per node (not per rank)."""
    terms = {
        "data builder (local rank 0 + its workers, before the model loads)": int(
            (DATA_BUILDER_GIB + DATA_MAX_WORKERS * DATA_WORKER_GIB) * GIB
        )
    }
    if shipped_bytes:
        terms["data cache pages (page cache, once per node)"] = int(shipped_bytes * DATA_CACHE_BYTES_PER_DATA_BYTE)
    return terms


# DeepSpeed's ZeRO-3 takes a gradient's norm in fp64 chunks of this many elements (_constant_buffered_norm2).
NORM_CHUNK = 250_000_000
GATHERED_TERM = "gathered largest layer + its grad"
GATHERED_FROZEN_TERM = "gathered largest layer"  # LoRA: the frozen weight, no gradient
# A preference stage's step has two high moments (benchmarks/results/plans-h100x1-20261207d/trace-dpo-full,
# full fine-tuning on one H100: 48.00 GiB in the reference's forward, 46.99 in the backward): the reference's
# forward, beside every saved activation of the policy's (``reference_forward_bytes_per_token``), and the
# backward of TRL's fused head with the gathered head and its gradient. The larger is the term.
PREFERENCE_MOMENT_TERM = "LM head + loss (TRL), or the reference's forward: the larger"
# DeepSpeed's default ZeRO-3 sub_group_size (elements): the optimizer steps one
# sub-group at a time, and offloaded fp32 gradients are pinned per sub-group.
SUB_GROUP_SIZE = 1_000_000_000


@dataclass(frozen=True)
class PartialOffload:
    """DeepSpeed's partial optimizer offload (ZeRO-Offload++): ``offload_optimizer.ratio`` of the sub-groups on
    the host, the rest stepped on the GPU, from a user's ``zero.overrides`` or ``zero.config``.

    DeepSpeed 0.19 (``stage3.py``, ``_create_fp32_partitions``) puts sub-group ``i`` of ``n`` on the host when
    ``i >= int((1 - ratio) * n)``: the first ones stay on the GPU, whole sub-groups only, so with the
    default ``sub_group_size`` (1 G elements) an 8B model's shard has a handful and a ratio near 1 keeps
    none. Those on the GPU keep their fp32 master, Adam's two moments and an fp32 gradient there (16 bytes
    an element); every gradient partition still goes down to the host's buffer during the backward
    (``partition_grads`` does not look at the sub-group's device).
    """

    ratio: float
    sub_group_size: int = SUB_GROUP_SIZE

    def groups_on_gpu(self, shard_elements: int) -> tuple[int, int]:
        """(sub-groups kept on the GPU, sub-groups) of a rank's trained shard, as DeepSpeed counts them."""
        groups = math.ceil(shard_elements / self.sub_group_size)
        return int((1 - self.ratio) * groups), groups

    def on_gpu(self, shard_elements: int) -> int:
        """Elements of a rank's trained shard whose optimizer stays on the GPU."""
        return min(shard_elements, self.groups_on_gpu(shard_elements)[0] * self.sub_group_size)

    def describe(self) -> str:
        return f"offload_optimizer.ratio {self.ratio:g}, sub_group_size {self.sub_group_size:,}"


# What an element of a sub-group stepped on the GPU keeps there: fp32 master, Adam m and v, fp32 gradient.
GPU_SUB_GROUP_BYTES_PER_ELEMENT = 4 + 8 + 4
PARTIAL_OFFLOAD_TERM = "fp32 master + Adam m,v + fp32 grads (sub-groups on the GPU)"


def bytes_per_value(precision: Precision) -> int:
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class OptimizerStates:
    """What the ZeRO optimizer keeps per trained element beside the 16-bit weight and gradient: its master copy, and
    Adam's m and v together (bytes), under the name the breakdown shows; and the bytes per element of the gradient
    sub-group its step makes in the master's dtype (stage3.py's _prepare_fp32_grad_for_sub_group)."""

    master: int
    adam: int
    step_gradient: int
    term: str

    @classmethod
    def kept(cls, p: int, pure_bf16: bool) -> OptimizerStates:
        if pure_bf16:
            # train.pure_bf16 (DeepSpeed 0.19's bf16_master_weights_and_grads + bf16_optimizer_states): the "fp32"
            # partitions of stage3.py's _create_fp32_partitions are bf16, still a copy beside the bf16 weights (its
            # shortcut that would reuse them compares the tensor's torch.device with the accelerator's device name,
            # a str, which is never equal: tests/test_pure_bf16.py sees the two apart), and torch's AdamW keeps m
            # and v in its parameter's dtype.
            return cls(master=2, adam=4, step_gradient=2, term="bf16 master + Adam m,v")
        # Mixed precision: an fp32 master copy; in fp32 the weights are their own master. Adam's m and v in fp32.
        return cls(master=4 if p < 4 else 0, adam=8, step_gradient=4, term="fp32 master + Adam m,v")


def pinned_bytes(size: int) -> int:
    """Host RAM taken by one pinned tensor of ``size`` bytes.

    ``Tensor.pin_memory()`` goes through PyTorch's CachingHostAllocator, which rounds
    every block up to the next power of two (pytorch/pytorch#95823; measured again on
    torch 2.11 in vllm-project/vllm#53042: a 2.08 GiB request takes 4 GiB). DeepSpeed
    pins its offload buffers that way.
    """
    return 0 if size <= 0 else 1 << (size - 1).bit_length()


Kernels = Literal["hf", "liger"]


def norm_bytes_per_token(
    width: int, act: int, *, weighted_output_saved: bool, kernels: Kernels = "hf", weight_trains: bool = True
) -> int:
    """What one RMSNorm leaves saved per token over ``width`` values.

    HF's upcasts to fp32 (kept for the variance's backward; in fp32 that is the input
    itself), keeps an fp32 1/rms per row, and keeps its normalised output in the
    activation dtype for the weight's gradient, only where the weight trains (autograd keeps
    no input of a product whose gradient nobody takes: LoRA's frozen norms keep fp32 alone).
    Liger's (ops/rms_norm.py, 0.8) keeps its input in the activation dtype and the fp32 1/rms
    either way. When a linear layer reads the weighted output, that linear keeps it as well.
    """
    kept = act if kernels == "liger" else 4 + (act if weight_trains else 0)
    return (kept + (act if weighted_output_saved else 0)) * width + 4


def layer_activation_bytes_per_token(
    shape: ModelShape, act: int, kernels: Kernels = "hf", *, norm_weights_train: bool = True
) -> int:
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
    Liger's; its RoPE, like HF's, keeps only cos/sin. ``norm_weights_train=False``: LoRA's frozen
    norms (see ``norm_bytes_per_token``).
    """
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    norms = {"kernels": kernels, "weight_trains": norm_weights_train}
    total = 2 * norm_bytes_per_token(h, act, weighted_output_saved=True, **norms)
    if shape.qk_norm:
        total += norm_bytes_per_token(shape.head_dim, act, weighted_output_saved=False, **norms) * (
            shape.num_heads + shape.num_kv_heads
        )
    total += act * (q + 2 * kv)  # q, k, v saved by attention
    total += act * q + 4 * shape.num_heads  # attention output + log-sum-exp
    total += (3 if kernels == "liger" else 4) * act * i  # gate, [silu(gate),] up, product
    return total


def repeated_kv_bytes_per_token(shape: ModelShape, act: int) -> int:
    """What an attention that repeats K and V for every query head keeps beyond q, k, v, per layer and token.

    Two paths do: packed rows' varlen attention (train/model/attention.py: torch 2.11's ``varlen_attn``
    has no ``enable_gqa``; benchmarks/results/attention-h200-20261130), and HF's SDPA given a padding
    mask (a preference stage's pairs, which TRL pads): on CUDA transformers takes SDPA's own GQA only
    without a mask (``use_gqa_in_sdpa``), else it calls ``repeat_kv`` first. Either way the repeated
    copies are what the kernel saves for the backward. Under checkpointing this is one layer's worth; without
    it every full layer's: on the 36-layer Qwen3-8B at micro 5 (LoRA, SFT rows) 8.4 GiB, the
    7.7 GiB the planner once missed (issue 29). Counted wherever the KV heads are fewer (the safe
    side on a torch whose kernel takes GQA itself).
    """
    return 2 * act * (shape.q_dim - shape.kv_dim)


def logits_bytes_per_token(shape: ModelShape, act: int) -> int:
    """Bytes per token live at the loss's backward, when the logits cost most.

    The logits in the activation dtype (held as the model's output), the fp32
    log-softmax that cross-entropy saves (transformers upcasts logits to fp32 for the
    loss), the fp32 gradient of the logits, and that gradient cast back to the
    activation dtype for the LM head's backward (no cast in fp32).
    """
    v = shape.vocab_size
    return act * v + 4 * v + 4 * v + (act * v if act < 4 else 0)


def trl_head_bytes(shape: ModelShape, act: int, tokens: int, *, head_trains: bool) -> tuple[int, int]:
    """TRL's fused LM head (``trl/kernels/chunked_logprob.py``, TRL 1.16): what its forward saves, and what its
    backward adds to that (see ``loss_bytes``). Every token is counted as scored: TRL scores only the answers'
    tokens (``hidden_states[mask]``), which the plan cannot know, so this is the safe side."""
    h, v = shape.hidden_size, shape.vocab_size
    tile_tokens, tile_vocab = fusedloss.TRL_HEAD_TILE
    saved = (act * h + 4 * 2) * tokens
    tile = act * min(tokens, tile_tokens) * min(v, tile_vocab)
    head_grad = 4 * v * h if head_trains else 0
    return saved, (4 * h + act * h) * tokens + tile + head_grad


def reference_forward_bytes_per_token(shape: ModelShape, act: int) -> int:
    """A preference stage's reference forward (no autograd) at its highest, per token: one decoder layer's MLP
    with the policy's saved activations still live. At the product of SiLU(gate) and up three intermediate-wide
    tensors are live (SiLU(gate), up, their product) beside four hidden-wide ones (the layer's input, the
    attention's output, their sum and its norm). Measured on one H100 (``benchmarks/results/
    plans-h100x1-20261207d/trace-dpo-full``, 65,536 tokens): 6.49 GiB allocated by the reference's forward at
    the step's peak, against 6.50 from this count."""
    return act * (3 * shape.intermediate_size + 4 * shape.hidden_size)


def loss_bytes(shape: ModelShape, act: int, tokens: int, fused_loss: FusedLoss, *, head_trains: bool = True) -> int:
    """Bytes live at the loss's most expensive moment, beyond the final norm's saved tensors.

    * ``none``: the logits (``logits_bytes_per_token``) of every token.
    * ``liger``: the fused linear cross-entropy computes its gradients in the forward
      (ops/fused_linear_cross_entropy.py, 0.8): the hidden states' gradient (activation
      dtype), an fp32 loss per token and the target mask, and one chunk's logits in
      the activation dtype (the cross-entropy kernel writes their gradient in place).
      Its full ``lm_head`` gradient is the "its grad" of the gathered-layer term.
    * ``chunked`` (orchestrator/train/model/loss.py): at its backward, the hidden states'
      gradient, an fp32 log-sum-exp per token, and for one chunk the logits in the
      activation dtype, their fp32 copy turned into the gradient in place and that
      gradient cast back; the ``lm_head`` gradient is again the gathered-layer term.
    * ``trl`` (a preference stage: TRL's fused LM head, ``fusedloss.TRL_HEAD_TILE``): it saves its
      own copy of the scored hidden states (activation dtype) and an fp32 log-sum-exp and entropy
      per token; its backward holds the hidden states' gradient in fp32 and cast back, one tile
      of logits, and where the head trains (full fine-tuning) its whole gradient in fp32 beside
      the gathered-layer term's.
    """
    h, v = shape.hidden_size, shape.vocab_size
    if fused_loss == "liger":
        chunk = fusedloss.liger_chunk_tokens(tokens, v, h)
        return (act * h + 4 + 1) * tokens + act * v * chunk
    if fused_loss == "chunked":
        chunk = fusedloss.chunk_tokens(tokens, v, h)
        return (act * h + 4) * tokens + (act + 4 + act) * v * chunk
    if fused_loss == "trl":
        return sum(trl_head_bytes(shape, act, tokens, head_trains=head_trains))
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
    """One candidate configuration. ``checkpointed_layers``: how many decoder layers recompute
    their activations (``train.gradient_checkpointing: N``); ``None`` = all of them when
    ``gradient_checkpointing`` is on, none when it is off."""

    micro_batch_size: int
    gradient_checkpointing: bool
    offload: Offload
    checkpointed_layers: int | None = None

    @classmethod
    def with_layers(cls, micro_batch_size: int, checkpointed: int, num_layers: int, offload: Offload) -> Choice:
        """The choice that checkpoints ``checkpointed`` of ``num_layers`` layers, in its one spelling
        (0 is off, all is on: so equal configurations compare equal)."""
        if checkpointed <= 0:
            return cls(micro_batch_size, False, offload)
        if checkpointed >= num_layers:
            return cls(micro_batch_size, True, offload)
        return cls(micro_batch_size, True, offload, checkpointed)

    def checkpointing_words(self, num_layers: int) -> str:
        """``on``, ``off``, or ``on in N of L layers``: how plans and refusals say it."""
        n = self.layers_checkpointed(num_layers)
        return "off" if n == 0 else "on" if n >= num_layers else f"on in {n} of {num_layers} layers"

    def layers_checkpointed(self, num_layers: int) -> int:
        if not self.gradient_checkpointing:
            return 0
        return num_layers if self.checkpointed_layers is None else min(self.checkpointed_layers, num_layers)

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
    num_layers: int = 0  # decoder layers of the model (what checkpointed_layers counts against)
    partial_offload: PartialOffload | None = None  # the user's offload_optimizer.ratio, where it applies
    optimizer_on_gpu: int = 0  # elements of the rank's trained shard whose optimizer steps on the GPU
    pure_bf16: bool = False  # train.pure_bf16: master weights, gradients and Adam's m and v in bf16

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
    hpz_partition_size: int = 1,
    kv_repeated: bool = False,
    partial_offload: PartialOffload | None = None,
    pure_bf16: bool = False,
    reference_forward: bool = False,
) -> Estimate:
    """Predicted peak ``torch.cuda.max_memory_allocated`` per GPU, and host RAM per rank.

    ``lora``: only adapters train (``train.method: lora``); the base weights stay
    partitioned in the model dtype and have no gradients, master copies or Adam states.
    ``hpz_partition_size`` > 1 (ZeRO++ hpZ): each GPU also holds its share of a node-wide
    secondary copy of the gathered weights (model dtype, over that many GPUs).
    ``partial_offload``: where the optimizer is offloaded to the host (not with the weights), the
    sub-groups DeepSpeed keeps on the GPU (``PartialOffload``). ``pure_bf16`` (``train.pure_bf16``): the master
    copy, the step's gradient and Adam's m and v in bf16 (``OptimizerStates``); the optimizer stays on the GPU.
    ``reference_forward``: a preference stage (``fused_loss="trl"``) whose reference policy runs a forward in
    each step (LoRA's base with the adapters off, or the frozen copy): see ``PREFERENCE_MOMENT_TERM``.
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
    states = OptimizerStates.kept(p, pure_bf16)
    master, adam = states.master, states.adam
    # DeepSpeed's partial offload applies where only the optimizer goes to the host.
    partial = partial_offload if choice.offload == "optimizer" else None
    on_gpu = partial.on_gpu(tshard) if partial else 0

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
        on_host = tshard - on_gpu
        host["fp32 master + Adam m,v"] = (master + adam) * on_host
        # CPU Adam steps on fp32 gradients, pinned per sub-group.
        group_size = partial.sub_group_size if partial else SUB_GROUP_SIZE
        groups, last = divmod(on_host, group_size)
        host["fp32 grads (pinned)"] = groups * pinned_bytes(4 * group_size) + pinned_bytes(4 * last)
        if on_gpu:
            gpu[PARTIAL_OFFLOAD_TERM] = GPU_SUB_GROUP_BYTES_PER_ELEMENT * on_gpu
    else:
        gpu["grads"] = g * tshard
        gpu[states.term] = (master + adam) * tshard
    host["process"] = int(RANK_HOST_GIB * GIB)
    host["data (mapped cache, private)"] = int(DATA_RANK_PRIVATE_GIB * GIB)
    gpu["persistent small params"] = p * shape.num_layers * shape.small_params_per_layer
    if hpz_partition_size > 1:
        gpu["hpZ secondary weights"] = hpz_secondary_bytes(
            shape.weight_numels(), persistence_threshold=b.persistence, gpus_per_node=hpz_partition_size, p=p
        )
    # ZeRO-3 working set: one whole weight, its whole gradient, the buckets. A preference stage keeps the gathered
    # weight and the offloaded gradient brought back apart: they live in its backward only, not beside the
    # reference's forward (PREFERENCE_MOMENT_TERM, below).
    backward_only: dict[str, int] = {}
    working = backward_only if fused_loss == "trl" else gpu
    if lora:
        # The frozen weight is gathered again for the backward (for its input's gradient), but has none.
        working[GATHERED_FROZEN_TERM] = p * shape.largest_layer_params
        gpu["prefetch + reduce buckets"] = p * b.prefetch + g * min(b.reduce, trainable)
    else:
        working[GATHERED_TERM] = (p + g) * shape.largest_layer_params
        gpu["prefetch + reduce buckets"] = p * b.prefetch + g * b.reduce
    if choice.offload == "optimizer":
        # DeepSpeed 0.19 (stage3.py, partition_grads) brings each offloaded gradient partition back to the GPU
        # to add to it, and at the boundary takes its norm in fp64 chunks of 250 M elements: for the largest
        # weight both at once. Measured on one H100 (benchmarks/results/plans-h100x1-20261206): the offload
        # plan's peak was 1.83 GiB over the estimate without this term (the embedding's: 1.16 + 1.86 GiB).
        # With the weights offloaded too (all, nvme) the seed's measured peak (test_memory) shows no such
        # extra: not counted there.
        numels = [lora.r * max(pair) for pair in lora.adapted(shape).values()] if lora else shape.weight_numels()
        largest = math.ceil(max(numels) / world_size)
        if fused_loss == "trl":
            # A preference stage: its trace (benchmarks/results/plans-h100x1-20261207d/trace-dpo-full) has no fp64
            # norm chunk at the step's highest moments, in or out of the backward: it comes after the backward.
            backward_only["offloaded grad back"] = g * largest
        else:
            gpu["offloaded grad back + its fp64 norm"] = g * largest + 8 * min(largest, NORM_CHUNK)

    tokens = choice.micro_batch_size * seq_len
    act = p
    kernels: Kernels = "liger" if fused_loss == "liger" else "hf"
    full_layer = layer_activation_bytes_per_token(shape, act, kernels, norm_weights_train=lora is None) * tokens
    if kv_repeated:
        full_layer += repeated_kv_bytes_per_token(shape, act) * tokens
    if lora:
        full_layer += lora.activation_bytes_per_token(shape, act) * tokens
    # A fused loss keeps the final norm's output itself (chunked) or not at all (Liger computes
    # its gradients in the forward): either way no LM head keeps a second copy.
    final_norm = (
        norm_bytes_per_token(
            shape.hidden_size, act, weighted_output_saved=fused_loss != "liger", kernels=kernels,
            weight_trains=lora is None,
        )
        * tokens
    )  # fmt: skip
    loss_term, backward_working_set = "logits + loss", sum(backward_only.values())
    if fused_loss == "trl":
        loss_term = PREFERENCE_MOMENT_TERM
        saved, backward = trl_head_bytes(shape, act, tokens, head_trains=lora is None)
        reference = reference_forward_bytes_per_token(shape, act) * tokens if reference_forward else 0
        logits = saved + max(backward + backward_working_set, reference)
    else:
        logits = loss_bytes(shape, act, tokens, fused_loss, head_trains=lora is None)
    checkpointed = choice.layers_checkpointed(shape.num_layers)
    if checkpointed == shape.num_layers:
        kept = shape.num_layers * act * shape.hidden_size * tokens
        # During a layer's recomputation its full activations and the incoming gradient
        # exist, but by then the logits are freed: the larger of the two moments counts.
        recompute = full_layer + 2 * act * shape.hidden_size * tokens + backward_working_set
        train_terms = {
            "activations (checkpoints)": kept + final_norm,
            loss_term: max(logits, recompute),
        }
    elif checkpointed:
        # Selective (train/model/checkpointing.py::checkpoint_first): the first N layers keep
        # their input, the other L - N every activation. At the loss all of them are live; the
        # backward frees the full layers first, so a checkpointed layer's recomputation comes
        # when only the remaining checkpoints are held: the loss's moment is the larger.
        kept = checkpointed * act * shape.hidden_size * tokens
        recompute = full_layer + 2 * act * shape.hidden_size * tokens + backward_working_set
        full = (shape.num_layers - checkpointed) * full_layer
        train_terms = {
            "activations (checkpoints)": kept + final_norm,
            f"activations ({shape.num_layers - checkpointed} layers not checkpointed)": full,
            loss_term: max(logits, recompute - full),
        }
    else:
        train_terms = {
            "activations (all layers)": shape.num_layers * full_layer + final_norm,
            loss_term: logits,
        }
    # Optimizer step: activations are gone; the gradient of one sub-group is made in the master's
    # dtype (fp32, or bf16 with pure_bf16) and torch's AdamW needs about one more such buffer of temporaries.
    if not choice.offload_optimizer:
        step = 2 * states.step_gradient * min(tshard, SUB_GROUP_SIZE)
    elif on_gpu:
        # Sub-groups stepped on the GPU under a partial offload keep their fp32 gradient (counted above); torch's
        # AdamW over one of them still needs about one such buffer of temporaries.
        step = 4 * min(on_gpu, partial.sub_group_size)
    else:
        step = 0
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
        num_layers=shape.num_layers,
        partial_offload=partial,
        optimizer_on_gpu=on_gpu,
        pure_bf16=pure_bf16,
    )


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
    # The recomputation reads the partitions of the checkpointed layers once more.
    passes = 3 if est.choice.gradient_checkpointing and est.choice.checkpointed_layers is None else 2
    states, grads = disk["fp32 master + Adam m,v"], disk["fp32 grads"]
    read = accumulation * passes * disk["params"] + states + grads
    if est.choice.checkpointed_layers:
        read += accumulation * disk["params"] * est.choice.checkpointed_layers // max(est.num_layers, 1)
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
