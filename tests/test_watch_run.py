"""Watching a real run of the tiny CPU job (process runtime on localhost: real ZeRO-3, 2 ranks, no SSH).

- a real terminal (tmux): the live view at two moments, step advancing, loss shown; then the end state;
- a pipe into a file: plain lines, at most two per logging step, no JSON, no duplicated rank warnings;
- ``status --plot``: a PNG that decodes, whose stored series are read back and match progress.jsonl;
- ``train.report_to: [tensorboard]``: event files, fetched with ``logs --fetch`` and read by TensorBoard's reader.

The piped run holds 4 rows out for evaluation (``data.eval_split: 4``, ``train.eval_steps: 10``): its
eval losses are checked in each of these places too (issue 26), with ``grad_norm`` in the plot.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STEPS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dzctl() -> list[str]:
    # The venv's dzctl script when there is one (what a user types), else the same entry point.
    script = Path(sys.executable).parent / "dzctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator"]


def _launch_argv(remote: Path, name: str, steps: int, *extra_sets: str) -> list[str]:
    sets = [
        f"name={name}",
        f"launch.remote_dir={remote}",
        f"launch.master_port={_free_port()}",
        f"launch.python={sys.executable}",  # the ranks run this venv's torch and DeepSpeed
        f"train.max_steps={steps}",
        *extra_sets,
    ]
    argv = [*_dzctl(), "launch", "jobs/tiny-cpu.yaml", "--hosts", "hostfiles/localhost.txt", "--runtime", "process"]
    return [*argv, "--follow", *(x for s in sets for x in ("--set", s))]


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "DZCTL_HOME": str(home), "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """One run with its output piped into a file, TensorBoard on; the other tests read what it left."""
    tmp = tmp_path_factory.mktemp("watch-piped")
    home, remote, name = tmp / "home", tmp / "remote", f"watch-{uuid.uuid4().hex[:6]}"
    log = tmp / "follow.txt"
    argv = _launch_argv(
        remote, name, STEPS, "train.report_to=[tensorboard]", "train.save_steps=10", "data.eval_split=4",
        "train.eval_steps=10",
    )  # fmt: skip
    argv.append("--skip-collective")  # no test here reads the check's figures (about 6 s a launch)
    with open(log, "w") as out:
        proc = subprocess.run(argv, cwd=ROOT, env=_env(home), stdout=out, stderr=subprocess.STDOUT, timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    job_id = re.search(r"started (\S+) on", text).group(1)
    output = remote / "output" / name
    events = [json.loads(x) for x in (output / "progress.jsonl").read_text().splitlines()]
    return {"home": home, "job_id": job_id, "output": output, "text": text, "events": events, "tmp": tmp}


def test_piped_follow_prints_plain_lines_at_most_two_per_step(piped_run):
    lines = piped_run["text"].splitlines()
    after = lines[next(i for i, x in enumerate(lines) if x.startswith("started ")) + 1 :]
    # No JSON: neither the progress records nor the Trainer's own dicts.
    assert not [x for x in after if "dzctl-progress" in x or x.lstrip().startswith("{") or '"event"' in x]
    for step in range(1, STEPS + 1):
        matching = [x for x in after if re.match(rf"step {step}/{STEPS}\s+loss \d+\.\d{{3}}\s+lr ", x)]
        assert len(matching) == 1, (step, after)
    evals = [e for e in piped_run["events"] if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20]
    for event in evals:
        loss, tokens = event["eval_loss"], event["eval_tokens"]
        said = f"eval  step {event['step']}/{STEPS}  eval loss {loss:.4f} over {tokens:,} tokens"
        assert sum(x.startswith(said) for x in after) == 1, (said, after)
    assert len(after) <= 2 * STEPS + len(evals), after
    # Every rank printed the same warnings; each is shown once.
    assert len(set(after)) == len(after), after
    assert sum("FutureWarning" in x for x in after) <= 1
    # Messages name the ranks that printed them (the trainer prefixes its lines with "[rankN]:").
    assert any(x.startswith("note [rank 0]  dzctl-train: 2 ranks") for x in after), after
    assert any(x.startswith("checkpoint  step 10: ") for x in after)
    assert any(x.startswith("end  step 20/20") for x in after)
    assert after[-1].startswith(f"succeeded  {piped_run['job_id']}")


def test_the_view_of_the_real_log_once_succeeded_has_no_latest_note(piped_run):
    """The consolidation's notes are the last a rank prints; once the job has ended they are not "latest"."""
    from rich.console import Console

    from orchestrator.observe.view import render
    from orchestrator.observe.watchstate import JobWatch, NodeView

    log = (piped_run["tmp"] / "remote" / "jobs" / piped_run["job_id"] / "rank-0.log").read_text(encoding="utf-8")
    assert "dzctl-train: consolidating the model into" in log
    watch = JobWatch("tiny-cpu", piped_run["job_id"], [NodeView(0, "localhost", 2)], 0.0, accelerator="cpu")
    for line in log.splitlines():
        watch.feed(0, line, 1.0)  # one read of the whole log: one clock reading, as the follow loop feeds it
    watch.set_nodes({0: ("exited", 0)}, "succeeded")
    watch.ended_at = 2.0
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render(watch, now=2.0))
    text = console.file.getvalue()
    assert "SUCCEEDED" in text and f"model {piped_run['output'] / 'model'}" in text, text
    last = [e for e in piped_run["events"] if e["event"] == "eval"][-1]
    assert f"eval loss {last['eval_loss']:.4f} at step {STEPS}" in text, text
    assert "latest:" not in text and "consolidating" not in text, text


