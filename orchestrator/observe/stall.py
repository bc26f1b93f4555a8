"""Is a running job stalled, and by which bound: pure, from rank 0's pulse (train/hang/stacks.py).

A job is stalled when its current phase has lasted longer than that phase's bound:

- ``step`` (training, a step has ended): no step has ended for ``stall.multiple`` x the median
  of the recent steps, and at least ``stall.floor_s``. The median, not the mean or the last:
  one slow step (a checkpoint's neighbour, a GC pause) does not move it, and a job whose steps
  slow down for a while (a noisy neighbour, a throttled GPU) keeps ending steps, each well
  inside the bound, so it is slow and not stalled;
- ``first-step`` (the model is loaded, no step has ended): ``stall.first_step_s``, or
  ``multiple`` x the plan's predicted step when that is longer (a first step compiles, warms up
  allocators and gathers every ZeRO-3 shard once);
- ``data-build``, ``model-load``, ``save`` (a checkpoint, the consolidated model) and ``eval``:
  their own bounds (``stall.data_build_s``, ``model_load_s``, ``save_s``; eval takes save's).

The verdict says which bound applied and why, so a person can tell a hang from a bound too tight.
Clocks: the pulse's times are rank 0's; ``now`` is the controller's. Status already compares the
two for the progress age; a skew of minutes would show there first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median

PHASES = ("data-build", "model-load", "first-step", "step", "save", "eval", "done")
RECENT_STEPS = 20  # the median of the last 20 step times: a few minutes of a GPU job, seconds on CPU
_PHASE_BOUND = {"data-build": "data_build_s", "model-load": "model_load_s", "save": "save_s", "eval": "save_s"}


@dataclass(frozen=True)
class Stall:
    stalled: bool
    phase: str
    waited_s: float  # since the phase began, or since the last step ended
    bound_s: float
    rule: str  # which bound applied, in words
    step: int | None  # the last step that ended (None: none yet)

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """``stalled in step 13: no step ended for 95 s (bound 30 s: stall.floor_s)``, or the healthy form."""
        where = f"step {self.step + 1}" if self.phase == "step" and self.step is not None else self.phase
        what = "no step ended" if self.phase == "step" else f"{self.phase} has lasted"
        head = "stalled" if self.stalled else "not stalled"
        return f"{head} in {where}: {what} for {self.waited_s:.0f} s (bound {self.bound_s:.0f} s: {self.rule})"


def check(pulse: dict | None, now: float, bounds: dict, predicted_step_s: float | None = None) -> Stall | None:
    """The stall verdict of a running job's pulse; None when there is none yet or the run is done.

    ``bounds``: the job's ``stall:`` section (spec/recovery.py StallSpec) as a dict.
    """
    if not isinstance(pulse, dict) or pulse.get("phase") not in PHASES or pulse["phase"] == "done":
        return None
    phase = pulse["phase"]
    step = pulse.get("step") if isinstance(pulse.get("step"), int) else None
    multiple = float(bounds["multiple"])
    if phase == "step":
        recent = [float(s) for s in (pulse.get("recent_step_s") or [])[-RECENT_STEPS:] if isinstance(s, (int, float))]
        typical = median(recent) if recent else 0.0
        scaled = multiple * typical
        floor = float(bounds["floor_s"])
        if scaled > floor:
            bound, rule = scaled, f"{multiple:g} x the median of the last {len(recent)} steps, {typical:.2f} s"
        else:
            bound, rule = floor, f"stall.floor_s (above {multiple:g} x the median step, {typical:.2f} s)"
        started = pulse.get("step_ended_at")
    elif phase == "first-step":
        fixed = float(bounds["first_step_s"])
        scaled = multiple * predicted_step_s if predicted_step_s else 0.0
        if scaled > fixed:
            bound, rule = scaled, f"{multiple:g} x the plan's predicted step, {predicted_step_s:.2f} s"
        else:
            bound, rule = fixed, "stall.first_step_s"
        started = pulse.get("since")
    else:
        key = _PHASE_BOUND[phase]
        bound, rule = float(bounds[key]), f"stall.{key}"
        started = pulse.get("since")
    if not isinstance(started, (int, float)):
        return None
    waited = max(0.0, now - float(started))
    return Stall(waited > bound, phase, round(waited, 1), round(bound, 1), rule, step)


def predicted_step_s(speed: dict | None, accumulation: int | None) -> float | None:
    """One optimizer step as the plan predicted it (the record's plan["speed"]), when it was predicted.

    ``optimizer_step_s`` already holds the accumulation's micro-steps and the optimizer; a plan recorded
    before it existed has the micro-step alone, repeated ``accumulation`` times."""
    if not speed or not speed.get("predicted") or not speed.get("micro_step_s"):
        return None
    if speed.get("optimizer_step_s"):
        return float(speed["optimizer_step_s"])
    return float(speed["micro_step_s"]) * max(1, accumulation or 1)
