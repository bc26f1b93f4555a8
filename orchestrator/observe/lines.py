"""Plain lines for a pipe, CI or a file: one per logging step, plus start, checkpoint, end, messages, failure.

Pure: each function turns one new thing (an event, a first-seen message, the
final status) into a line, or ``None`` when it has nothing to say.
"""

from __future__ import annotations

from ..planning.preference import metrics as preference_metrics
from .rankfailure import failure_lines
from .watchstate import JobWatch, Message, format_duration, ranks_text


def rate_text(tokens_per_s: float | None, world_size: int, per: str) -> str | None:
    if not tokens_per_s:
        return None
    return f"{tokens_per_s / max(world_size, 1):,.0f} tok/s/{per}"


def global_batch_text(start: dict | None) -> str | None:
    """The start event's global batch, and whether the spec fixes it or the hardware decided it."""
    rows = (start or {}).get("global_batch_size")
    if not isinstance(rows, int):
        return None  # a trainer from before the key
    how = "fixed by the spec" if start.get("global_batch_fixed") else "depends on the hardware"
    return f"global batch {rows} rows ({how})"


def predicted_text(speed: dict | None, step: dict | None, world_size: int) -> str | None:
    """The plan's predicted rate beside the measured one: ``predicted 12,300 tok/s/GPU (compute-bound), measured …``.

    The model predicts processed tokens (micro-batch × sequence length per GPU), so the
    measured side is the processed rate where the trainer reports one (packing, padding).
    """
    if not speed or not speed.get("predicted") or not speed.get("tokens_per_s_per_gpu"):
        return None
    predicted = speed["tokens_per_s_per_gpu"]
    text = f"predicted {predicted:,.0f} tok/s/GPU ({speed.get('bound')}-bound)"
    step = step or {}
    rate = step.get("processed_tokens_per_s")
    if not rate and step.get("tokens_per_s"):
        rate = step["tokens_per_s"] / (step.get("padding_efficiency") or 1.0)  # useful / (useful / processed)
    if rate:
        measured = rate / max(world_size, 1)
        text += f", measured {measured:,.0f} ({measured / predicted - 1:+.0%})"
    return text


def speed_warning(speed: dict | None) -> str | None:
    """The plan's communication-bound warning, with its predicted loss and fixes."""
    return f"warning: {speed['warning']}" if speed and speed.get("warning") else None


CULPRIT_NOT_NAMED = "culprit: not named (every rank waits in the same collective)"


def stall_line(stall: dict | None, job_id: str) -> str | None:
    """A stalled job in one line: the bound that applied, who the ranks wait for, where the stacks are.

    The same words as ``status`` (its stall and culprit lines) and the webhook's ``culprit``; None
    while the job is not stalled.
    """
    if not stall or not stall.get("stalled"):
        return None
    culprit = (stall.get("culprit") or {}).get("line") or CULPRIT_NOT_NAMED
    return f"{stall['line']}; {culprit}; stacks: dzctl logs {job_id} --stacks"


def event_line(event: dict, watch: JobWatch) -> str | None:
    kind = event.get("event")
    per = "GPU" if watch.accelerator == "gpu" else "rank"
    if kind == "start":
        predicted = predicted_text(watch.speed, None, watch.world_size)
        warning = speed_warning(watch.speed)
        return (
            f"start  {watch.job_id}: {watch.world_size} rank(s) on {len(watch.nodes)} node(s)"
            + (f", resuming at step {event['step']}" if event.get("step") else "")
            + (f", {global_batch_text(event)}" if global_batch_text(event) else "")
            + (f"; {predicted}" if predicted else "")
            + (f"\n{warning}" if warning else "")  # said once, where the run begins
        )
    if kind == "step":
        parts = [f"step {event.get('step')}/{event.get('max_steps')}"]
        if event.get("loss") is not None:
            parts.append(f"loss {event['loss']:.3f}")
        if event.get("learning_rate") is not None:
            parts.append(f"lr {event['learning_rate']:.1e}")
        if event.get("grad_norm") is not None:
            parts.append(f"grad-norm {event['grad_norm']:.3g}")
        rate = rate_text(event.get("tokens_per_s"), watch.world_size, per)
        if rate:
            parts.append(rate)
        if event.get("padding_efficiency") is not None:
            parts.append(f"pad-eff {event['padding_efficiency']:.0%}")
        if preference_metrics.line_text(event):  # train.stage dpo | kto
            parts.append(preference_metrics.line_text(event))
        if event.get("eta_s") is not None:
            parts.append(f"eta {format_duration(event['eta_s'])}")
        return "  ".join(parts)
    if kind == "eval":
        return eval_text(event)
    if kind == "checkpoint":
        best = "  (best eval loss: kept out of rotation)" if event.get("best") else ""
        return f"checkpoint  step {event.get('step')}: {event.get('path')}{best}"
    if kind == "end":
        parts = [f"end  step {event.get('step')}/{event.get('max_steps')}"]
        if event.get("loss") is not None:
            parts.append(f"mean loss {event['loss']:.3f}")
        rate = rate_text(event.get("tokens_per_s"), watch.world_size, per)
        if rate:
            parts.append(rate)
        if event.get("stopped_early"):
            parts.append(f"stopped early at step {event.get('step')} (train.early_stopping)")
        if event.get("best_eval_loss") is not None:
            parts.append(f"best eval loss {event['best_eval_loss']:.4f} at step {event.get('best_step')}")
        if event.get("path"):
            parts.append(f"model {event['path']}")
        return "  ".join(parts)
    # An error event is said once, by final_lines, with the rank's exit code and fix.
    return None


def eval_text(event: dict) -> str:
    """An ``eval`` event in one line: the loss per token, the best so far, what it decided."""
    parts = [f"eval  step {event.get('step')}/{event.get('max_steps')}"]
    if event.get("eval_loss") is not None:
        over = f"{event.get('eval_tokens') or 0:,} tokens"
        if event.get("eval_unit"):  # a preference stage's loss is a mean per pair (KTO: per answer), not per token
            over = f"{event.get('eval_rows') or 0:,} {event['eval_unit']} ({over})"
        parts.append(f"eval loss {event['eval_loss']:.4f} over {over}")
    if event.get("best_eval_loss") is not None:
        parts.append(f"best {event['best_eval_loss']:.4f} at step {event.get('best_step')}")
    if event.get("best_checkpoint"):
        parts.append(f"best checkpoint {event['best_checkpoint']}")
    if event.get("stopped_early"):
        parts.append("early stopping: no progress for train.early_stopping.patience evals, ending here")
    return "  ".join(parts)


def message_line(message: Message) -> str:
    """A rank message the first time it is seen (later copies only count)."""
    label = {"error": "error", "warning": "warning"}.get(message.level, "note")
    return f"{label} [{ranks_text(message)}]  {message.text}"


def final_lines(watch: JobWatch, now: float, *, with_failure: bool = True) -> list[str]:
    """The job's end; then, unless the caller reports it itself, the first failure and its fix."""
    lines = [f"{watch.state}  {watch.job_id} after {format_duration(now - watch.started_at)}"]
    if with_failure and watch.failure:
        lines += failure_lines(watch.failure)
    return lines
