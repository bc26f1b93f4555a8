"""Evaluation during training: when it runs, what it writes, what it decides.

- **When**: every ``train.eval_steps`` steps and once at the end (the last step),
  through the Trainer's own flow (``control.should_evaluate``): the Trainer then calls
  ``DzTrainer.evaluate``, which runs ``evaluation.eval_loss`` here, before any save of
  that step.
- **What it writes**: an ``eval`` event in ``progress.jsonl`` (rank 0: ``eval_loss``,
  ``eval_tokens``, ``eval_rows``, ``best_eval_loss``, ``best_step``), and
  ``eval_loss``/``eval_tokens`` through ``Trainer.log``, where the trackers
  (``report_to``) take the training loss too.
- **What it decides** (``policy.EvalHistory``): ``train.early_stopping`` ends the run
  at the eval whose patience is used up, with its checkpoint written (a normal end,
  ``stopped_early`` in the ``end`` event); ``train.save_best`` has a checkpoint written at
  every new best, named in ``dzctl-best.json`` once it is complete on every node, and kept
  out of rotation (``checkpoints.rotate``'s ``protect``).

Every rank computes the same all-reduced loss, so every rank takes the same decisions:
the collectives of a save (its barriers, ZeRO's gathers) stay in step.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .. import checkpoints
from ..progress import ProgressLog, finite
from .loss import eval_loss
from .policy import EvalHistory


def forward_kwargs(model, fused_loss: str) -> dict[str, Any]:
    """Extra arguments of the eval forward: Liger's forward builds full logits in eval mode unless told not to."""
    if fused_loss != "liger":
        return {}
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"skip_logits": True} if "skip_logits" in inspect.signature(causal.forward).parameters else {}


class EvalRunner(TrainerCallback):
    def __init__(
        self,
        dataset,
        collator,
        log: ProgressLog,
        *,
        rank: int,
        world_size: int,
        micro: int,
        eval_steps: int | None,
        patience: int | None,
        min_delta: float,
        save: bool,
        save_best: bool,
        lineage: str,
        marks_folders: bool,
        output_dir: Path,
        forward: dict[str, Any] | None = None,
    ) -> None:
        self.dataset, self.collator, self.log = dataset, collator, log
        self.rank, self.world_size, self.micro = rank, world_size, micro
        self.eval_steps = eval_steps
        self.save, self.save_best = save, save_best
        self.lineage, self.marks_folders, self.output_dir = lineage, marks_folders, output_dir
        self.forward = forward or {}
        # A resumed run goes on comparing with the best it had (save_best records it); its patience count restarts.
        resumed = checkpoints.read_best(output_dir, lineage) if save_best else None
        self.best = resumed if resumed is not None and (output_dir / resumed.checkpoint).is_dir() else None
        self.history = EvalHistory(patience=patience, min_delta=min_delta)
        if self.best is not None:
            self.history.best_loss, self.history.best_step = self.best.eval_loss, self.best.step
        self.pending_best: checkpoints.Best | None = None  # its checkpoint is being written at this step
        self.stopped_early_at: int | None = None
        self.last: dict[str, Any] | None = None

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if (self.eval_steps and step % self.eval_steps == 0) or step >= state.max_steps:
            control.should_evaluate = True
        return control

    def run(self, trainer) -> dict[str, float]:
        """One eval (every rank): the loss, its event and log, the decisions; returns the Trainer's metrics."""
        state, control = trainer.state, trainer.control
        loss, tokens = eval_loss(
            trainer.model,
            self.dataset,
            self.collator,
            trainer._prepare_inputs,
            rank=self.rank,
            world_size=self.world_size,
            micro=self.micro,
            device=trainer.args.device,
            forward_kwargs=self.forward,
        )
        step = state.global_step
        verdict = self.history.record(step, loss) if loss is not None else None
        extra: dict[str, Any] = {}
        if verdict is not None and verdict.new_best and self.save_best and self.save:
            self.pending_best = checkpoints.Best(step, loss, self.lineage)
            control.should_save = True  # the best step's weights, resumable and exportable
        kept = self.pending_best or self.best
        if kept is not None:  # the checkpoint train.save_best keeps (this step's is being written)
            extra["best_checkpoint"] = str(self.output_dir / kept.checkpoint)
        if verdict is not None and verdict.stop and step < state.max_steps:
            self.stopped_early_at = step
            control.should_training_stop = True
            control.should_save = self.save  # the end always gets a resumable checkpoint
            extra["stopped_early"] = True
        self.last = {
            "eval_loss": loss,
            "eval_tokens": tokens,
            "eval_rows": len(self.dataset),
            "best_eval_loss": self.history.best_loss,
            "best_step": self.history.best_step,
            **extra,
        }
        if self.rank == 0:
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            self.log.write(
                "eval",
                step=step,
                max_steps=state.max_steps,
                epoch=finite(state.epoch),
                gpu_mem_peak_gib=round(peak, 3) if peak is not None else None,
                **self.last,
            )
        metrics = {"eval_loss": loss, "eval_tokens": float(tokens)} if loss is not None else {}
        trainer.log(dict(metrics))  # the trackers' eval/loss, beside the training loss
        trainer.control = trainer.callback_handler.on_evaluate(trainer.args, state, control, metrics)
        return metrics

    def checkpoint_complete(self, path: Path, step: int) -> int | None:
        """After every node marked ``path`` complete: name it the best if it is; the step rotation must keep."""
        if self.pending_best is not None and self.pending_best.step == step:
            if self.marks_folders:
                checkpoints.write_best(path.parent, self.pending_best)
            self.best, self.pending_best = self.pending_best, None
        return self.best.step if self.best is not None else None
