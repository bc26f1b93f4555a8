"""Sequence packing: the packer (pure), the packed batch's loss (no attention leaks), token counting."""

from __future__ import annotations

import itertools
import random

import pytest

from orchestrator.planning.packing import resolve_packing
from orchestrator.spec.job import JobSpec
from orchestrator.train.data import packing

SEQ = 4096


def lognormal_lengths(count: int, seed: int, cap: int = SEQ) -> list[int]:
    # The benchmark's mix (benchmarks/sft_data.py): log-normal, median 500, mean ~700.
    rng = random.Random(seed)
    return [max(8, min(cap, round(rng.lognormvariate(6.2146, 0.82)))) for _ in range(count)]


def test_rows_fit_and_hold_every_example_once():
    lengths = lognormal_lengths(3000, seed=1)
    rows = packing.pack(lengths, SEQ, seed=7)
    assert all(sum(lengths[i] for i in row) <= SEQ for row in rows)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))


def test_rows_come_out_nearly_full_on_a_realistic_mix():
    lengths = lognormal_lengths(3000, seed=2)
    rows = packing.pack(lengths, SEQ, seed=7)
    stats = packing.stats(lengths, rows, SEQ)
    # Unpacked, one example a row: about 17% of each row holds data.
    assert sum(lengths) / (len(lengths) * SEQ) < 0.2
    assert stats.efficiency > 0.97, stats


def test_packing_is_deterministic_for_a_seed_and_shuffles_with_it():
    lengths = lognormal_lengths(2500, seed=3)
    assert packing.pack(lengths, SEQ, seed=11) == packing.pack(list(lengths), SEQ, seed=11)
    assert packing.pack(lengths, SEQ, seed=11) != packing.pack(lengths, SEQ, seed=12)


def test_an_example_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="more than a row"):
        packing.pack([10, SEQ + 1], SEQ, seed=0)


def test_packed_example_masks_each_first_label_and_keeps_lengths():
    examples = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
        {"input_ids": [4, 5], "labels": [4, 5]},
    ]
    row = packing.packed_example(examples, [1, 0])
    assert row == {"input_ids": [4, 5, 1, 2, 3], "labels": [-100, 5, -100, 2, 3], "seq_lens": [2, 3]}


def _spec(**train) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "j", "model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "train": train}
    )


def test_auto_is_on_for_gpu_and_off_for_cpu_and_synthetic():
    assert resolve_packing(_spec()) is True
    assert resolve_packing(_spec().model_copy(update={"accelerator": "cpu"})) is False
    synthetic = _spec().model_copy(update={"data": _spec().data.model_copy(update={"path": "synthetic:random"})})
    assert resolve_packing(synthetic) is False
    assert resolve_packing(_spec(packing=False)) is False
    with pytest.raises(Exception, match="true, false or auto"):
        _spec(packing="yes")


RESOLVED = [("gpu", "auto", True), ("cpu", "auto", False), ("cpu", True, True), ("gpu", False, False)]


