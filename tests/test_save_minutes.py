"""``train.save_minutes`` (issue 31 item 4): saves by wall-clock time as well as by steps, rank 0's clock deciding.

The callback's decision with a controlled clock, then the real thing: the tiny job on 2 gloo ranks
(real ZeRO-3 on CPU) with save_steps far past the run and a save interval shorter than any step:
every step saves, on both ranks together (each checkpoint marked complete by the world of 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from test_train import ROOT, train

from orchestrator.planning.speed.spacing import describe, work_lost_per_fault
from orchestrator.train.progress import read_events
from orchestrator.train.savetimer import SaveByTime, save_callbacks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _step(callback) -> bool:
    control = SimpleNamespace(should_save=False)
    callback.on_step_end(None, None, control)
    return control.should_save


def test_a_save_is_due_after_the_interval_and_every_save_restarts_the_clock():
    clock, asked = Clock(), []
    callback = SaveByTime(2.0, clock=clock, agree=lambda due: asked.append(due) or due)
    callback.on_train_begin(None, None, None)
    clock.now += 119
    assert not _step(callback)
    clock.now += 1
    assert _step(callback)
    callback.on_save(None, None, None)  # a save of either kind (steps or time)
    clock.now += 60
    assert not _step(callback)
    assert asked == [False, True, False]  # every step takes part in the agreement


def test_rank_0s_decision_is_the_one_every_rank_follows():
    clock = Clock()
    mine_says_due = SaveByTime(1.0, clock=clock, agree=lambda due: False)  # rank 0 said not yet
    mine_says_due.on_train_begin(None, None, None)
    clock.now += 600
    assert not _step(mine_says_due)
    late_rank = SaveByTime(1.0, clock=clock, agree=lambda due: True)  # rank 0 said save
    late_rank.on_train_begin(None, None, None)
    assert _step(late_rank)
    assert save_callbacks(None, True) == [] and save_callbacks(5, False) == []


def test_save_minutes_saves_every_step_of_a_real_two_rank_run_together(tmp_path):
    out = tmp_path / "out"
    done = train(out, "train.max_steps=3", "train.save_steps=1000", "train.save_minutes=0.00001",
                 "train.save_total_limit=5")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = [e["step"] for e in read_events(out / "progress.jsonl") if e["event"] == "checkpoint"]
    assert saved == [1, 2, 3], saved
    for step in saved:
        marker = json.loads((out / f"checkpoint-{step}" / "dzctl-complete.json").read_text())
        assert marker["world_size"] == 2 and marker["step"] == step, marker


def test_the_work_a_fault_loses_from_the_interval_and_the_step_time():
    measured = work_lost_per_fault(500, None, 2.0)
    assert (measured["interval_s"], measured["expected_lost_s"], measured["basis"]) == (
        1000.0,
        500.0,
        "measured step time",
    )
    # save_minutes cuts it short: a time save at the first step end past 10 minutes.
    capped = work_lost_per_fault(500, 10, 2.0)
    assert capped["max_lost_s"] == 602.0 and capped["expected_lost_s"] == 301.0
    assert describe(capped) == (
        "checkpoints every 500 steps or 10 min, whichever comes first at 2 s/step; "
        "work lost per fault: 5.0 min on average, up to 10.0 min"
    )
    unknown = work_lost_per_fault(500, None, None)
    assert unknown["interval_s"] is None and unknown["basis"] == "steps only"
    assert "up to 500 steps (half that on average)" in describe(unknown) and "dzctl status shows it" in describe(
        unknown
    )


def test_the_dry_run_shows_the_checkpoint_spacing():
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--hosts",
         str(ROOT / "hostfiles/localhost.txt"), "--runtime", "process", "--dry-run", "--json",
         "--set", "train.save_minutes=30"], capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    spacing = json.loads(done.stdout)["checkpoint_spacing"]
    assert spacing == {"save_steps": 10, "save_minutes": 30.0, "step_time_s": None, "interval_s": 1800.0,
                       "expected_lost_s": 900.0, "max_lost_s": 1800.0, "basis": "save_minutes"}  # fmt: skip
