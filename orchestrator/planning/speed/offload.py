"""The optimizer step of a plan that offloads it to the host: AdamW on each node's CPU, and the copies (pure).

With ``offload_optimizer`` ZeRO-3 keeps the fp32 master weights, Adam's moments and the gradient
partitions in pinned host memory (DeepSpeed 0.19, ``stage3.py``: ``grad_partitions_flat_buffer`` on the
CPU, in the gradient accumulation dtype, which is the model's: dzctl never sets ``grad_accum_dtype``).
Every micro-step's reduced gradient partition goes down to it and comes back up (the first micro-step to
keep working on the GPU, the later ones to be added to there: "adding directly to cpu is very slow").
Those trips run where the reduce runs: on its own stream beside the backward under ``overlap_comm``, so
``steptime.py`` puts them on the side stream with the collectives. Measured so: on one H100 the 18-layer
shape's offloaded step took 10.12 s at 8 micro-steps and 10.35 s at 4 (benchmarks/results/
plans-h100x1-20261207c/off-auto-1, plans-h100x1-20261206/off-auto-3), where counting the trips whole
added 1.4 s for the 4 more. At the boundary DeepSpeed's CPU Adam steps each rank's partition on the
host and the updated 16-bit weights go back up, with nothing beside them:

    trips       = P · g / (pinned device-to-host rate) + P · g / (pinned host-to-device rate)     per micro-step
    host step   = (1 + HOST_OTHER_PASSES) · (trained parameters of all the node's ranks) / (the node's AdamW rate)
    optimizer   = host step + P · p / (pinned host-to-device rate)                            per optimizer step
                  (P: trained parameters per GPU, g = p: bytes of a 16-bit value)

The node's ranks share its cores and its memory bandwidth, and AdamW over fp32 states is bound by that
bandwidth, so the AdamW rate is the node's, measured with all its cores (preflight's ``python-env`` probe, or
``dzctl plan --host-adam-rate``), and the partitions of the node's ranks add up: a node with fewer or
slower cores, or slower memory, plans a slower step. The copy rates are the probe's, or else the GPU
kind's PCIe link at the share measured on one H100 node (``PCIE_EFFICIENCY``). ``dzctl plan`` without a
measured node or ``--host-adam-rate`` times the host's part at ``ASSUMED_HOST``, and says that it did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The share of a PCIe link's rated rate a pinned copy reached on one H100 node (benchmarks/results/
# plans-h100x1-20261206/offload-rates.json: 55.0 GB/s up, 51.4 down, of PCIe 5.0 x16's 64 GB/s each way):
# the lower, for a node whose copies were not measured.
PCIE_EFFICIENCY = 0.80


@dataclass(frozen=True)
class HostOptimizer:
    """What an offloaded optimizer step runs at on the slowest node: AdamW elements/s and the pinned copies."""

    adam_params_per_s: float  # fp32 elements per second, the node's whole host
    h2d_bytes_per_s: float | None  # pinned host-to-device copy; None: not measured (the GPU kind's link)
    source: str
    d2h_bytes_per_s: float | None = None  # pinned device-to-host copy; None: as h2d, else the GPU kind's link

    def describe(self) -> str:
        copy = ""
        if self.h2d_bytes_per_s:
            down = self.d2h_bytes_per_s or self.h2d_bytes_per_s
            copy = f", copies {self.h2d_bytes_per_s / 1e9:.1f} GB/s up and {down / 1e9:.1f} down"
        return f"host AdamW {self.adam_params_per_s / 1e9:.2f} G params/s{copy} ({self.source})"


# The AdamW rate of the one node dzctl has measured (benchmarks/results/plans-h100x1-20261206/offload-rates.json:
# DeepSpeed's cpu_adam over 2 G fp32 parameters on 16 cores, 5.20 and 4.83 G/s in two rounds): what `dzctl plan`
# assumes for a node it cannot measure. A node with more cores and memory channels steps faster; launch
# measures each. The copies are left to the GPU kind's link (that node's were PCIe 5.0).
ASSUMED_HOST = HostOptimizer(
    5.0e9,
    None,
    "assumed, not measured: the one 16-core node dzctl measured; launch measures each node, --host-adam-rate "
    "gives yours",
)


def host_optimizer_from_nodes(readings: Mapping[str, Mapping[str, float]]) -> HostOptimizer | None:
    """The slowest node's rates from preflight's per-host readings (``host_adam_params_per_s``, ``h2d_bytes_per_s``)."""
    rated = {host: r for host, r in readings.items() if r.get("host_adam_params_per_s")}
    if not rated:
        return None
    slowest = min(rated, key=lambda host: rated[host]["host_adam_params_per_s"])
    up = [r["h2d_bytes_per_s"] for r in rated.values() if r.get("h2d_bytes_per_s")]
    down = [r["d2h_bytes_per_s"] for r in rated.values() if r.get("d2h_bytes_per_s")]
    return HostOptimizer(
        adam_params_per_s=rated[slowest]["host_adam_params_per_s"],
        h2d_bytes_per_s=min(up) if up else None,
        d2h_bytes_per_s=min(down) if down else None,
        source=f"measured by preflight, slowest of {len(rated)} node(s): {slowest}",
    )


# DeepSpeed's other host work in an offloaded step, in AdamW-equivalents over the same partition: the fp32
# gradient buffer the bf16 gradients are widened into, the norm and the clipping over it, the 16-bit weights
# written for the upload. Not timed one by one: fitted as the seconds the AdamW and the weights' upload leave
# unexplained, the median of six launches on one H100 whose preflight ran today's probe (benchmarks/offload_fit.py:
# the 18-layer shape with the optimizer offloaded, plans-h100x1-20261207e and -20261208), checked on the H200's
# launches. It was 2.91, fitted on one H200 launch read by the old probe (three AdamW steps timed together: a burst
# of other work read it low); on today's probe's H100 launches that left one at +12.7 % tokens/s (the script prints
# both ways).
HOST_OTHER_PASSES = 3.55


def _rates(host: HostOptimizer, link_bytes_per_s: float) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes/s: the node's measured copies, else the GPU kind's link."""
    up = host.h2d_bytes_per_s or link_bytes_per_s
    return up, host.d2h_bytes_per_s or host.h2d_bytes_per_s or link_bytes_per_s


