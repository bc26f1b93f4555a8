"""Preflight results as plain values: a check, a host's checks, the whole report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Status = Literal["ok", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail")


@dataclass(frozen=True)
class Check:
    """One finding on one host. ``fix`` says what to do; empty when ok."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"bad status {self.status!r}")
        if self.status != "ok" and not self.fix:
            # A finding without a fix is half a finding: every warn/fail names one.
            raise ValueError(f"check {self.name} is {self.status} without a fix")

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def warn(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warn", detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


@dataclass
class HostReport:
    host: str
    node_rank: int
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict:
        return {"host": self.host, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}


@dataclass
class PreflightReport:
    """Every host's checks, plus what launch needs: the master address and each node's NIC."""

    hosts: list[HostReport]
    elapsed_s: float
    master_addr: str | None
    master_port: int
    interfaces: dict[str, str]
    # Per host, for the memory planner: the smallest GPU the job uses there, and RAM.
    gpu_mem_gib: dict[str, float] = field(default_factory=dict)
    host_mem_gib: dict[str, float] = field(default_factory=dict)
    # Per host, the lowest compute capability of the GPUs the job uses (precision: auto).
    gpu_compute_capability: dict[str, float] = field(default_factory=dict)
    # Per host, nvidia-smi's name of the GPUs the job uses (the step-time model's GPU kind).
    gpu_name: dict[str, str] = field(default_factory=dict)
    # Per host, where the plan may offload the optimizer: its AdamW rate (host_adam_params_per_s) and pinned
    # copies (h2d_bytes_per_s, d2h_bytes_per_s), which time the offloaded step (planning/speed/offload.py).
    host_optimizer: dict[str, dict[str, float]] = field(default_factory=dict)
    infiniband: dict[str, list[str]] = field(default_factory=dict)  # IB verbs devices per node
    container_probe_s: dict[str, float] = field(default_factory=dict)  # the in-container probe, per node
    # The collective check's figures (preflight/collective.py); None until it ran or was skipped.
    collective: dict | None = None
    # Per host, zero.nvme_path where usable: free_bytes, read_bytes_per_s, write_bytes_per_s.
    nvme: dict[str, dict] = field(default_factory=dict)
    # Per host, the Python probe's answer per DeepSpeed op builder the plan may load (preflight/loading/ops.py).
    deepspeed_ops: dict[str, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    def host(self, name: str) -> HostReport:
        return next(h for h in self.hosts if h.host == name)

    def failures(self) -> list[tuple[str, Check]]:
        return [(h.host, c) for h in self.hosts for c in h.checks if c.status == "fail"]

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "elapsed_s": round(self.elapsed_s, 3),
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "interfaces": self.interfaces,
            "gpu_mem_gib": self.gpu_mem_gib,
            "host_mem_gib": self.host_mem_gib,
            "gpu_compute_capability": self.gpu_compute_capability,
            "gpu_name": self.gpu_name,
            "host_optimizer": self.host_optimizer,
            "infiniband": self.infiniband,
            "container_probe_s": self.container_probe_s,
            "collective": self.collective,
            "nvme": self.nvme,
            "hosts": [h.to_dict() for h in self.hosts],
        }
