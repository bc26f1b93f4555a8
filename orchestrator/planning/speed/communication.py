"""What ZeRO-3 sends per micro-step, and how long that takes over the links (pure: numbers in, numbers out).

Per micro-step every GPU takes part in (ZeRO paper §7; DeepSpeed's partitioned-parameter
coordinator):

* the parameter all-gather in the forward, over all W GPUs;
* the same all-gather again in the backward (the gathered weights were freed after the
  forward) — with hpZ (``zero_hpz_partition_size`` = G, the GPUs of one node) only
  within the node, from the secondary copy each node keeps (ZeRO++ paper §3.2);
* the gradient reduce-scatter over all W GPUs.

Gradient accumulation amortises none of it: each micro-step gathers and reduces again.

For a ring (NCCL runs all-gather and reduce-scatter as rings), each of a collective's
``S`` bytes crosses every edge ``(W−1)/W`` times over, whatever the node count; a node's
link to the others is one such edge (summed over NCCL's channels), so a global collective
takes ``(W−1)/W · S / B_inter`` and one confined to a node ``(G−1)/G · S / B_intra``.

Each collective also costs a fixed latency. Where the collective check measured none,
NCCL's own ring model is used (``nccl_ring_latency_s``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# NCCL's ring latency model for all-gather and reduce-scatter, Simple protocol (the one
# large buckets use): src/graph/tuning.cc, ncclTopoTuneModel: latency = baseLat +
# (nRanks − nNodes) · intraLat + (nNodes − 1) · interLat, with baseLat (Ring, Simple)
# 8.4 µs, hwLat NVLink (Ring, Simple) 3.4 µs and NET (Ring, Simple) 9.6 µs.
NCCL_RING_BASE_LATENCY_S = 8.4e-6
NCCL_RING_NVLINK_STEP_S = 3.4e-6
NCCL_RING_NET_STEP_S = 9.6e-6

# The share of a network link's rated speed that NCCL's collectives reach; the issue's
# estimate takes 0.8 (nccl-tests' bus bandwidth on InfiniBand/RoCE is typically 80–95 % of
# line rate). Only for rated figures (--link-gbps); measured bandwidths are used as they are.
RATED_LINK_EFFICIENCY = 0.8


def nccl_ring_latency_s(world: int, nodes: int, *, intra_step_s: float = NCCL_RING_NVLINK_STEP_S) -> float:
    """Fixed time of one ring all-gather or reduce-scatter over ``world`` ranks on ``nodes`` nodes."""
    if world <= 1:
        return 0.0
    return NCCL_RING_BASE_LATENCY_S + (world - nodes) * intra_step_s + (nodes - 1) * NCCL_RING_NET_STEP_S


@dataclass(frozen=True)
class Links:
    """The bandwidths and latencies collectives see, in bytes/s and seconds (effective, not rated).

    ``inter_bytes_per_s``: one node's link to the others (all its NICs), ``None`` when not
    known (then nothing about a multi-node job's communication can be predicted).
    ``intra_bytes_per_s``: the bus bandwidth of a collective within one node (NVLink).
    Latencies ``None``: NCCL's ring model (``nccl_ring_latency_s``).
    """

    inter_bytes_per_s: float | None
    intra_bytes_per_s: float
    source: str  # what the figures are: "--link-gbps 200", "measured by the collective check", ...
    inter_latency_s: float | None = None
    intra_latency_s: float | None = None
    # A reduce-scatter's own inter-node bandwidth where it was measured apart from the all-gather's
    # (gloo's differs; NCCL runs both as the same ring). None: the same as ``inter_bytes_per_s``.
    inter_reduce_bytes_per_s: float | None = None

    def latency_s(self, world: int, nodes: int) -> float:
        if world <= 1:
            return 0.0
        if nodes > 1 and self.inter_latency_s is not None:
            return self.inter_latency_s
        if nodes == 1 and self.intra_latency_s is not None:
            return self.intra_latency_s
        return nccl_ring_latency_s(world, nodes)

    @classmethod
    def rated(cls, inter_gbit_s: float | None, intra_bytes_per_s: float, source: str) -> Links:
        """From a NIC's rated speed in Gbit/s per node (``--link-gbps``), at ``RATED_LINK_EFFICIENCY``."""
        inter = None if inter_gbit_s is None else inter_gbit_s * 1e9 / 8 * RATED_LINK_EFFICIENCY
        return cls(inter_bytes_per_s=inter, intra_bytes_per_s=intra_bytes_per_s, source=source)

    @classmethod
    def measured(cls, collective: dict | None, intra_bytes_per_s: float) -> Links | None:
        """From the collective check's figures (``report.collective``, kept with the job), or None if it measured none.

        The check's ``zero3`` figures are the inter-node bound on several nodes and the
        intra-node figures on one (see ``preflight/collective_result.zero3_figures``): the
        all-gather's bus bandwidth and latency, and the reduce-scatter's bandwidth apart.
        The side not measured keeps ``intra_bytes_per_s`` (the GPU kind's) or stays unknown.
        """
        zero3 = (collective or {}).get("zero3") if (collective or {}).get("ok") else None
        if not zero3:
            return None
        gather, reduce = zero3.get("all_gather") or {}, zero3.get("reduce_scatter") or {}
        if not gather.get("busbw_gbs") or not reduce.get("busbw_gbs"):
            return None
        bandwidth, reduce_bw = gather["busbw_gbs"] * 1e9, reduce["busbw_gbs"] * 1e9
        latency = max(gather.get("latency_s") or 0.0, reduce.get("latency_s") or 0.0) or None
        source = (
            f"measured by the collective check: all-gather {gather['busbw_gbs']:g} GB/s, reduce-scatter "
            f"{reduce['busbw_gbs']:g} GB/s busbw"
        )
        if zero3.get("scope") == "inter":
            return cls(
                inter_bytes_per_s=bandwidth,
                intra_bytes_per_s=intra_bytes_per_s,
                source=source + " between nodes",
                inter_latency_s=latency,
                inter_reduce_bytes_per_s=reduce_bw,
            )
        return cls(
            inter_bytes_per_s=None,
            intra_bytes_per_s=min(bandwidth, reduce_bw),
            source=source + " within the node",
            intra_latency_s=latency,
        )


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO-3 settings that decide the traffic: hpZ, bucket and prefetch sizes (elements)."""

    reduce_bucket: int
    prefetch_bucket: int
    persistence_threshold: int
    hpz_partition_size: int = 1  # 1: off; G: a secondary copy of the weights within each node of G GPUs
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance, as dsconfig writes it


@dataclass(frozen=True)
class Layout:
    """Where the job's GPUs are: ``gpus_per_node`` on each of ``nodes`` nodes."""

    gpus_per_node: int
    nodes: int

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a micro-step: how many calls, how many bytes in all, over which link."""

    name: str
    calls: float  # per micro-step, averaged over an optimizer step's micro-steps
    total_bytes: float  # the whole tensor(s) gathered or reduced, summed over the calls
    scope: str  # "global" (all W GPUs) or "node" (the G GPUs of one node)


@dataclass(frozen=True)
class CommTime:
    """Time of one micro-step's collectives if nothing else ran: bandwidth part and latency part."""

    collectives: tuple[Collective, ...]
    bandwidth_s: float
    latency_s: float
    inter_bytes: float  # bytes over each node's inter-node link per micro-step
    intra_bytes: float  # bytes over each GPU's intra-node link from node-confined collectives
    first_gather_s: float  # the forward's first all-gather: nothing runs before it to hide it
    last_reduce_s: float  # the last reduce-scatter: it runs after the backward's last layer

    @property
    def total_s(self) -> float:
        return self.bandwidth_s + self.latency_s

    @property
    def calls(self) -> int:
        return round(sum(c.calls for c in self.collectives))


def gather_calls(numels: Iterable[int], bucket: int) -> int:
    """All-gather calls when the prefetcher sends weights in model order.

    DeepSpeed's coordinator pops parameters off its trace until it has
    ``stage3_prefetch_bucket_size`` elements and gathers them in one coalesced call, so a
    call closes once it holds a bucket; a weight larger than the bucket is a call of its own.
    """
    calls, held = 0, 0
    for numel in numels:
        held += numel
        if held >= bucket:
            calls, held = calls + 1, 0
    return calls + (1 if held else 0)


def reduce_calls(numels: Iterable[int], bucket: int) -> int:
    """Reduce-scatter calls: ZeRO-3 reduces its gradient bucket before a gradient that would overflow it.

    (stage3.py: ``if elements_in_ipg_bucket + numel > reduce_bucket_size and elements_in_ipg_bucket > 0``),
    and once more at the end of the backward.
    """
    calls, held = 0, 0
    for numel in numels:
        if held and held + numel > bucket:
            calls, held = calls + 1, 0
        held += numel
    return calls + (1 if held else 0)


def gathered_per_phase(
    blocks: Sequence[Sequence[tuple[int, int]]], *, checkpointing: bool, max_reuse_distance: int
) -> tuple[list[int], list[int]]:
    """The weights all-gathered in the forward and in the backward of one micro-step, in order.

    ``blocks``: the model's modules in forward order, each a list of (tensor id, elements) of its
    gathered weights (embedding, each decoder layer, the LM head; a tied head repeats the
    embedding's id). The backward visits them in reverse, and under gradient checkpointing
    runs each layer's forward again first. DeepSpeed's coordinator releases a weight after a
    visit unless it is visited again within ``stage3_max_reuse_distance`` elements of
    weights (partitioned_param_coordinator.py, ``__params_to_release``); a released weight
    is gathered again at its next visit. (The generated config's 1e9 keeps a layer's weights
    from its recomputation to its backward, and a model under 1e9 elements whole all step.)
    """
    visits: list[tuple[int, int, bool]] = [(t, n, True) for block in blocks for t, n in block]
    last = len(blocks) - 1
    for index in range(last, -1, -1):
        block = list(blocks[index])
        if checkpointing and 0 < index < last:
            visits += [(t, n, False) for t, n in block]  # the recomputed forward, within the backward
        visits += [(t, n, False) for t, n in reversed(block)]
    prefix = [0]
    for _, n, _ in visits:
        prefix.append(prefix[-1] + n)
    next_visit: dict[int, int] = {}
    following = [len(visits)] * len(visits)
    for i in range(len(visits) - 1, -1, -1):
        following[i] = next_visit.get(visits[i][0], len(visits))
        next_visit[visits[i][0]] = i
    available: set[int] = set()
    forward: list[int] = []
    backward: list[int] = []
    for i, (tensor, numel, is_forward) in enumerate(visits):
        if tensor not in available:
            (forward if is_forward else backward).append(numel)
            available.add(tensor)
        j = following[i]
        # kept while the weights visited before its next use stay under the distance
        if j == len(visits) or prefix[j] - prefix[i + 1] >= max_reuse_distance:
            available.discard(tensor)
    return forward, backward


def micro_step_collectives(
    forward_numels: Sequence[int],
    backward_numels: Sequence[int],
    grad_numels: Sequence[int],
    *,
    zero: ZeroSettings,
    layout: Layout,
    param_bytes: int,
    grad_bytes: int,
    accumulation: int = 1,
) -> tuple[Collective, ...]:
    """The all-gathers and reduce-scatters of one micro-step, averaged over an optimizer step.

    ``forward_numels``/``backward_numels``: the weights gathered in each phase
    (``gathered_per_phase``); ``grad_numels``: the trained tensors (LoRA: its adapters').
    With hpZ the backward gathers from the node's secondary copy, and so does every forward
    but the first of an optimizer step: DeepSpeed drops the secondary copy only after the
    optimizer step (stage3.py ``_post_step``: ``invalidate_secondary_tensor``).
    """
    hpz = zero.hpz_partition_size > 1 and layout.nodes > 1
    fwd_bytes = float(param_bytes * sum(forward_numels))
    fwd_calls = gather_calls(forward_numels, max(1, zero.prefetch_bucket))
    bwd = Collective(
        "backward all-gather",
        gather_calls(backward_numels, max(1, zero.prefetch_bucket)),
        float(param_bytes * sum(backward_numels)),
        "node" if hpz else "global",
    )
    reduce = Collective(
        "gradient reduce-scatter",
        reduce_calls(reversed(grad_numels), max(1, zero.reduce_bucket)),
        float(grad_bytes * sum(grad_numels)),
        "global",
    )
    if not hpz or accumulation <= 1:
        return (Collective("forward all-gather", fwd_calls, fwd_bytes, "global"), bwd, reduce)
    first = 1 / accumulation
    return (
        Collective("forward all-gather", fwd_calls * first, fwd_bytes * first, "global"),
        Collective("forward all-gather (hpZ copy)", fwd_calls * (1 - first), fwd_bytes * (1 - first), "node"),
        bwd,
        reduce,
    )


def comm_time(collectives: Sequence[Collective], *, layout: Layout, links: Links) -> CommTime:
    """How long the collectives take on these links, one after the other, nothing overlapped."""
    world, g, nodes = layout.world, layout.gpus_per_node, layout.nodes
    bandwidth = latency = inter_bytes = intra_bytes = 0.0
    first_gather = last_reduce = 0.0
    for c in collectives:
        if c.scope == "global" and nodes > 1:
            if links.inter_bytes_per_s is None:
                raise ValueError("the inter-node bandwidth is needed for a multi-node job")
            share = (world - 1) / world * c.total_bytes
            inter = links.inter_bytes_per_s
            if c.name == "gradient reduce-scatter" and links.inter_reduce_bytes_per_s is not None:
                inter = links.inter_reduce_bytes_per_s
            seconds = share / min(inter, links.intra_bytes_per_s)
            inter_bytes += share
            lat = links.latency_s(world, nodes)
        else:
            ranks = world if c.scope == "global" else g
            share = (ranks - 1) / ranks * c.total_bytes if ranks > 1 else 0.0
            seconds = share / links.intra_bytes_per_s
            intra_bytes += share
            lat = links.latency_s(ranks, 1) if ranks > 1 else 0.0
        bandwidth += seconds
        latency += c.calls * lat
        one_call = (seconds / c.calls if c.calls else 0.0) + lat
        if c.name == "forward all-gather":
            first_gather = one_call
        if c.name == "gradient reduce-scatter":
            last_reduce = one_call
    return CommTime(
        collectives=tuple(collectives),
        bandwidth_s=bandwidth,
        latency_s=latency,
        inter_bytes=inter_bytes,
        intra_bytes=intra_bytes,
        first_gather_s=first_gather,
        last_reduce_s=last_reduce,
    )


def hpz_secondary_bytes(weight_numels: Sequence[int], *, persistence_threshold: int, gpus_per_node: int, p: int) -> int:
    """GPU memory of hpZ's secondary copy per GPU: the gathered weights in the model dtype over the node's GPUs."""
    gathered = sum(n for n in weight_numels if n > persistence_threshold)
    return math.ceil(p * gathered / gpus_per_node)
