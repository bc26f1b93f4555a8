"""The watch pieces that need no job: line classes, distinct messages, plain lines, the view, charts, imports."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.commands.busy import busy
from orchestrator.observe.lines import event_line, final_lines, message_line
from orchestrator.observe.view import render
from orchestrator.observe.watchstate import JobWatch, NodeView, block_chart, classify, ema, sparkline

ROOT = Path(__file__).resolve().parents[1]

# Lines as the tiny job's two ranks print them (from a real `launch --follow --raw` on one node).
RANK_OUTPUT = [
    "dzctl-train: 2 ranks, micro-batch 4, accumulation 1, fp32",
    "/venv/lib/python3.11/site-packages/transformers/training_args.py:1541: FutureWarning: `gradient_checkpointing`"
    " is deprecated and will be removed in v6. Use `activation_checkpointing` instead.",
    '  warnings.warn(f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.", FutureWarning)',
    "/venv/lib/python3.11/site-packages/transformers/training_args.py:1541: FutureWarning: `gradient_checkpointing`"
    " is deprecated and will be removed in v6. Use `activation_checkpointing` instead.",
    '  warnings.warn(f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.", FutureWarning)',
    'dzctl-progress {"event": "start", "time": 1.0, "step": 0, "max_steps": 30, "world_size": 2}',
    'dzctl-progress {"event": "step", "time": 2.0, "step": 1, "max_steps": 30, "epoch": 0.11, "loss": 5.9488,'
    ' "learning_rate": 0.003, "tokens_per_s": 2242.2, "eta_s": 75.0, "gpu_mem_peak_gib": 12.5}',
    "{'loss': '5.949', 'grad_norm': '2.186', 'learning_rate': '0.003', 'epoch': '0.1111'}",
    "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]Writing model shards: 100%|█| 1/1 [00:00<00:00]",
    'dzctl-progress {"event": "checkpoint", "time": 3.0, "step": 1, "max_steps": 30, "path": "/out/checkpoint-1"}',
    "[rank1]:RuntimeError: something broke",
    "",
]


def _watch(slots=(2,)) -> JobWatch:
    nodes = [NodeView(i, f"node{i}", s) for i, s in enumerate(slots)]
    return JobWatch("tiny", "tiny-20261130-000000-abcd", nodes, started_at=0.0, accelerator="cpu")


def _fed(watch: JobWatch) -> list:
    return [new for new in (watch.feed(0, line, 10.0) for line in RANK_OUTPUT) if new is not None]


def test_classify_sorts_records_noise_and_messages():
    kinds = [classify(line)[0] for line in RANK_OUTPUT]
    assert kinds == ["message", "message", "noise", "message", "noise", "progress", "progress", "noise", "noise",
                     "progress", "message", "blank"]  # fmt: skip
    assert classify(RANK_OUTPUT[1])[1] == (
        "warning",
        "FutureWarning: `gradient_checkpointing` is deprecated and will be removed in v6. Use "
        "`activation_checkpointing` instead. (transformers/training_args.py:1541)",
        None,
    )
    assert classify(RANK_OUTPUT[10])[1] == ("error", "RuntimeError: something broke", 1)


def test_each_distinct_message_is_new_once_and_counts_its_copies():
    watch = _watch()
    new = _fed(watch)
    assert [kind for kind, _ in new] == ["message", "message", "event", "event", "event", "message"]
    warning = next(m for m in watch.messages.values() if m.level == "warning")
    assert warning.count == 2 and warning.nodes == {0}
    error = next(m for m in watch.messages.values() if m.level == "error")
    assert error.ranks == {1}
    assert message_line(warning).startswith("warning [node 0 ×2]  FutureWarning")
    assert message_line(error) == "error [rank 1]  RuntimeError: something broke"
    assert watch.nodes[0].last_output == 10.0 and watch.nodes[0].gpu_mem_peak_gib == 12.5


def test_plain_lines_say_step_loss_lr_rate_and_eta():
    watch = _watch()
    _fed(watch)
    lines = [event_line(e, watch) for e in watch.events]
    assert lines == [
        "start  tiny-20261130-000000-abcd: 2 rank(s) on 1 node(s)",
        "step 1/30  loss 5.949  lr 3.0e-03  1,121 tok/s/rank  eta 1m15s",
        "checkpoint  step 1: /out/checkpoint-1",
    ]
    watch.state, watch.first_failure = "failed", {"node_rank": 0, "host": "node0", "exit_code": 1, "reason": "boom"}
    assert final_lines(watch, 125.0) == [
        "failed  tiny-20261130-000000-abcd after 2m05s",
        "first failure: node 0 (node0), exit 1: boom",
    ]
    assert final_lines(watch, 125.0, with_failure=False) == ["failed  tiny-20261130-000000-abcd after 2m05s"]


def test_step_line_shows_padding_efficiency_when_the_trainer_reports_it():
    watch = _watch()
    event = {"event": "step", "step": 3, "max_steps": 9, "loss": 1.0, "tokens_per_s": 4000.0,
             "padding_efficiency": 0.48, "processed_tokens_per_s": 8333.0}  # fmt: skip
    assert event_line(event, watch) == "step 3/9  loss 1.000  2,000 tok/s/rank  pad-eff 48%"


def _text(renderable, width=110) -> str:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def test_the_view_shows_progress_loss_rate_nodes_checkpoints_and_messages_once():
    watch = _watch()
    _fed(watch)
    for step, loss in [(2, 5.5), (3, 5.0)]:
        event = {"event": "step", "step": step, "max_steps": 30, "epoch": 0.3, "loss": loss,
                 "learning_rate": 0.003, "tokens_per_s": 4000.0, "eta_s": 60.0}  # fmt: skip
        watch.feed(0, "dzctl-progress " + json.dumps(event), 11.0)
    watch.set_nodes({0: ("running", None)}, "running")
    text = _text(render(watch, now=14.0))
    assert "RUNNING" in text and "elapsed 0m14s" in text
    assert "step 3/30" in text and "epoch 0.30" in text and "eta 1m00s" in text
    assert f"loss 5.0000  smoothed {ema([5.9488, 5.5, 5.0], 0.9)[-1]:.4f} (EMA 0.9)" in text
    assert "lr 3.00e-03" in text and "useful 2,000 tok/s/rank, 4,000 tok/s total" in text
    assert "node0" in text and "running" in text and "12.5 GiB" in text and "0m03s ago" in text
    assert "checkpoints at step 1; last /out/checkpoint-1" in text
    assert text.count("FutureWarning") == 1 and "[node 0 ×2]" in text
    assert "[rank 1]" in text and "RuntimeError: something broke" in text


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_loss_line_stays_whole_beside_the_packed_rate_line(width):
    """With packing the rate line carries processed tokens and padding efficiency too; it must
    not squeeze the loss line's cells (they shared one grid and "smoothed" wrapped at 120)."""
    watch = _watch()
    for step, loss in [(1, 5.9), (2, 5.5), (3, 5.0)]:
        event = {"event": "step", "step": step, "max_steps": 60, "epoch": 0.3, "loss": loss,
                 "learning_rate": 0.003, "tokens_per_s": 4321.0, "processed_tokens_per_s": 4555.0,
                 "padding_efficiency": 0.95, "eta_s": 60.0}  # fmt: skip
        watch.feed(0, "dzctl-progress " + json.dumps(event), 11.0)
    watch.set_nodes({0: ("running", None)}, "running")
    lines = _text(render(watch, now=14.0), width=width).splitlines()
    loss_line = next(line for line in lines if "loss 5.0000" in line)
    assert f"smoothed {ema([5.9, 5.5, 5.0], 0.9)[-1]:.4f} (EMA 0.9)" in loss_line
    # Every figure whole on some line, none cut short, no line past the terminal's width.
    for cell in ("lr 3.00e-03", "useful 2,160 tok/s/rank, 4,321 tok/s total", "processed 4,555 tok/s",
                 "padding efficiency 95%"):  # fmt: skip
        assert any(cell in line for line in lines), (cell, lines)
    assert all(len(line.rstrip()) <= width for line in lines) and not any("…" in line for line in lines[:6])


