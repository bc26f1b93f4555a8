"""Issue 29: Python's automatic GC is off while training and runs at fixed steps instead (GcCallback)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from orchestrator.train import run
from orchestrator.train.run import GcCallback, trainer_callbacks


def test_gc_is_off_during_training_collected_every_n_steps_and_restored_at_the_end(monkeypatch):
    collected = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    assert gc.isenabled()
    callback = GcCallback(every=3)
    try:
        callback.on_train_begin(None, None, None)
        assert not gc.isenabled()
        assert collected == [2]  # the build's garbage, once, before the first step
        for step in range(1, 8):
            callback.on_step_end(None, SimpleNamespace(global_step=step), None)
        assert collected == [2, 1, 1]  # steps 3 and 6, young generations only
    finally:
        callback.on_train_end(None, None, None)
        monkeypatch.setattr(gc, "collect", real_collect)
    assert gc.isenabled()


def test_gc_left_off_by_the_caller_stays_off():
    gc.disable()
    try:
        callback = GcCallback()
        callback.on_train_begin(None, None, None)
        callback.on_train_end(None, None, None)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_every_run_gets_the_gc_callback_after_progress():
    progress = object()
    callbacks = trainer_callbacks(progress, None, False, None)
    assert callbacks[0] is progress
    assert any(isinstance(c, GcCallback) for c in callbacks)
    assert run.GcCallback().every == 50
