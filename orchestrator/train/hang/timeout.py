"""The process group's timeout, phase by phase: a hang the stall rule misses still ends in minutes.

torch's defaults (NCCL 10 min; gloo, DeepSpeed and HF's ``ddp_timeout`` 30 min) are one number for
every phase of a run. Here the timeout follows the phase, as the stall rule's bounds do
(observe/stall.py, ``stall:`` in the job):

    timeout(phase) = max(FLOOR_S, MARGIN x the stall rule's bound for that phase)

- ``step``: the bound is ``max(stall.floor_s, stall.multiple x the plan's predicted optimizer step)``
  (``DZCTL_PREDICTED_STEP_S``, set by the launch when the step-time model predicted one). With the
  defaults that is ``max(6 min, 20 x the predicted step)``: a hang in training ends in minutes;
- ``model-load``, ``save``, ``eval`` and ``first-step``: their own bounds (30 min, 30 min, 30 min,
  15 min or more), doubled: a 72B model read from a slow disk, or rank 0 writing the consolidated
  model while the others wait in a barrier, is not a hang;
- the group's start (``init_process_group``): the ranks reach it as each one's data is built, so
  it gets the model-load phase's timeout (and the data-build bound when that is longer).

``MARGIN`` 2: the stall rule acts first (it takes every rank's stack before anything is stopped,
and names the culprit); the timeout is the backstop when nothing watches the job (no supervisor,
``launch --detach`` without ``restart:``), or the controller cannot reach the nodes.

The value is pure (``group_timeout_s``); ``PhaseTimeout`` applies it to the live groups as the
trainer's pulse changes phase (stacks.Pulse calls it on every rank).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from datetime import timedelta

FLOOR_S = 300.0  # never below 5 minutes: a slow log write, a GC pause or a page-cache flush is not a hang
MARGIN = 2.0  # the timeout is twice the stall rule's bound: the rule, with its evidence, acts first
PREDICTED_STEP_ENV = "DZCTL_PREDICTED_STEP_S"  # the plan's predicted optimizer step, set by the launch
_PHASE_BOUND = {"model-load": "model_load_s", "save": "save_s", "eval": "save_s", "data-build": "data_build_s"}
START = "start"  # the group's creation: the ranks arrive there as each one's data build ends


def group_timeout_s(phase: str, bounds: Mapping[str, float], predicted_step_s: float | None) -> float | None:
    """The process group's timeout in ``phase``, in seconds; None for a phase that keeps the last one (done).

    ``bounds``: the job's ``stall:`` section (spec/recovery.py StallSpec) as a dict.
    """
    multiple = float(bounds["multiple"])
    scaled = multiple * predicted_step_s if predicted_step_s else 0.0
    if phase == "step":
        bound = max(float(bounds["floor_s"]), scaled)
    elif phase == "first-step":
        bound = max(float(bounds["first_step_s"]), scaled)
    elif phase == START:
        bound = max(float(bounds["model_load_s"]), float(bounds["data_build_s"]))
    elif phase in _PHASE_BOUND:
        bound = float(bounds[_PHASE_BOUND[phase]])
    else:
        return None
    return max(FLOOR_S, MARGIN * bound)


def predicted_step_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The plan's predicted optimizer step from the launch's environment; None when not predicted."""
    try:
        value = float(environ.get(PREDICTED_STEP_ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None


class PhaseTimeout:
    """Sets every live process group's timeout to ``group_timeout_s`` of each new phase (once per change).

    torch has no public call that changes a live group's timeout; ``_set_pg_timeout`` (torch 2.3 and
    later) is the one torch's own tests use. Without it (or on an error) the group keeps the timeout
    it started with, the long one, and the rank says so once: safe, only slower to end a hang.
    """

    def __init__(self, bounds: Mapping[str, float], predicted: float | None, rank: int) -> None:
        self.bounds, self.predicted, self.rank = dict(bounds), predicted, rank
        self.current: float | None = None
        self.failed = False
        self.said = False

    def start_timeout(self) -> timedelta:
        """For ``init_process_group`` (DeepSpeed's ``init_distributed``, HF's ``ddp_timeout``)."""
        seconds = group_timeout_s(START, self.bounds, self.predicted)
        self.current = seconds
        return timedelta(seconds=seconds)

    def phase(self, name: str) -> None:
        seconds = group_timeout_s(name, self.bounds, self.predicted)
        if seconds is None or seconds == self.current or self.failed:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            return  # before the group exists: start_timeout covers it
        default, *others = _groups(dist)
        try:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), default)
        except (AttributeError, RuntimeError, ValueError, AssertionError) as exc:
            self.failed = True
            if self.rank == 0:
                print(f"dzctl-train: the process group keeps its {self.current:.0f} s timeout: {exc}", flush=True)
            return
        for group in others:  # best effort: a subgroup that refuses keeps its own (torch's default)
            with contextlib.suppress(RuntimeError, ValueError, AssertionError):
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
        self.current = seconds
        if self.rank == 0 and name == "step" and not self.said:  # once: the value a hang in training meets
            self.said = True
            basis = f"the plan's predicted step {self.predicted:.2f} s" if self.predicted else "no predicted step"
            saving = group_timeout_s("save", self.bounds, self.predicted)
            line = f"process group timeout in training {seconds:.0f} s ({basis}; {saving:.0f} s while saving)"
            print(f"dzctl-train: {line}", flush=True)


def _groups(dist) -> list:
    """The default group and every group made since (DeepSpeed's hpZ and data-parallel groups)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    made = list(getattr(world, "pg_map", {}) or {})
    default = dist.distributed_c10d._get_default_group()
    return [default, *[g for g in made if g is not default]]