def test_ema_is_bias_corrected_and_sparkline_spans_the_range():
    assert ema([4.0, 4.0, 4.0], 0.9) == [4.0, 4.0, 4.0]
    assert ema([1.0, 0.0], 0.5) == [1.0, 1.0 / 3.0]
    assert sparkline([3, 2, 1]) == "█▅▁"
    assert len(sparkline(list(range(1000)), width=40)) == 40
    chart = block_chart([5, 4, 3, 2, 1], width=10, height=4)
    assert len(chart) == 4 and chart[0].strip().startswith("5") and chart[-1].strip().startswith("1")


def test_the_controller_import_path_never_loads_matplotlib(tmp_path):
    # `dzctl status` (list and one job's help), launch and the live view load; matplotlib must not.
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from orchestrator.cli import main\n"
        "import orchestrator.commands.launch, orchestrator.commands.jobs\n"
        "import orchestrator.observe.view, orchestrator.observe.lines\n"
        "for args in (['status'], ['status', '--help'], ['launch', '--help'], ['logs', '--help']):\n"
        "    assert CliRunner().invoke(main, args).exit_code == 0, args\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'PIL', 'tensorboard', 'torch')))\n"
    )
    env = {**os.environ, "DZCTL_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stdout.strip() == "[]"


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_a_long_step_says_it_is_still_going_and_a_short_one_stays_silent():
    slow, quick = _Pipe(), _Pipe()
    with busy("preflight: checking 8 node(s)", after_s=0.05, stream=slow):
        time.sleep(0.3)
    with busy("uploading", after_s=1.0, stream=quick):
        pass
    assert slow.getvalue() == "preflight: checking 8 node(s) (still going after 0.05 s)\n"
    assert quick.getvalue() == ""


def test_plot_refuses_a_name_that_is_not_png_and_a_job_without_steps(tmp_path):
    from orchestrator.errors import InputError, RuntimeFailure
    from orchestrator.observe.plot import write_plot

    with pytest.raises(InputError, match="written as PNG"):
        write_plot([], tmp_path / "loss.jpg", title="job")
    with pytest.raises(RuntimeFailure, match="no step has been logged yet"):
        write_plot([{"event": "start", "step": 0}], tmp_path / "loss.png", title="job")
    assert not (tmp_path / "loss.png").exists()


def test_rank_output_is_prefixed_line_by_line_and_read_back_as_ranks():
    from orchestrator.train.rankprefix import RankPrefixed

    sink = _Pipe()
    stream = RankPrefixed(sink, "[rank3]:")
    print('dzctl-progress {"event": "step", "step": 1}', file=stream)  # print: the text, then "\n", separately
    stream.write("a warning\n  its source line\npartial ")
    stream.write("line\n\n")
    assert sink.getvalue() == (
        '[rank3]:dzctl-progress {"event": "step", "step": 1}\n'
        "[rank3]:a warning\n[rank3]:  its source line\n[rank3]:partial line\n\n"
    )
    watch = _watch()
    for line in sink.getvalue().splitlines():
        watch.feed(0, line, 1.0)
    assert watch.events == [{"event": "step", "step": 1}]
    message = watch.messages["a warning"]
    assert message.ranks == {3} and message_line(message) == "warning [rank 3]  a warning"


def test_only_launched_multi_rank_runs_get_the_prefix(monkeypatch):
    from orchestrator.train import rankprefix

    out, err = _Pipe(), _Pipe()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    rankprefix.prefix_rank_output({"RANK": "0", "WORLD_SIZE": "1"})
    assert sys.stdout is out
    rankprefix.prefix_rank_output({"RANK": "1", "WORLD_SIZE": "2"})
    print("hello")
    assert out.getvalue() == "[rank1]:hello\n" and isinstance(sys.stderr, rankprefix.RankPrefixed)


# The end of the tiny job as rank 0 prints it (train/run.py): the last step, its checkpoint, the
# consolidation's two notes, the end event. The follow loop feeds one read of the log as one chunk.
RUN_END = [
    '[rank0]:dzctl-progress {"event": "step", "time": 20.0, "step": 30, "max_steps": 30, "epoch": 3.0,'
    ' "loss": 4.1, "learning_rate": 0.003, "tokens_per_s": 2000.0, "eta_s": 0.0}',
    '[rank0]:dzctl-progress {"event": "checkpoint", "time": 21.0, "step": 30, "max_steps": 30,'
    ' "path": "/out/checkpoint-30"}',
    "[rank0]:dzctl-train: consolidating the model into /out/model (gathering the ZeRO-3 shards)",
    "[rank0]:dzctl-train: model consolidated in 0.4 s",
    '[rank0]:dzctl-progress {"event": "end", "time": 22.0, "step": 30, "max_steps": 30, "loss": 4.5,'
    ' "path": "/out/model"}',
]


def _latest(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("latest:")]


def test_latest_is_the_last_note_printed_and_goes_once_the_job_has_ended():
    watch = _watch()
    _fed(watch)
    for line in RUN_END[:3]:
        watch.feed(0, line, 20.0)
    watch.set_nodes({0: ("running", None)}, "running")
    assert _latest(_text(render(watch, now=21.0))) == [
        "latest: dzctl-train: consolidating the model into /out/model (gathering the ZeRO-3 shards)"
    ]
    watch.feed(0, RUN_END[3], 20.0)  # the same read of the log: the same clock
    assert _latest(_text(render(watch, now=21.0))) == ["latest: dzctl-train: model consolidated in 0.4 s"]
    watch.feed(0, RUN_END[4], 20.0)
    watch.set_nodes({0: ("exited", 0)}, "succeeded")
    text = _text(render(watch, now=23.0))
    assert "SUCCEEDED" in text and "model /out/model" in text
    assert _latest(text) == [] and "consolidating" not in text


def test_the_wait_between_polls_ends_when_a_nodes_log_stream_ends():
    # A node's log stream ends with its ranks: `launch --follow` polls again at once instead of up to
    # POLL_S later. A stream still running keeps the wait to its full length.
    import threading

    from orchestrator.commands.follow import POLL_S, wait_for_a_stream_to_end

    ending, running = threading.Event(), threading.Event()
    streams = [threading.Thread(target=ending.wait, daemon=True), threading.Thread(target=running.wait, daemon=True)]
    for stream in streams:
        stream.start()
    threading.Timer(0.1, ending.set).start()
    started = time.monotonic()
    assert wait_for_a_stream_to_end(streams, POLL_S, alive=2) is True
    assert time.monotonic() - started < POLL_S / 2
    started = time.monotonic()
    assert wait_for_a_stream_to_end(streams, 0.3, alive=1) is False  # the other one is still streaming
    assert time.monotonic() - started >= 0.3
    # A stream that ended while the poll ran (before this wait began) ends the wait at once too.
    running.set()
    streams[1].join()
    started = time.monotonic()
    assert wait_for_a_stream_to_end(streams, POLL_S, alive=1) is True
    assert time.monotonic() - started < POLL_S / 2
