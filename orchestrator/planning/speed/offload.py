"""The optimizer step of a plan that offloads it to the host: AdamW on each node's CPU, and the copy back (pure).

With ``offload_optimizer`` ZeRO-3 keeps the fp32 master weights and Adam's moments in host RAM. During
the backward each rank's reduced gradient partition goes down to pinned host memory (beside the compute
with ``overlap_comm``, so not counted here). After it, DeepSpeed's CPU Adam steps each rank's partition on
the host, and the updated 16-bit weights go back up to the GPU before the next forward:

    host step   = (trained parameters of all the node's ranks) / (the node's AdamW rate)
    copy up     = (trained parameters per GPU) · (bytes per 16-bit weight) / (pinned host-to-device rate)
    optimizer   = host step + copy up

The node's ranks share its cores and its memory bandwidth, and AdamW over fp32 states is bound by that
bandwidth, so the rate is the node's, measured with all its cores (preflight's ``python-env`` probe, or
``dzctl plan --host-adam-rate``), and the partitions of the node's ranks add up. A node with fewer or
slower cores, or slower memory, plans a slower step. Without a measured rate the host step is not
timed, and the plan says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class HostOptimizer:
    """What an offloaded optimizer step runs at on the slowest node: AdamW elements/s and the copy up."""

    adam_params_per_s: float  # fp32 elements per second, the node's whole host
    h2d_bytes_per_s: float | None  # pinned host-to-device copy; None: not measured (the copy is left out)
    source: str

    def describe(self) -> str:
        copy = f", copy up {self.h2d_bytes_per_s / 1e9:.1f} GB/s" if self.h2d_bytes_per_s else ""
        return f"host AdamW {self.adam_params_per_s / 1e9:.2f} G params/s{copy} ({self.source})"


def host_optimizer_from_nodes(readings: Mapping[str, Mapping[str, float]]) -> HostOptimizer | None:
    """The slowest node's rates from preflight's per-host readings (``host_adam_params_per_s``, ``h2d_bytes_per_s``)."""
    rated = {host: r for host, r in readings.items() if r.get("host_adam_params_per_s")}
    if not rated:
        return None
    slowest = min(rated, key=lambda host: rated[host]["host_adam_params_per_s"])
    copies = [r["h2d_bytes_per_s"] for r in rated.values() if r.get("h2d_bytes_per_s")]
    return HostOptimizer(
        adam_params_per_s=rated[slowest]["host_adam_params_per_s"],
        h2d_bytes_per_s=min(copies) if copies else None,
        source=f"measured by preflight, slowest of {len(rated)} node(s): {slowest}",
    )


def offloaded_optimizer_seconds(
    host: HostOptimizer, params_per_gpu: float, gpus_per_node: int, param_bytes: int, ratio: float = 1.0
) -> float:
    """The host's share of one optimizer step: ``ratio`` of each GPU's partition stepped on the host, then sent up."""
    on_host = ratio * params_per_gpu
    step = on_host * gpus_per_node / host.adam_params_per_s
    copy = on_host * param_bytes / host.h2d_bytes_per_s if host.h2d_bytes_per_s else 0.0
    return step + copy