@pytest.mark.parametrize(("accelerator", "packing_value", "expected"), RESOLVED)
def test_launch_writes_the_resolved_packing_into_the_job_file(tmp_path, accelerator, packing_value, expected):
    from orchestrator.backends.jobfiles import node_spec
    from orchestrator.backends.launcher import memory_choice
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.launchplan import make_plan
    from orchestrator.planning.resolve import resolve_job
    from orchestrator.spec.hostfile import load_nodes
    from orchestrator.spec.job import load_job

    (tmp_path / "d.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n', encoding="utf-8")
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n", encoding="utf-8")
    (tmp_path / "job.yaml").write_text(
        f"name: j\naccelerator: {accelerator}\nruntime: process\nmodel: {{name_or_path: Qwen3-8B}}\n"
        f"data: {{path: d.jsonl}}\ntrain: {{packing: {str(packing_value).lower()}}}\n",
        encoding="utf-8",
    )
    inputs = read_inputs(load_job(tmp_path / "job.yaml"))
    nodes = load_nodes(tmp_path / "hosts.txt")
    memory, ds_config = memory_choice(inputs, nodes, 140.0 if accelerator == "gpu" else None, None)
    plan = make_plan(inputs.spec, nodes, "j-20260101-0000-abcd")
    resolved = resolve_job(inputs, nodes, memory, ds_config, plan, None)
    assert node_spec(resolved, plan.nodes[0])["train"]["packing"] is expected


def test_status_shows_useful_tokens_and_padding_efficiency():
    import json

    from orchestrator.commands.jobs import render_status
    from orchestrator.observe.status import JobStatus, parse_progress

    step = {"event": "step", "time": 1.0, "step": 3, "max_steps": 9, "loss": 2.0, "tokens_per_s": 4100.0}
    step.update(processed_tokens_per_s=8200.0, padding_efficiency=0.5, eta_s=12.0)
    progress, age, _ = parse_progress(json.dumps(step) + "\n", now=2.0)
    assert progress["tokens_per_s"] == 4100.0 and progress["padding_efficiency"] == 0.5
    text = render_status(JobStatus("j", "j-1", "running", [], progress, age, None))
    assert "useful tokens/s 4,100" in text and "(padding efficiency 50%)" in text


# --- the packed batch through a real model (torch) ---------------------------------------------

torch = pytest.importorskip("torch")


def _tiny_model(attn: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()


def _examples(seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    out = []
    for n in (13, 7, 30, 21, 5):
        ids = [rng.randrange(1, 97) for _ in range(n)]
        # Loss on the "response" only, as the data module labels it; two examples train on
        # every token (as synthetic rows do), so their first label is not IGNORE by itself.
        prompt = 0 if n in (21, 5) else n // 3
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def _alone_loss(model, example) -> float:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([example["input_ids"]]), labels=torch.tensor([example["labels"]]))
    return float(out.loss)


def _per_example_losses(logits: torch.Tensor, labels: torch.Tensor, cu: list[int]) -> list[float]:
    """Each example's mean loss over its own response tokens, read from the packed logits."""
    shift_logits, shift_labels = logits[0, :-1], labels[0, 1:]
    losses = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="none")
    out = []
    for start, end in itertools.pairwise(cu):
        # Predictions made inside the example: positions start..end-2 predict start+1..end-1.
        span_labels, span_loss = shift_labels[start : end - 1], losses[start : end - 1]
        keep = span_labels != -100
        out.append(float(span_loss[keep].sum() / keep.sum()))
    return out


@pytest.mark.parametrize("kernel", ["sdpa_split", "sdpa_mask"])
def test_a_packed_batch_gives_every_example_its_own_loss(kernel):
    from orchestrator.train.data.collate import PackedCollator
    from orchestrator.train.model import attention

    examples = _examples()
    alone = [_alone_loss(_tiny_model(), e) for e in examples]
    packed_model = _tiny_model(attention.register(kernel))
    rows = [packing.packed_example(examples, [0, 1, 2]), packing.packed_example(examples, [3, 4])]
    batch = PackedCollator()(rows)
    with torch.no_grad():
        out = packed_model(**batch)
    cu = batch["cu_seq_lens_q"].tolist()
    got = _per_example_losses(out.logits, batch["labels"], cu)
    assert got == pytest.approx(alone, abs=1e-5)
    # The model's own loss is the mean over all response tokens of all examples.
    counts = [sum(1 for label in e["labels"][1:] if label != -100) for e in examples]
    weighted = sum(loss * n for loss, n in zip(alone, counts, strict=True)) / sum(counts)
    assert float(out.loss) == pytest.approx(weighted, abs=1e-5)


def test_without_the_packed_kernel_examples_leak_into_each_other():
    # The check above can fail: the same flattened batch through plain causal
    # attention (no boundaries) gives the later examples different losses.
    from orchestrator.train.data.collate import PackedCollator

    examples = _examples()
    alone = [_alone_loss(_tiny_model(), e) for e in examples]
    rows = [packing.packed_example(examples, [0, 1, 2, 3, 4])]
    batch = PackedCollator()(rows)
    plain = {k: batch[k] for k in ("input_ids", "labels")}  # no position ids, no boundaries
    with torch.no_grad():
        out = _tiny_model("sdpa")(**plain)
    got = _per_example_losses(out.logits, batch["labels"], batch["cu_seq_lens_q"].tolist())
    assert got[0] == pytest.approx(alone[0], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(got[1:], alone[1:], strict=True)) > 1e-3


def test_progress_counts_real_tokens_not_padding():
    from orchestrator.train.data.collate import PackedCollator
    from orchestrator.train.run import Collator, batch_tokens, token_rates

    examples = _examples()
    padded = Collator(pad_id=0)(examples)
    real, processed, count = batch_tokens(padded)
    assert real == sum(len(e["input_ids"]) for e in examples) == 76
    assert processed == 5 * 32 and count == 5  # five rows padded to 30, rounded up to 32
    packed = PackedCollator()([packing.packed_example(examples, [0, 1, 2, 3, 4])])
    assert batch_tokens(packed) == (76, 76, 5)
    assert token_rates(76.0, 160.0) == {"processed_tokens_per_s": 160.0, "padding_efficiency": 0.475}


def test_the_chunked_fused_loss_on_a_packed_batch_is_the_per_example_mean():
    # train.fused_loss: chunked (orchestrator/train/model/loss.py) replaces the model's forward: a packed
    # batch must keep its examples' boundaries through it, in the loss and in the gradients. Imported
    # outright: a skip here (the import once was optional) hid that this was never run.
    import torch

    from orchestrator.train.data.collate import PackedCollator
    from orchestrator.train.model import attention, loss

    examples = _examples()
    alone = [_alone_loss(_tiny_model(), e) for e in examples]
    counts = [sum(1 for label in e["labels"][1:] if label != -100) for e in examples]
    weighted = sum(a * n for a, n in zip(alone, counts, strict=True)) / sum(counts)
    batch = PackedCollator()([packing.packed_example(examples, [0, 1, 2]), packing.packed_example(examples, [3, 4])])
    plain = _tiny_model(attention.register("sdpa_split")).train()
    chunked = _tiny_model(attention.register("sdpa_split")).train()  # the same weights (seed 0)
    loss.apply_fused_loss(chunked, "chunked")
    out, reference = chunked(**batch), plain(**batch)
    assert out.logits is None  # the chunked loss ran: no full logits were built
    assert reference.logits is not None
    assert float(out.loss) == pytest.approx(weighted, abs=1e-5)
    assert float(out.loss) == pytest.approx(float(reference.loss), abs=1e-5)
    out.loss.backward()
    reference.loss.backward()
    for (name, mine), theirs in zip(chunked.named_parameters(), plain.parameters(), strict=True):
        assert mine.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
