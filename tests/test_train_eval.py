"""Evaluation end to end (issue 26): real DeepSpeed ZeRO-3 on 2 CPU ranks (gloo), one run, several promises.

jobs/tiny-cpu.yaml, packed, on its first 24 rows (``data.max_rows: 24``), holds 8 of them out
(``data.eval_split: 8``) and evaluates every 5 steps at learning rate 1e-2, where its eval loss
falls to a low point and rises again as the 16 training rows are learnt by heart. With
``save_steps: 5``, ``save_total_limit: 1``, ``save_best`` and early stopping (patience 3) the run must:

- never train on a held-out row, and hold out the rows the stated rule picks (xxh3-64 of
  each row's conversation, seeded with ``train.seed``: the 8 smallest keys);
- report an eval loss equal, to 1e-5, to a per-token loss computed here directly, one
  unpacked row at a time, with the weights the run ended with;
- stop at the step the pure rule (``evaluation.policy.stop_step``) gives for its own eval curve,
  as a success that says so;
- keep the best checkpoint through rotation (``save_total_limit: 1``) and name it in
  ``dzctl-best.json``;
- log ``grad_norm`` on every step, with ``train.max_grad_norm`` in the ds_config and the
  Trainer agreeing on it (HF refuses a mismatch).

(A relaunch of the stopped run finding it finished is held by the record it leaves,
``dzctl-finished.json`` with ``stopped_early``, here, and by tests/test_eval.py's
``finished_run`` test: a second run here would cost CI half a minute.)
"""

from __future__ import annotations

import json
import math

import pytest
import xxhash
from test_train import JOB, train

from orchestrator.planning.datarows import to_messages
from orchestrator.train import checkpoints
from orchestrator.train.data.cache import MANIFEST
from orchestrator.train.data.mapped import MappedData
from orchestrator.train.evaluation.policy import stop_step
from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow

