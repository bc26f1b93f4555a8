"""Checkpoint spacing: how much work a fault costs, from the save interval and the step time (pure).

A fault at a uniformly random moment loses the work since the last complete checkpoint: on
average half the save interval, at most all of it (plus the restart itself, not counted here).
The interval is ``save_steps`` × the step time, cut short by ``save_minutes`` where that comes
first (a time save happens at the first step end past the minutes).

The step time is known only once the run steps (``status`` reads rank 0's ``step_time_s``); a
plan made before that says the interval in steps, and in time only where ``save_minutes``
bounds it.
"""

from __future__ import annotations


def work_lost_per_fault(save_steps: int, save_minutes: float | None, step_time_s: float | None) -> dict:
    by_steps = save_steps * step_time_s if step_time_s else None
    by_time = save_minutes * 60.0 + (step_time_s or 0.0) if save_minutes else None
    bounds = [b for b in (by_steps, by_time) if b is not None]
    interval = min(bounds) if bounds else None
    return {
        "save_steps": save_steps,
        "save_minutes": save_minutes,
        "step_time_s": step_time_s,
        "interval_s": None if interval is None else round(interval, 1),
        "expected_lost_s": None if interval is None else round(interval / 2, 1),
        "max_lost_s": None if interval is None else round(interval, 1),
        "basis": "measured step time" if step_time_s else "save_minutes" if save_minutes else "steps only",
    }


def describe(spacing: dict) -> str:
    """One line: the save interval and the work a fault loses."""
    every = f"every {spacing['save_steps']} steps"
    if spacing["save_minutes"]:
        every += f" or {spacing['save_minutes']:g} min, whichever comes first"
    if spacing["interval_s"] is None:
        steps = spacing["save_steps"]
        return (
            f"checkpoints {every}; work lost per fault: up to {steps} steps (half that on average); "
            "the time per step is known once the run steps: dzctl status shows it"
        )
    step = f" at {spacing['step_time_s']:.3g} s/step" if spacing["step_time_s"] else ""
    expected, most = _span(spacing["expected_lost_s"]), _span(spacing["max_lost_s"])
    return f"checkpoints {every}{step}; work lost per fault: {expected} on average, up to {most}"


def _span(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
