"""The one resolved job: every ``auto`` decided once, for the nodes it runs on, read by every later stage.

``launcher.prepare`` builds it after preflight, from the job's ``JobInputs`` (read once,
before any host was touched) and what the nodes reported: the memory plan for their
GPUs and RAM, the launch plan with the master address and interfaces preflight found,
and where checkpoints are written. The job files, the job record, the SSH fleet's start
and the Slurm batch script are all made from this value; none of them derives anything
from the job again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..spec.hostfile import Node
from ..spec.job import JobSpec, LoadedJob
from .dsconfig import Resolved
from .inputs import JobInputs
from .launchplan import LaunchPlan
from .memory.search import MemoryPlan


@dataclass(frozen=True)
class ResolvedJob:
    inputs: JobInputs  # secrets, zero.config, the model's shape, packing, fused loss
    nodes: tuple[Node, ...]  # in rank order
    memory: MemoryPlan  # the planner's choice for these nodes (it fits)
    settings: Resolved  # what the DeepSpeed config and the trainer's job file are built from
    ds_config: dict[str, Any]
    plan: LaunchPlan  # per node: host, ranks, argv, env
    output_storage: str | None  # train.output_storage resolved: shared | node-local

    @property
    def job(self) -> LoadedJob:
        return self.inputs.job

    @property
    def spec(self) -> JobSpec:
        return self.inputs.job.spec


def resolve_job(
    inputs: JobInputs,
    nodes: list[Node],
    memory: MemoryPlan,
    ds_config: dict[str, Any],
    plan: LaunchPlan,
    output_storage: str | None,
) -> ResolvedJob:
    """The job with every ``auto`` decided: the memory plan's choices become the settings the nodes run."""
    return ResolvedJob(
        inputs=inputs,
        nodes=tuple(nodes),
        memory=memory,
        settings=memory.resolved(),
        ds_config=ds_config,
        plan=plan,
        output_storage=output_storage,
    )