def test_status_watch_off_a_terminal_replays_the_job_as_plain_lines(piped_run):
    proc = subprocess.run(
        [*_dzctl(), "status", piped_run["job_id"], "--watch"],
        cwd=ROOT, env=_env(piped_run["home"]), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [x.split()[1] for x in lines if x.startswith("step ")] == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)]
    assert "dzctl-progress" not in proc.stdout and len(set(lines)) == len(lines)
    assert lines[-1].startswith(f"succeeded  {piped_run['job_id']}")


def test_status_plot_stores_the_series_it_draws(piped_run, tmp_path):
    from PIL import Image

    png = tmp_path / "loss.png"
    proc = subprocess.run(
        [*_dzctl(), "status", piped_run["job_id"], "--plot", str(png)],
        cwd=ROOT, env=_env(piped_run["home"]), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with Image.open(png) as image:
        image.verify()  # the PNG decodes
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 300
        series = json.loads(image.text["dzctl-series"])
    steps = [e for e in piped_run["events"] if e["event"] == "step"]
    assert set(series) == {
        "loss", "smoothed loss (EMA 0.9)", "learning rate", "useful tokens/s", "grad norm", "eval loss"
    }  # fmt: skip
    evals = [e for e in piped_run["events"] if e["event"] == "eval"]
    assert series["eval loss"]["step"] == [10, 20]
    assert series["eval loss"]["value"] == pytest.approx([e["eval_loss"] for e in evals])
    assert series["grad norm"]["value"] == pytest.approx([e["grad_norm"] for e in steps])
    assert series["loss"]["step"] == list(range(1, STEPS + 1))
    assert series["loss"]["value"] == pytest.approx([e["loss"] for e in steps])
    assert series["learning rate"]["value"] == pytest.approx([e["learning_rate"] for e in steps])
    rated = [e for e in steps if e["tokens_per_s"]]
    assert series["useful tokens/s"]["value"] == pytest.approx([e["tokens_per_s"] for e in rated])
    smoothed = series["smoothed loss (EMA 0.9)"]["value"]
    assert len(smoothed) == STEPS and smoothed[0] == pytest.approx(steps[0]["loss"])
    assert min(series["loss"]["value"]) <= smoothed[-1] <= max(series["loss"]["value"])


def test_tensorboard_event_files_are_written_named_and_fetched(piped_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = _env(piped_run["home"])
    job_id = piped_run["job_id"]
    folder = piped_run["output"] / "tensorboard" / job_id
    status = subprocess.run([*_dzctl(), "status", job_id], cwd=ROOT, env=env, capture_output=True, text=True)
    assert f"tensorboard: localhost:{folder}" in status.stdout, status.stdout
    evals = [e for e in piped_run["events"] if e["event"] == "eval"]
    assert f"eval loss {evals[-1]['eval_loss']:.4f} at step {STEPS}" in status.stdout, status.stdout
    fetched = tmp_path / "fetched"
    proc = subprocess.run(
        [*_dzctl(), "logs", job_id, "--fetch", str(fetched)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x) for x in (fetched / "progress.jsonl").read_text().splitlines()] == piped_run["events"]
    accumulator = EventAccumulator(str(fetched / "tensorboard" / job_id))
    accumulator.Reload()
    assert "train/loss" in accumulator.Tags()["scalars"]
    scalars = accumulator.Scalars("train/loss")
    steps = [e for e in piped_run["events"] if e["event"] == "step"]
    assert [s.step for s in scalars] == [e["step"] for e in steps]
    assert [s.value for s in scalars] == pytest.approx([e["loss"] for e in steps], rel=1e-5)
    # The eval loss goes where the training loss goes (HF's TensorBoard callback names it eval/loss).
    assert [(s.step, s.value) for s in accumulator.Scalars("eval/loss")] == [
        (e["step"], pytest.approx(e["eval_loss"], rel=1e-5)) for e in evals
    ]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (./dev test installs it)")
def test_live_view_in_a_real_terminal(tmp_path):
    socket_name = f"dzctl-watch-{uuid.uuid4().hex[:8]}"  # our own tmux server: nothing else is touched
    tmux = ["tmux", "-L", socket_name]
    steps = 60
    script = tmp_path / "run.sh"
    name = f"watch-{uuid.uuid4().hex[:6]}"
    argv = _launch_argv(tmp_path / "remote", name, steps, "train.save_steps=25")
    exports = "".join(f"export {k}={json.dumps(v)}\n" for k, v in _env(tmp_path / "home").items() if k.isidentifier())
    script.write_text(
        f"{exports}cd {json.dumps(str(ROOT))}\n"
        + " ".join(json.dumps(a) for a in argv)
        + f"\necho DZCTL-EXIT=$?\n{' '.join(_dzctl())} status {name}\necho STATUS-EXIT=$?\nsleep 600\n"
    )
    subprocess.run([*tmux, "new-session", "-d", "-s", "w", "-x", "120", "-y", "45", "bash", str(script)], check=True)
    try:
        running: dict[int, str] = {}  # step -> the screen showing it
        end = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            screen = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "w"], capture_output=True, text=True, check=True
            ).stdout
            if "STATUS-EXIT=" in screen:
                # The whole pane, scrolled-off lines too: the view's end state, then `dzctl status`.
                end = subprocess.run(
                    [*tmux, "capture-pane", "-p", "-t", "w", "-S", "-300"], capture_output=True, text=True, check=True
                ).stdout
                break
            shown = re.search(rf"step (\d+)/{steps}", screen)
            # A whole frame only: the nodes table ("GPU mem peak") is drawn after the metrics, so a
            # capture taken while tmux is still painting the frame is not mistaken for the view.
            whole = "GPU mem peak" in screen
            if "RUNNING" in screen and shown and whole and re.search(r"loss \d+\.\d{4}", screen):
                running.setdefault(int(shown.group(1)), screen)
            time.sleep(0.15)
        assert end is not None, "the job did not end in time"
        moments = sorted(s for s in running if 0 < s < steps)
        assert len(moments) >= 2, running
        first, later = running[moments[0]], running[moments[-1]]
        # One view redrawn in place: each capture holds exactly one progress line, and no raw records.
        for screen in (first, later):
            assert len(re.findall(rf"step \d+/{steps}", screen)) == 1, screen
            assert "dzctl-progress" not in screen and "{'loss'" not in screen
            assert re.search(r"smoothed \d+\.\d{4} \(EMA 0\.9\)", screen), screen
            assert "tok/s total" in screen and "localhost" in screen, screen
        assert "DZCTL-EXIT=0" in end and "STATUS-EXIT=0" in end, end
        view_end, status = end.split("DZCTL-EXIT=0")
        # On a terminal, `dzctl status JOB` adds a small loss chart of the run's history.
        assert f"loss over {steps} logged steps" in status and "┤" in status, status
        end = view_end
        assert "SUCCEEDED" in end and f"step {steps}/{steps}" in end, end
        assert "checkpoints at step 25, 50, 60" in end, end
        warnings = re.findall(r"^\s*warning\s+\[[^\]]+\]\s+(.+)$", end, re.MULTILINE)
        assert len(warnings) == len(set(warnings)), end  # each distinct message once
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