def gradient_trips_seconds(
    host: HostOptimizer, params_per_gpu: float, grad_bytes: int, *, link_bytes_per_s: float
) -> float:
    """One micro-step's gradient partition down to the host's buffer and back up (DeepSpeed 0.19's
    ``partition_grads`` sends every partition, a partial offload's too), on the reduce's stream."""
    up, down = _rates(host, link_bytes_per_s)
    return params_per_gpu * grad_bytes / down + params_per_gpu * grad_bytes / up


def offloaded_optimizer_seconds(
    host: HostOptimizer,
    params_per_gpu: float,
    gpus_per_node: int,
    param_bytes: int,
    *,
    link_bytes_per_s: float,
    on_gpu_params: float = 0.0,
) -> float:
    """What offloading adds at the optimizer step, after the last micro-step: the host's AdamW over each GPU's
    partition and its other passes (``HOST_OTHER_PASSES``), the 16-bit weights back up. ``on_gpu_params``: a
    partial offload's elements stepped on the GPU (``memory/estimate.py::PartialOffload``): the host steps and
    uploads the rest. ``link_bytes_per_s``: each way, where the node's copies were not measured."""
    on_host = params_per_gpu - on_gpu_params
    up, _ = _rates(host, link_bytes_per_s)
    return (1 + HOST_OTHER_PASSES) * on_host * gpus_per_node / host.adam_params_per_s + on_host * param_bytes / up
