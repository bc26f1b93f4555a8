"""This machine's GPU memory and RAM, for ``plan`` and ``launch --dry-run`` when every node is this machine.

On remote nodes only preflight (over SSH) can measure them; here the same query
preflight runs (``nvidia-smi --query-gpu``, ``/proc/meminfo``) is cheap and exact,
so a localhost hostfile needs no ``--gpu-mem-gib``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import DzError
from ..preflight.parsers import GPU_QUERY_ARGV, ParseError, parse_gpu_query, parse_meminfo_total
from ..spec.hostfile import Node
from ..transport.local import LOCAL_HOSTS, LocalConnection

# nvidia-smi answers in well under a second; a wedged driver must not hang a planning command.
NVIDIA_SMI_TIMEOUT_S = 20


@dataclass(frozen=True)
class Hardware:
    gpu_mem_gib: float | None
    host_mem_gib: float | None


def hardware_for(nodes: list[Node], gpu_mem_gib: float | None, host_mem_gib: float | None) -> Hardware:
    """The flags' values; where one is not given and every node is this machine, what this machine has."""
    if not nodes or any(n.host not in LOCAL_HOSTS for n in nodes):
        return Hardware(gpu_mem_gib, host_mem_gib)
    return Hardware(
        gpu_mem_gib if gpu_mem_gib is not None else local_gpu_mem_gib(),
        host_mem_gib if host_mem_gib is not None else local_host_mem_gib(),
    )


def local_gpu_mem_gib() -> float | None:
    """The smallest GPU's memory as preflight reports it (MiB / 1024, one decimal); None without GPUs."""
    # Through the one local runner preflight uses for localhost: a missing tool is exit 127, not an exception.
    try:
        done = LocalConnection().run(list(GPU_QUERY_ARGV), timeout=NVIDIA_SMI_TIMEOUT_S)
    except DzError:
        return None  # timed out: the planner asks for --gpu-mem-gib
    if not done.ok:
        return None  # no nvidia-smi (or no driver) here: the planner asks for --gpu-mem-gib
    try:
        gpus = parse_gpu_query(done.stdout)
    except ParseError:
        return None
    return round(min(g.memory_total_mib for g in gpus) / 1024, 1) if gpus else None


def local_host_mem_gib() -> float | None:
    try:
        return round(parse_meminfo_total(Path("/proc/meminfo").read_text()) / 2**30, 1)
    except (OSError, ParseError):
        return None
