"""The live view of a job on a terminal: a pure function from ``JobWatch`` to a rich renderable.

``commands/follow.py`` fetches (logs, node states) and redraws this with
``rich.live.Live``; nothing here does I/O, so tests render it to text.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .lines import global_batch_text, predicted_text, rate_text, speed_warning, stall_line
from .rankfailure import failure_lines
from .watchstate import JobWatch, ema, format_duration, ranks_text, sparkline

# The loss's smoothing: an EMA with factor 0.9 (about the last 10 logging steps),
# bias-corrected; TensorBoard's slider defaults to 0.6, W&B's to a similar EMA.
EMA_FACTOR = 0.9
MAX_MESSAGES = 8
ENDED_STATES = frozenset({"succeeded", "failed", "stopped"})
STATE_STYLE = {
    "running": "green",
    "stalled": "bold yellow",
    "succeeded": "bold green",
    "failed": "bold red",
    "stopped": "yellow",
}


def render(watch: JobWatch, now: float, width: int = 100) -> RenderableType:
    steps = watch.steps
    last_step = steps[-1] if steps else None
    last_any = next((e for e in reversed(watch.events) if e.get("step") is not None), None)
    step = (last_any or {}).get("step") or 0
    max_steps = (last_any or {}).get("max_steps") or 0
    elapsed = (watch.ended_at or now) - watch.started_at

    header = Text()
    header.append(f"{watch.job_id}  ", style="bold")
    header.append(watch.state.upper(), style=STATE_STYLE.get(watch.state, "cyan"))
    header.append(f"  elapsed {format_duration(elapsed)}")

    bar = Table.grid(padding=(0, 2))
    bar.add_row(
        ProgressBar(total=max(max_steps, 1), completed=step, width=max(10, min(50, width - 50))),
        f"step {step}/{max_steps or '?'}",
        f"epoch {last_step['epoch']:.2f}" if last_step and last_step.get("epoch") is not None else "epoch -",
        f"eta {format_duration(0 if watch.state == 'succeeded' else (last_step or {}).get('eta_s'))}",
        global_batch_text(watch.last("start")) or "",
    )

    parts: list[RenderableType] = [header]
    failure = watch.failure
    if failure:
        # At the top, once: the first failed rank's own words and fix (its traceback is in `dzctl logs`).
        parts += [Text(line, style="bold red") for line in failure_lines(failure)]
    stalled = stall_line(watch.stall, watch.job_id) if watch.state not in ENDED_STATES else None
    if stalled:  # every rank runs, none ends a step: the bound that applied and the culprit, in one line
        parts.append(Text(stalled, style="bold yellow"))
    parts += [bar, _metrics(watch, last_step, width)]
    parts.append(_nodes(watch, watch.ended_at or now))
    checkpoints = watch.checkpoints
    if checkpoints:
        shown = ", ".join(str(c.get("step")) for c in checkpoints[-6:])
        more = f" (+{len(checkpoints) - 6} earlier)" if len(checkpoints) > 6 else ""
        parts.append(Text(f"checkpoints at step {shown}{more}; last {checkpoints[-1].get('path')}"))
    end = watch.last("end")
    if end and end.get("stopped_early"):
        parts.append(Text(f"stopped early at step {end.get('step')} (train.early_stopping)", style="bold"))
    if end and end.get("path"):
        parts.append(Text(f"model {end['path']}", style="bold"))
    notes = [m for m in watch.messages.values() if m.level == "info"]
    if notes and watch.state not in ENDED_STATES:
        # What the job is doing now; once it has ended, the model line or the failure says it.
        parts.append(Text(f"latest: {max(notes, key=lambda m: m.order).text}", style="dim", no_wrap=True,
                          overflow="ellipsis"))  # fmt: skip
    warning = speed_warning(watch.speed)
    if warning:  # the plan's own: the ranks cannot see that their network bounds them
        parts.append(Text(warning, style="yellow"))
    parts.append(_messages(watch))
    return Group(*parts)


def _metrics(watch: JobWatch, last_step: dict | None, width: int) -> RenderableType:
    if last_step is None:
        return Text("waiting for the first step", style="dim")
    lines: list[RenderableType] = []
    losses = [s["loss"] for s in watch.steps if s.get("loss") is not None]
    if losses:
        smoothed = ema(losses, EMA_FACTOR)[-1]
        spark = Text(sparkline(losses, max(10, min(40, width - 62))), style="cyan")
        lines += _flow([f"loss {losses[-1]:.4f}", f"smoothed {smoothed:.4f} (EMA {EMA_FACTOR})", spark], width)
    evals = [e for e in watch.evals if e.get("eval_loss") is not None]
    if evals:
        last = evals[-1]
        cells: list[str | Text] = [f"eval loss {last['eval_loss']:.4f} at step {last.get('step')}"]
        if last.get("best_eval_loss") is not None:
            cells.append(f"best {last['best_eval_loss']:.4f} at step {last.get('best_step')}")
        if len(evals) > 1:
            cells.append(
                Text(sparkline([e["eval_loss"] for e in evals], max(10, min(40, width - 62))), style="magenta")
            )
        lines += _flow(cells, width)
    per = "GPU" if watch.accelerator == "gpu" else "rank"
    rate = rate_text(last_step.get("tokens_per_s"), watch.world_size, per)
    row = [f"lr {last_step['learning_rate']:.2e}" if last_step.get("learning_rate") is not None else "lr -"]
    if last_step.get("grad_norm") is not None:
        row.append(f"grad norm {last_step['grad_norm']:.3g}")
    if rate:
        row.append(f"useful {rate}, {last_step['tokens_per_s']:,.0f} tok/s total")
    if last_step.get("processed_tokens_per_s"):
        row.append(f"processed {last_step['processed_tokens_per_s']:,.0f} tok/s")
    if last_step.get("padding_efficiency") is not None:
        row.append(f"padding efficiency {last_step['padding_efficiency']:.0%}")
    predicted = predicted_text(watch.speed, last_step, watch.world_size)
    if predicted:
        row.append(predicted)
    return Group(*lines, *_flow(row, width))


def _flow(cells: list[str | Text], width: int) -> list[Text]:
    """Cells two spaces apart, each kept whole: one that would pass ``width`` starts the next line.

    A packed job's rate line (useful, processed, padding efficiency) is wider than an
    80-column terminal; cut short it would lose the figures, wrapped mid-cell it would split them.
    """
    lines: list[Text] = []
    current: list[Text] = []
    used = 0
    for cell in cells:
        text = cell if isinstance(cell, Text) else Text(cell)
        if current and used + 2 + len(text) > width:
            lines.append(Text("  ").join(current))
            current, used = [], 0
        used += (2 if current else 0) + len(text)
        current.append(text)
    if current:
        lines.append(Text("  ").join(current))
    for line in lines:
        line.no_wrap, line.overflow = True, "ellipsis"  # a single cell wider than the terminal
    return lines


def _nodes(watch: JobWatch, now: float) -> RenderableType:
    table = Table(box=None, padding=(0, 2), header_style="bold", show_edge=False)
    for name in ("node", "host", "state", "GPU mem peak", "last output"):
        table.add_column(name)
    for node in watch.nodes:
        state = node.state if node.exit_code is None else f"{node.state} ({node.exit_code})"
        peak = f"{node.gpu_mem_peak_gib:.1f} GiB" if node.gpu_mem_peak_gib is not None else "-"
        age = f"{format_duration(now - node.last_output)} ago" if node.last_output is not None else "-"
        table.add_row(str(node.node_rank), node.host, Text(state, style=STATE_STYLE.get(node.state, "")), peak, age)
    return table


def _messages(watch: JobWatch) -> RenderableType:
    shown = [m for m in watch.messages.values() if m.level in ("error", "warning")]
    if not shown:
        return Text("no warnings from the ranks", style="dim")
    shown.sort(key=lambda m: (m.level != "error", m.order))
    lines = []
    for message in shown[:MAX_MESSAGES]:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(message.level, style="red" if message.level == "error" else "yellow")
        line.append(f" [{ranks_text(message)}]  {message.text}")
        lines.append(line)
    if len(shown) > MAX_MESSAGES:
        lines.append(Text(f"... {len(shown) - MAX_MESSAGES} more: dzctl logs {watch.job_id}", style="dim"))
    return Group(*lines)
