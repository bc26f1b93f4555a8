"""Plain lines for a pipe, CI or a file: one per logging step, plus start, checkpoint, end and messages.

Pure: each function turns one new thing (an event, a first-seen message, the
final status) into a line, or ``None`` when it has nothing to say.
"""

from __future__ import annotations

from .watchstate import JobWatch, Message, format_duration, ranks_text


def rate_text(tokens_per_s: float | None, world_size: int, per: str) -> str | None:
    if not tokens_per_s:
        return None
    return f"{tokens_per_s / max(world_size, 1):,.0f} tok/s/{per}"


def event_line(event: dict, watch: JobWatch) -> str | None:
    kind = event.get("event")
    per = "GPU" if watch.accelerator == "gpu" else "rank"
    if kind == "start":
        return f"start  {watch.job_id}: {watch.world_size} rank(s) on {len(watch.nodes)} node(s)" + (
            f", resuming at step {event['step']}" if event.get("step") else ""
        )
    if kind == "step":
        parts = [f"step {event.get('step')}/{event.get('max_steps')}"]
        if event.get("loss") is not None:
            parts.append(f"loss {event['loss']:.3f}")
        if event.get("learning_rate") is not None:
            parts.append(f"lr {event['learning_rate']:.1e}")
        rate = rate_text(event.get("tokens_per_s"), watch.world_size, per)
        if rate:
            parts.append(rate)
        if event.get("padding_efficiency") is not None:
            parts.append(f"pad-eff {event['padding_efficiency']:.0%}")
        if event.get("eta_s") is not None:
            parts.append(f"eta {format_duration(event['eta_s'])}")
        return "  ".join(parts)
    if kind == "checkpoint":
        return f"checkpoint  step {event.get('step')}: {event.get('path')}"
    if kind == "end":
        parts = [f"end  step {event.get('step')}/{event.get('max_steps')}"]
        if event.get("loss") is not None:
            parts.append(f"mean loss {event['loss']:.3f}")
        rate = rate_text(event.get("tokens_per_s"), watch.world_size, per)
        if rate:
            parts.append(rate)
        if event.get("path"):
            parts.append(f"model {event['path']}")
        return "  ".join(parts)
    if kind == "error":
        return f"error  rank {event.get('rank')}: {event.get('reason')}"
    return None


def message_line(message: Message) -> str:
    """A rank message the first time it is seen (later copies only count)."""
    label = {"error": "error", "warning": "warning"}.get(message.level, "note")
    return f"{label} [{ranks_text(message)}]  {message.text}"


def final_line(watch: JobWatch, now: float) -> str:
    line = f"{watch.state}  {watch.job_id} after {format_duration(now - watch.started_at)}"
    failure = watch.first_failure
    if failure:
        line += f": rank {failure['node_rank']} on {failure['host']} (exit {failure['exit_code']}): {failure['reason']}"
    return line
