"""Evaluation's parts at small scale (issue 26), no training: each on real files, the builder, the CLI.

The real run (ZeRO-3, 2 gloo ranks) is tests/test_train_eval.py; the watched launch with
eval rows (view, plain lines, status, plot, TensorBoard) is tests/test_watch_run.py.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console
from test_train_checkpoints import make_checkpoint
from test_watch import _watch

from orchestrator.cli import main
from orchestrator.commands.jobs import eval_lines
from orchestrator.observe.lines import event_line
from orchestrator.observe.plot import plot_series
from orchestrator.observe.status import parse_progress
from orchestrator.observe.view import render
from orchestrator.planning import dsconfig
from orchestrator.planning.evalsplit import holdout_count
from orchestrator.spec.job import load_job
from orchestrator.train import checkpoints
from orchestrator.train.data import holdout
from orchestrator.train.data.build import BuildSettings, build
from orchestrator.train.data.mapped import MappedData
from orchestrator.train.data.sources import resolve_sources
from orchestrator.train.data.tokenizer import load_tokenizer
from orchestrator.train.evaluation.loss import eval_batches
from orchestrator.train.evaluation.policy import EvalHistory, stop_step

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "tiny-cpu.yaml"


# --- early stopping on constructed curves -------------------------------------------------------


@pytest.mark.parametrize(
    ("curve", "patience", "min_delta", "expected"),
    [
        # Falls, then three evals above its low point at step 30: stops at the third.
        ([3.0, 2.5, 2.2, 2.3, 2.25, 2.4, 2.1], 3, 0.0, 60),
        ([3.0, 2.5, 2.2, 2.3, 2.25, 2.4], 4, 0.0, None),  # patience not used up
        ([3.0, 2.5, 2.0, 1.5], 1, 0.0, None),  # always improving
        # Improvements of 0.05 do not count with min_delta 0.1: two of them use patience 2 up.
        ([3.0, 2.95, 2.9, 2.0], 2, 0.1, 30),
        # A real improvement resets the count: 2.3 (no), 1.9 (yes), 1.95, 1.92 (no, no).
        ([2.2, 2.3, 1.9, 1.95, 1.92], 2, 0.0, 50),
        ([2.0, 2.0], 1, 0.0, 20),  # equal is not better
    ],
)
def test_early_stopping_stops_at_the_right_step(curve, patience, min_delta, expected):
    steps = [(10 * (i + 1), loss) for i, loss in enumerate(curve)]
    assert stop_step(steps, patience, min_delta) == expected


def test_the_best_moves_on_any_improvement_while_patience_counts_only_big_ones():
    history = EvalHistory(patience=5, min_delta=0.1)
    verdicts = [history.record(step, loss) for step, loss in ((10, 3.0), (20, 2.95), (30, 2.97))]
    assert [v.new_best for v in verdicts] == [True, True, False]
    assert (history.best_step, history.best_loss, history.without_progress) == (20, 2.95, 2)


# --- which rows are held out --------------------------------------------------------------------


def test_holdout_counts_a_fraction_up_and_a_count_as_given():
    assert holdout_count(0.1, 30) == 3 and holdout_count(0.1, 31) == 4 and holdout_count(0.05, 5) == 1
    assert holdout_count(8, 72) == 8


def test_held_out_takes_the_smallest_keys_and_keeps_copies_of_a_row_together():
    keys = np.array([50, 10, 40, 10, 30, 20], dtype=np.uint64)
    assert holdout.held_out(keys, 1).tolist() == [False, True, False, True, False, False]  # both 10s
    assert holdout.held_out(keys, 3).tolist() == [False, True, False, True, False, True]
    with pytest.raises(holdout.DataError, match="leaving nothing to train on"):
        holdout.held_out(keys, 6)
    with pytest.raises(holdout.DataError, match="nothing is left to train on"):
        holdout.held_out(np.array([7, 7, 7], dtype=np.uint64), 1)


def _alpaca_rows(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


@pytest.mark.parametrize("packing", [False, True])
def test_the_builder_holds_out_rows_before_packing_and_copies_stay_on_one_side(tmp_path, packing):
    rows = [{"instruction": f"q{i}", "input": "", "output": f"answer {i}"} for i in range(30)]
    rows += [dict(rows[3]), dict(rows[17])]  # two rows given twice
    data = tmp_path / "rows.jsonl"
    _alpaca_rows(data, rows)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.read_text(encoding="utf-8").replace("data/tiny-alpaca-zh.jsonl", str(data)), encoding="utf-8")
    loaded = load_job(job, ["data.eval_split=0.2"])
    tokenizer = load_tokenizer("builtin:byte-level", "tiny")
    folder = tmp_path / "cache"
    folder.mkdir()
    settings = BuildSettings(64, packing, 42, "fail", eval_split=0.2)
    result = build(resolve_sources(loaded), tokenizer, settings, folder, lambda _: None, lambda _: None, workers=1)
    from orchestrator.train.data.cache import write_manifest

    write_manifest(folder, result.files, result.info)
    held, trained = MappedData(folder, "eval"), MappedData(folder, "train")

    def prompt(ids) -> str:
        return tokenizer.decode(ids).split("user\n", 1)[1].split("<|im_end|>", 1)[0]

    held_prompts = [prompt(held.example_arrays(int(i))[0]) for i in held.members]
    trained_prompts = [prompt(trained.example_arrays(int(i))[0]) for i in trained.members]
    assert len(held_prompts) + len(trained_prompts) == len(rows)
    assert len(held_prompts) >= holdout_count(0.2, len(rows)) and not set(held_prompts) & set(trained_prompts)
    for copy in ("q3", "q17"):  # both copies on one side
        assert held_prompts.count(copy) + trained_prompts.count(copy) == 2
        assert copy not in held_prompts or copy not in trained_prompts
    # The rule as stated: the smallest seeded keys of the rows' conversations.
    expected = sorted(range(30), key=lambda i: holdout.row_key((("user", f"q{i}"), ("assistant", f"answer {i}")), 42))
    assert set(held_prompts) == {f"q{i}" for i in expected[: len(set(held_prompts))]}
    # What the Trainer gets: rows (packed or not) made only of training examples, every one once.
    texts = [prompt(trained.item(r)["input_ids"]) for r in range(trained.rows)] if not packing else None
    if packing:
        assert sum(len(trained.item(r)["seq_lens"]) for r in range(trained.rows)) == len(trained_prompts)
        assert sum(len(held.item(r)["seq_lens"]) for r in range(held.rows)) == len(held_prompts)
        for r in range(trained.rows):
            decoded = tokenizer.decode(trained.item(r)["input_ids"])
            assert not any(f"user\n{p}<|im_end|>" in decoded for p in held_prompts)
    else:
        assert sorted(texts) == sorted(trained_prompts)


# --- bad input: exit 2 at load or plan, naming the key and the fix, no host touched --------------


def _job_beside_its_data(tmp_path, text: str | None = None):
    """The tiny job in ``tmp_path`` with its data file beside it (a local file, shipped and checked here)."""
    import shutil

    shutil.copy(JOB.parent / "data/tiny-alpaca-zh.jsonl", tmp_path / "rows.jsonl")
    job = tmp_path / "job.yaml"
    text = text if text is not None else JOB.read_text(encoding="utf-8")
    job.write_text(text.replace("data/tiny-alpaca-zh.jsonl", "rows.jsonl"), encoding="utf-8")
    return job


def _dry_run(tmp_path, job, *sets: str):
    argv = ["launch", str(job), "--hosts", str(ROOT / "hostfiles/localhost.txt"), "--runtime", "process", "--dry-run"]
    for item in sets:
        argv += ["--set", item]
    return CliRunner().invoke(main, argv, env={"DZCTL_HOME": str(tmp_path / "home")})


@pytest.mark.parametrize(
    ("sets", "key", "says"),
    [
        (("data.eval_split=72",), "data.eval_split", "72 of the data's 72 rows, leaving nothing to train on"),
        (("data.eval_split=0.99",), "data.eval_split", "72 of the data's 72 rows"),
        (("train.eval_steps=5",), "train.eval_steps", "train.eval_steps needs eval data"),
        (("train.save_best=true",), "train.save_best", "train.save_best needs eval data"),
        (("train.early_stopping={patience: 2}",), "train.early_stopping", "train.early_stopping needs eval data"),
        (
            ("data.eval_split=4", "train.early_stopping={patience: 2}"),
            "train.early_stopping",
            "without train.eval_steps",
        ),
        (("data.eval_split=1.0",), "data.eval_split", "must be a fraction between 0 and 1"),
        (("data.eval_split=true",), "data.eval_split", "not true/false"),
        (("data.eval_split=4", "data.eval.path=x.jsonl"), "data", "not both"),
        (("data.eval.max_rows=3",), "data.eval", "data.eval.path is missing"),
    ],
)
def test_bad_eval_input_exits_2_before_any_host(tmp_path, sets, key, says):
    result = _dry_run(tmp_path, _job_beside_its_data(tmp_path), *sets)
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert result.output.startswith("error: ") and key in result.output.splitlines()[0]  # where, and which key


def test_the_eval_split_error_names_the_job_files_line(tmp_path):
    text = JOB.read_text(encoding="utf-8").replace("  format: alpaca\n", "  format: alpaca\n  eval_split: 500\n")
    job = _job_beside_its_data(tmp_path, text)
    line = text.splitlines().index("  eval_split: 500") + 1
    result = _dry_run(tmp_path, job)
    assert result.exit_code == 2, result.output
    assert f"{job}:{line}: data.eval_split holds out 500 rows" in result.output
    assert "fix: hold out fewer rows" in result.output
    # Node-side data (an absolute path) is counted by the builder on the nodes instead.
    assert _dry_run(tmp_path, job, f"data.path={tmp_path / 'rows.jsonl'}").exit_code == 0


def test_data_eval_is_shipped_and_rewritten_for_the_nodes(tmp_path):
    held = tmp_path / "held.jsonl"
    _alpaca_rows(held, [{"instruction": "q", "input": "", "output": "a"}])
    job = tmp_path / "job.yaml"
    text = JOB.read_text(encoding="utf-8").replace(
        "data/tiny-alpaca-zh.jsonl", str(JOB.parent / "data/tiny-alpaca-zh.jsonl")
    )
    job.write_text(
        text.replace("  format: alpaca\n", "  format: alpaca\n  eval: {path: held.jsonl}\n"), encoding="utf-8"
    )
    from orchestrator.planning.inputs import read_inputs

    inputs = read_inputs(load_job(job))
    (item,) = [s for s in inputs.shipped if s.part == "eval"]
    assert (item.local, item.name) == (held, "data/eval-held.jsonl")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        text.replace("  format: alpaca\n", "  format: alpaca\n  eval: {path: missing.jsonl}\n"), encoding="utf-8"
    )
    with pytest.raises(Exception, match=r"data\.eval\.path: .*missing\.jsonl no such file"):
        read_inputs(load_job(bad))


# --- gradients ------------------------------------------------------------------------------------


def test_max_grad_norm_is_the_ds_configs_gradient_clipping():
    loaded = load_job(JOB, ["train.max_grad_norm=0.3"])
    resolved = dsconfig.resolve_defaults(loaded.spec)
    assert dsconfig.build_ds_config(loaded.spec, resolved, 2)["gradient_clipping"] == 0.3
    filled = dsconfig.fill_auto({"gradient_clipping": "auto"}, resolved, 2, loaded.spec)
    assert filled["gradient_clipping"] == 0.3
    assert dsconfig.build_ds_config(load_job(JOB).spec, resolved, 2)["gradient_clipping"] == 1.0  # the default


# --- rotation keeps the best; a run that stopped early is finished ---------------------------------


def test_rotation_keeps_the_best_checkpoint_out_of_the_limit(tmp_path):
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, step, 2)
    deleted = checkpoints.rotate(tmp_path, 1, "run-a", protect=4)
    assert sorted(p.name for p in deleted) == ["checkpoint-2", "checkpoint-6"]
    assert [c.step for c in checkpoints.list_checkpoints(tmp_path)] == [4, 8]
    checkpoints.write_best(tmp_path, checkpoints.Best(4, 1.25, "run-a"))
    record = json.loads((tmp_path / "dzctl-best.json").read_text())
    assert record == {"checkpoint": "checkpoint-4", "step": 4, "eval_loss": 1.25, "lineage": "run-a"}
    assert checkpoints.read_best(tmp_path, "run-b") is None and checkpoints.read_best(tmp_path).step == 4
    # Without the protection the same rotation takes the best away.
    assert [p.name for p in checkpoints.rotate(tmp_path, 1, "run-a")] == ["checkpoint-4"]


def test_a_run_that_stopped_early_is_finished_until_more_is_asked(tmp_path):
    make_checkpoint(tmp_path, 40, 2)
    (tmp_path / "model").mkdir()
    checkpoints.write_finished(
        tmp_path, lineage="run-a", step=40, max_steps=60, epochs=1.0, model=tmp_path / "model", stopped_early=True
    )
    chosen = checkpoints.resume_candidate("auto", tmp_path)
    assert checkpoints.finished_run(chosen, 60, 1.0, model_here=True).stopped_early
    assert checkpoints.finished_run(chosen, 80, 1.0) is None  # a larger max_steps trains on


# --- the eval's batches: every row once, every rank the same number of forwards -------------------


@pytest.mark.parametrize(("rows", "world", "micro"), [(8, 2, 4), (7, 2, 2), (1, 4, 3), (13, 3, 2)])
def test_every_rank_runs_as_many_batches_and_every_row_counts_once(rows, world, micro):
    per_rank = [eval_batches(rows, r, world, micro) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    counted = sorted(i for batches in per_rank for batch in batches if batch for i in batch)
    assert counted == list(range(rows))


# --- what a watcher sees: plain lines, the view, status, the plot --------------------------------

EVAL = {"event": "eval", "step": 20, "max_steps": 60, "eval_loss": 2.71828, "eval_tokens": 1234, "eval_rows": 8,
        "best_eval_loss": 2.5, "best_step": 10, "best_checkpoint": "/out/checkpoint-10"}  # fmt: skip
STEP = {"event": "step", "step": 20, "max_steps": 60, "loss": 2.0, "learning_rate": 1e-3, "grad_norm": 0.8772}


def test_plain_lines_show_the_eval_and_the_gradient_norm():
    watch = _watch()
    assert event_line(EVAL, watch) == (
        "eval  step 20/60  eval loss 2.7183 over 1,234 tokens  best 2.5000 at step 10  "
        "best checkpoint /out/checkpoint-10"
    )
    assert "grad-norm 0.877" in event_line(STEP, watch)
    end = {"event": "end", "step": 40, "max_steps": 60, "stopped_early": True, "best_eval_loss": 2.5, "best_step": 10}
    assert "stopped early at step 40 (train.early_stopping)  best eval loss 2.5000 at step 10" in event_line(end, watch)


def test_the_live_view_shows_the_eval_and_the_gradient_norm():
    watch = _watch()
    watch.events += [{"event": "start", "step": 0, "world_size": 2}, STEP, {**EVAL, "step": 10, "eval_loss": 2.5}, EVAL]
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(render(watch, now=5.0))
    text = console.file.getvalue()
    assert "eval loss 2.7183 at step 20" in text and "best 2.5000 at step 10" in text and "grad norm 0.877" in text


def test_status_gives_the_last_eval_in_json_and_text():
    text = "\n".join(json.dumps(e) for e in (STEP, EVAL))
    progress, _, _ = parse_progress(text, now=0.0)
    assert progress["eval"] == {k: EVAL[k] for k in progress["eval"]} and progress["eval"]["eval_loss"] == 2.71828
    assert progress["grad_norm"] == 0.8772 and progress["stopped_early"] is False
    assert eval_lines(progress) == [
        "eval loss 2.7183 at step 20 (1,234 tokens)  best 2.5000 at step 10  best checkpoint /out/checkpoint-10"
    ]
    ended, _, _ = parse_progress(text + "\n" + json.dumps({"event": "end", "step": 20, "stopped_early": True}))
    assert eval_lines(ended)[-1] == "stopped early at step 20 (train.early_stopping)"
    assert parse_progress(json.dumps(STEP))[0]["eval"] is None


def test_the_plot_series_hold_the_eval_loss_and_the_gradient_norm():
    series = plot_series([STEP, {**STEP, "step": 21, "grad_norm": 0.5}, EVAL])
    assert series["eval loss"] == ([20], [2.71828])
    assert series["grad norm"] == ([20, 21], [0.8772, 0.5])


# --- data.eval: a cache of its own, built and waited for like the training data's ----------------


def test_data_eval_is_its_own_cache_and_the_nodes_other_ranks_wait_for_the_right_one(tmp_path, monkeypatch):
    from orchestrator.train.data import prepare

    monkeypatch.setenv("DZCTL_JOB_ID", f"eval-{tmp_path.name}")  # this test's own launch token
    train_rows = tmp_path / "train.jsonl"
    _alpaca_rows(train_rows, [{"instruction": f"t{i}", "input": "", "output": f"train {i}"} for i in range(20)])
    held_rows = tmp_path / "held.jsonl"
    _alpaca_rows(held_rows, [{"instruction": f"e{i}", "input": "", "output": f"eval {i}"} for i in range(5)])
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.read_text(encoding="utf-8").replace("data/tiny-alpaca-zh.jsonl", "train.jsonl"), encoding="utf-8"
    )
    loaded = load_job(job, ["data.eval.path=held.jsonl", "train.eval_steps=2"])
    tokenizer = load_tokenizer("builtin:byte-level", "tiny")
    cache = tmp_path / "cache"

    def ready(source_set: str, local_rank: int = 0):
        return prepare.prepare(
            loaded, tokenizer, packing=True, local_rank=local_rank, cache_dir=cache, say=lambda _: None,
            source_set=source_set,
        )  # fmt: skip

    built_train, built_eval = ready("train"), ready("eval")
    assert built_train.key != built_eval.key
    assert (built_train.data.examples, built_eval.data.examples) == (20, 5)
    assert not (built_train.folder / "eval_examples.bin").exists()  # nothing held out of the training data
    # A waiting rank of this launch maps what its builder said for each set, not the other's.
    assert ready("train", local_rank=1).key == built_train.key
    assert ready("eval", local_rank=1).key == built_eval.key
    decoded = tokenizer.decode(built_eval.data.item(0)["input_ids"])
    assert "eval " in decoded and "train " not in decoded
