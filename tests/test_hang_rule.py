"""The stall rule (observe/stall.py) on recorded step series, and the hang cause (issue 45, case d): pure."""

from __future__ import annotations

from orchestrator.backends.recovery.policy import decide
from orchestrator.observe.stall import check
from orchestrator.observe.status import JobStatus
from orchestrator.spec.recovery import RestartSpec, StallSpec

DEFAULTS = StallSpec().model_dump()
TEST_BOUNDS = {**DEFAULTS, "floor_s": 10.0, "multiple": 3.0}  # the bounds the 2-host test lowers to


def _replay(step_times: list[float], bounds: dict, every: float = 0.5) -> list:
    """Rank 0's pulse as the trainer writes it, checked every ``every`` s of the run: the verdicts."""
    verdicts, now, recent, ended_at = [], 0.0, [], 0.0
    for seconds in step_times:
        while now + every < ended_at + seconds:
            now += every
            pulse = {"phase": "step", "since": ended_at, "step": len(recent), "step_ended_at": ended_at,
                     "recent_step_s": recent[-20:]}  # fmt: skip
            verdicts.append(check(pulse, now, bounds))
        ended_at += seconds
        recent.append(seconds)
    return verdicts


def test_steps_three_times_slower_for_a_minute_are_not_a_stall():
    series = [1.0] * 30 + [3.0] * 20 + [1.0] * 30  # 1 s steps, then 3 s steps for a minute, then back
    for bounds in (DEFAULTS, TEST_BOUNDS):
        verdicts = _replay(series, bounds)
        assert verdicts and not any(v.stalled for v in verdicts if v is not None)
        assert max(v.waited_s for v in verdicts if v) < 3.0


def test_no_step_for_longer_than_the_bound_is_a_stall_and_says_which_bound():
    pulse = {"phase": "step", "since": 100.0, "step": 12, "step_ended_at": 100.0, "recent_step_s": [1.0] * 20}
    assert not check(pulse, 109.0, TEST_BOUNDS).stalled
    stalled = check(pulse, 111.0, TEST_BOUNDS)
    assert stalled.stalled and stalled.bound_s == 10.0 and stalled.rule.startswith("stall.floor_s")
    assert stalled.line() == (
        "stalled in step 13: no step ended for 11 s (bound 10 s: stall.floor_s (above 3 x the median step, 1.00 s))"
    )
    slow = {**pulse, "recent_step_s": [30.0] * 19 + [1.0]}  # the median, not the last step, sets the bound
    assert check(slow, 100.0 + 301, DEFAULTS).stalled and not check(slow, 100.0 + 299, DEFAULTS).stalled
    assert check(slow, 401, DEFAULTS).rule == "10 x the median of the last 20 steps, 30.00 s"


def test_each_phase_has_its_own_bound():
    for phase, key in (("data-build", "data_build_s"), ("model-load", "model_load_s"), ("save", "save_s"),
                       ("eval", "save_s"), ("first-step", "first_step_s")):  # fmt: skip
        pulse = {"phase": phase, "since": 0.0, "step": None}
        assert not check(pulse, DEFAULTS[key] - 1, DEFAULTS).stalled
        verdict = check(pulse, DEFAULTS[key] + 1, DEFAULTS)
        assert verdict.stalled and verdict.rule == f"stall.{key}" and verdict.phase == phase
    # Before the first step, the plan's predicted step when k x it is longer than the fixed bound.
    first = check({"phase": "first-step", "since": 0.0}, 1000.0, DEFAULTS, predicted_step_s=120.0)
    assert not first.stalled and first.bound_s == 1200.0 and "predicted step" in first.rule
    assert check({"phase": "done", "since": 0.0}, 1e9, DEFAULTS) is None and check(None, 0.0, DEFAULTS) is None


def test_a_stalled_job_is_a_hang_restarted_when_restart_on_lists_it():
    culprit = {"line": "culprit: rank 1 on node 1 (node1) stopped (state T: SIGSTOP or a debugger)"}
    status = JobStatus("j", "j-1", "stalled", [], None, None, None,
                       stall={"line": "stalled in step 13: ...", "culprit": culprit})  # fmt: skip
    verdict = decide(status, RestartSpec(), 0)
    assert verdict.cause == "hang" and verdict.restart and culprit["line"] in verdict.why
    assert "hang" in RestartSpec().on  # on by default
    assert not decide(status, RestartSpec(on=["node-lost"]), 0).restart
