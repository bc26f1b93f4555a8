"""What each eval loss means for the run: a new best, patience used up (pure, no torch).

The rule is Hugging Face's (``EarlyStoppingCallback`` with ``metric_for_best_model:
eval_loss``, lower is better): the best eval loss moves on every strict improvement;
an eval counts as progress only when it beats the best so far by more than
``min_delta``, and ``patience`` evals in a row without progress stop the run. The
eval that stops it is the last one; its step is where the run ends (and its final
checkpoint is written).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    new_best: bool  # the lowest eval loss so far (train.save_best keeps its checkpoint)
    stop: bool  # train.early_stopping's patience is used up


@dataclass
class EvalHistory:
    patience: int | None = None  # train.early_stopping.patience; None: never stop early
    min_delta: float = 0.0
    best_loss: float | None = None
    best_step: int | None = None
    without_progress: int = 0  # evals in a row that did not beat the best by more than min_delta

    def record(self, step: int, loss: float) -> Verdict:
        previous = self.best_loss
        new_best = previous is None or loss < previous
        progress = previous is None or previous - loss > self.min_delta
        if new_best:
            self.best_loss, self.best_step = loss, step
        self.without_progress = 0 if progress else self.without_progress + 1
        stop = self.patience is not None and self.without_progress >= self.patience
        return Verdict(new_best=new_best, stop=stop)


def stop_step(curve: list[tuple[int, float]], patience: int, min_delta: float = 0.0) -> int | None:
    """The step at which a run with these evals ((step, eval loss), in order) stops early; None: it does not."""
    history = EvalHistory(patience=patience, min_delta=min_delta)
    for step, loss in curve:
        if history.record(step, loss).stop:
            return step
    return None