SEED = 42  # jobs/tiny-cpu.yaml's train.seed (the default)
HELD = 8
ROWS = 24  # the first rows of the file the run reads (data.max_rows)
PATIENCE = 3
MAX_STEPS = 60
SETS = (
    f"train.max_steps={MAX_STEPS}",
    "train.learning_rate=1.0e-2",
    "train.packing=true",
    f"data.eval_split={HELD}",
    # 16 rows to train on: the tiny model learns them by heart and the held-out loss turns up. On all 64
    # it kept falling to step 60 once alpaca's instruction and input were joined by one newline (issue 43):
    # the rule never stopped it, a test of luck, not of the rule.
    f"data.max_rows={ROWS}",
    "train.eval_steps=5",
    "train.save_steps=5",
    "train.save_total_limit=1",
    "train.save_best=true",
    f"train.early_stopping={{patience: {PATIENCE}}}",
    "train.max_grad_norm=0.5",
)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("eval") / "out"
    result = train(output, *SETS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return output, read_events(output / "progress.jsonl"), result.stdout


def _cache(output):
    (folder,) = [p for p in (output / "data-cache").iterdir() if (p / MANIFEST).is_file()]
    return folder


def _ids_text(ids) -> str:
    return "," + ",".join(str(i) for i in ids) + ","


def test_held_out_rows_are_the_rules_and_never_in_a_training_row(stopped_run):
    from orchestrator.train.data.tokenizer import load_tokenizer

    output, _, _ = stopped_run
    lines = (JOB.parent / "data/tiny-alpaca-zh.jsonl").read_text().splitlines()[:ROWS]
    rows = [json.loads(line) for line in lines]
    keys = []
    for number, row in enumerate(rows, start=1):
        messages = to_messages(row, "alpaca", f"row {number}")
        text = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
        keys.append(xxhash.xxh3_64_intdigest(text.encode("utf-8"), seed=SEED))
    # A row's prompt (its user turn) stands for it: responses longer than max_seq_len 128 are cut short.
    prompts = [dict(to_messages(row, "alpaca", "row"))["user"] for row in rows]
    assert len(set(prompts)) == len(rows)
    expected = sorted(prompts[i] for i in sorted(range(len(rows)), key=lambda i: keys[i])[:HELD])

    tokenizer = load_tokenizer("builtin:byte-level", "tiny-qwen3")
    held = MappedData(_cache(output), "eval")
    trained = MappedData(_cache(output), "train")
    held_ids = [held.example_arrays(int(i))[0].tolist() for i in held.members]
    found = sorted(
        tokenizer.decode(ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0] for ids in held_ids
    )
    assert found == expected
    assert trained.members is not None and len(trained.members) == len(rows) - HELD
    training_rows = [_ids_text(trained.item(r)["input_ids"]) for r in range(trained.rows)]
    assert sum(len(trained.item(r)["seq_lens"]) for r in range(trained.rows)) == len(rows) - HELD
    for ids in held_ids:
        assert not any(_ids_text(ids) in row for row in training_rows)
    for prompt in expected:  # not even its prompt alone is trained on
        encoded = _ids_text(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert not any(encoded in row for row in training_rows), prompt


def test_eval_loss_equals_a_direct_per_token_loss_with_the_final_weights(stopped_run):
    import torch
    from transformers import AutoModelForCausalLM

    output, events, _ = stopped_run
    end = events[-1]
    last_eval = [e for e in events if e["event"] == "eval"][-1]
    assert last_eval["step"] == end["step"] and end["eval_loss"] == last_eval["eval_loss"]
    model = AutoModelForCausalLM.from_pretrained(output / "model", dtype=torch.float32).eval()
    held = MappedData(_cache(output), "eval")
    total, count = 0.0, 0
    with torch.no_grad():
        for index in held.members:
            ids, labels = held.example_arrays(int(index))
            logits = model(input_ids=torch.from_numpy(ids).unsqueeze(0)).logits[0]
            targets = torch.from_numpy(labels[1:])
            keep = targets != -100
            losses = torch.nn.functional.cross_entropy(logits[:-1][keep].double(), targets[keep], reduction="sum")
            total += float(losses)
            count += int(keep.sum())
    assert last_eval["eval_tokens"] == count
    assert last_eval["eval_loss"] == pytest.approx(total / count, abs=1e-5)


def test_early_stopping_ends_at_the_rules_step_as_a_success(stopped_run):
    output, events, stdout = stopped_run
    evals = [e for e in events if e["event"] == "eval"]
    curve = [(e["step"], e["eval_loss"]) for e in evals]
    assert [s for s, _ in curve] == list(range(5, curve[-1][0] + 1, 5))
    stop = stop_step(curve, PATIENCE)
    assert stop is not None and stop < MAX_STEPS, " ".join(f"{s}:{loss:.3f}" for s, loss in curve)
    end = events[-1]
    assert end["event"] == "end" and end["step"] == stop and end["stopped_early"] is True
    assert evals[-1]["stopped_early"] is True
    assert f"early stopping ended the run at step {stop}" in stdout
    assert checkpoints.read_finished(output).stopped_early


def test_the_best_checkpoint_survives_rotation_and_is_named(stopped_run):
    output, events, _ = stopped_run
    evals = [e for e in events if e["event"] == "eval"]
    best_step, best_loss = min(((e["step"], e["eval_loss"]) for e in evals), key=lambda x: x[1])
    final = events[-1]["step"]
    assert best_step < final  # what makes this a test of rotation: the best is not the newest
    found = [(c.step, c.complete) for c in checkpoints.list_checkpoints(output)]
    assert found == [(best_step, True), (final, True)]  # save_total_limit 1, plus the best
    record = json.loads((output / checkpoints.BEST).read_text())
    assert {k: record[k] for k in ("checkpoint", "step", "eval_loss")} == {
        "checkpoint": f"checkpoint-{best_step}",
        "step": best_step,
        "eval_loss": best_loss,
    }
    marked = [e["step"] for e in events if e["event"] == "checkpoint" and e.get("best")]
    assert best_step in marked and events[-1]["best_checkpoint"] == str(output / f"checkpoint-{best_step}")


def test_grad_norm_is_logged_on_every_step(stopped_run):
    # The run itself holds max_grad_norm 0.5 to the ds_config's gradient_clipping: HF's DeepSpeed
    # integration refuses to start when the two differ (its "mismatches" ValueError).
    _, events, _ = stopped_run
    norms = [e["grad_norm"] for e in events if e["event"] == "step"]
    assert len(norms) == events[-1]["step"]
    assert all(isinstance(n, float) and math.isfinite(n) and n > 0 for n in norms)
    assert max(norms) > 0.5  # so the bound of 0.5 did clip (HF logs the norm before clipping)
