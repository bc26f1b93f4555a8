"""A plan that does not fit, refused: what it needs against what the nodes have, and the ways out."""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import InputError
from .search import MAX_NODES_SEARCHED, NVME_SETS, MemoryPlan, gib, lora_sets


class DoesNotFit(InputError):
    """No configuration the spec allows fits the given nodes. Exit code 2.

    Bad input rather than a runtime failure: nothing ran and nothing on the hosts
    failed; the job as written asks more of these nodes than they have, and only a
    change to the job or the hostfile (more nodes, shorter sequences, offload) helps.
    """


def describe_fit_failure(plan: MemoryPlan, nodes_desc: str) -> str:
    """The message of a ``DoesNotFit``: what the job needs, what the nodes have, what would do."""
    est = plan.estimate
    c = est.choice
    ranks = max(plan.hardware.slots_per_node)
    lines = [
        f"the job does not fit on {nodes_desc}: {plan.reason}",
        f"least demanding allowed setup: micro-batch {c.micro_batch_size}, gradient checkpointing "
        f"{c.checkpointing_words(est.num_layers)}, offload {c.offload}, seq {plan.seq_len}, {plan.precision}: "
        f"{gib(est.gpu_required)} GiB per GPU (peak {gib(est.gpu_peak)} + margins), "
        f"{gib(ranks * est.host_per_rank)} GiB host RAM per node",
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
            f"gradient checkpointing {ac.checkpointing_words(a.num_layers)}, "
            f"offload {ac.offload}: {gib(a.gpu_required)} GiB per GPU (peak {gib(a.gpu_peak)} + margins), "
            f"{gib(max(alt.host_per_node))} GiB host RAM per node"
        )
    disk = plan.nvme_alternative
    if disk is not None:
        d, dc = disk.estimate, disk.choice
        lines.append(
            f"offload to NVMe would fit these GPUs and host RAM (ZeRO-Infinity: parameters and optimizer states on "
            f"each node's local disk; the slowest way, every step reads and writes them): micro-batch "
            f"{dc.micro_batch_size}, gradient checkpointing {dc.checkpointing_words(d.num_layers)}: "
            f"{gib(d.gpu_required)} GiB per GPU, {gib(max(disk.host_per_node))} GiB host RAM per node, "
            f"{gib(max(disk.hardware.slots_per_node) * d.nvme_per_rank)} GiB of NVMe per node "
            "(preflight checks the folder, its free space and bandwidth)"
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
    if plan.nvme_alternative is not None:
        fix += f"; or offload to a local NVMe folder on every node: {NVME_SETS}"
    if plan.estimate.pure_bf16:
        # pure_bf16 plans keep the optimizer on the GPUs (fromjob.py): offload needs its fp32 states.
        fix += "; or remove train.pure_bf16, which lets the planner offload the (fp32) optimizer states"
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
