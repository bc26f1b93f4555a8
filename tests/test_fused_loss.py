"""``train.fused_loss``: the chunked loss equals Hugging Face's, alone, in a real model and under ZeRO-3;
``auto`` is resolved once (planner, launch's job file, trainer alike); Liger is refused clearly where it cannot run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import SpecError
from orchestrator.planning import fusedloss
from orchestrator.spec.job import load_job
from orchestrator.train.progress import read_events

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "jobs" / "tiny-cpu.yaml"
IGNORE = -100


# --- the loss alone -------------------------------------------------------------------------


def _batch(seed: int, batch=3, seq=23, hidden=16, vocab=50):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float32)
    weight = torch.randn(vocab, hidden, generator=gen, dtype=torch.float32) * 0.5
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :7] = IGNORE  # a prompt
    labels[1, -5:] = IGNORE  # padding
    labels[2, ::3] = IGNORE  # scattered
    return hidden_states, weight, labels


def _loss_and_grads(fn, hidden_states, weight, labels, **kw):
    h = hidden_states.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _hf(h, w, labels, num_items_in_batch=None):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(h @ w.t(), labels, w.shape[0], num_items_in_batch=num_items_in_batch)


@pytest.mark.parametrize("num_items", [None, 41, "tensor"])
@pytest.mark.parametrize("chunk", [1, 5, 64, None])
def test_chunked_loss_and_gradients_equal_hugging_faces(num_items, chunk):
    torch = pytest.importorskip("torch")
    from orchestrator.train.model.loss import chunked_causal_lm_loss

    hidden_states, weight, labels = _batch(0)
    if num_items == "tensor":
        num_items = torch.tensor(41)  # the Trainer passes a tensor (summed over ranks)
    want = _loss_and_grads(_hf, hidden_states, weight, labels, num_items_in_batch=num_items)
    got = _loss_and_grads(
        chunked_causal_lm_loss, hidden_states, weight, labels, num_items_in_batch=num_items, chunk=chunk
    )
    for expected, actual, what in zip(want, got, ("loss", "hidden grad", "lm_head grad"), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=what)
    # Ignored positions get no gradient at all (row 1's padded tail predicts nothing).
    assert torch.count_nonzero(got[1][1, -6:]) == 0


def test_chunked_loss_takes_shift_labels_and_all_ignored_is_nan_like_hf():
    torch = pytest.importorskip("torch")
    from orchestrator.train.model.loss import chunked_causal_lm_loss

    hidden_states, weight, labels = _batch(1)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    a = chunked_causal_lm_loss(hidden_states, weight, None, shift_labels=shifted, chunk=4)
    b = chunked_causal_lm_loss(hidden_states, weight, labels, chunk=7)
    torch.testing.assert_close(a, b)
    none_kept = torch.full_like(labels, IGNORE)
    assert torch.isnan(chunked_causal_lm_loss(hidden_states, weight, none_kept)).item()
    assert torch.isnan(_hf(hidden_states, weight, none_kept)).item()


# --- in a real model --------------------------------------------------------------------------

TINY_CONFIG = dict(
    model_type="qwen3",
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_forward_gives_the_models_own_loss_and_gradients(tied):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from orchestrator.train.model.loss import apply_fused_loss

    config = transformers.AutoConfig.for_model(**TINY_CONFIG, tie_word_embeddings=tied)
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fused = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fused.load_state_dict(plain.state_dict())
    apply_fused_loss(fused, "chunked")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (2, 40), generator=gen)
    labels = ids.clone()
    labels[:, :10] = IGNORE
    mask = torch.ones_like(ids)
    mask[1, -6:] = 0
    labels[1, -6:] = IGNORE
    results = []
    for model in (plain, fused):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(50))
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert got.logits is None  # the point: no logits were built
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # Without labels the model's own forward runs: logits come back (with labels, eval mode too is fused).
    fused.eval()
    with torch.no_grad():
        assert fused(input_ids=ids).logits.shape == (2, 40, 300)


# --- auto, resolved once ---------------------------------------------------------------------


def test_auto_resolves_to_liger_on_gpus_chunked_on_cpu_and_none_for_unknown_heads():
    assert fusedloss.resolve("auto", accelerator="gpu", model_type="qwen3") == "liger"
    assert fusedloss.resolve("auto", accelerator="cpu", model_type="qwen3") == "chunked"
    assert fusedloss.resolve("auto", accelerator="gpu", model_type="gemma2") == "none"  # soft-capped logits
    assert fusedloss.resolve("none", accelerator="gpu", model_type="qwen3") == "none"


@pytest.mark.parametrize(
    ("job", "sets", "capability", "expected"),
    [
        ("qwen3-8b.yaml", [], 9.0, "liger"),
        ("qwen3-8b.yaml", ["train.fused_loss=none"], 9.0, "none"),
        ("qwen3-8b.yaml", ["train.fused_loss=liger"], 9.0, "liger"),
        ("qwen3-8b.yaml", ["train.fused_loss=chunked"], 9.0, "chunked"),
        ("tiny-cpu.yaml", [], None, "chunked"),
    ],
)
def test_launch_writes_the_resolved_loss_into_the_job_file(job, sets, capability, expected):
    """What `dzctl launch` does after preflight: plan memory, then write each node's job.yaml."""
    from orchestrator.backends.jobfiles import job_files
    from orchestrator.backends.launcher import memory_choice
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.launchplan import make_plan
    from orchestrator.planning.resolve import resolve_job
    from orchestrator.spec.hostfile import Node

    loaded = load_job(ROOT / "jobs" / job, sets)
    inputs = read_inputs(loaded)
    nodes = [Node("node-a", (0, 1))]
    gpu = 143771 / 1024 if loaded.spec.accelerator == "gpu" else None
    memory, ds_config = memory_choice(inputs, nodes, gpu, 256.0, capability)
    assert memory.fused_loss == expected
    plan = make_plan(loaded.spec, nodes, "job-1")
    resolved = resolve_job(inputs, nodes, memory, ds_config, plan, None)
    files = {f.name: f for f in job_files(resolved, plan.nodes[0])}
    written = yaml.safe_load(files["job.yaml"].content)
    assert written["train"]["fused_loss"] == expected
    # The trainer reading that file keeps it as it is: nothing is left to resolve.
    assert fusedloss.resolve(expected, accelerator=loaded.spec.accelerator, model_type="qwen3") == expected


def test_liger_on_a_cpu_job_is_refused_when_the_spec_loads():
    with pytest.raises(SpecError) as info:
        load_job(TINY, ["train.fused_loss=liger"])
    assert info.value.exit_code == 2
    assert str(info.value).startswith("--set train.fused_loss=liger: ")
    assert "chunked" in info.value.fix


# --- the trainer --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _train(output: Path, *sets: str, nproc: int = 2) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    argv += ["-m", "orchestrator.train", str(TINY), "--output-dir", str(output), "--no-save"]
    for item in sets:
        argv += ["--set", item]
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900, check=False)


@pytest.mark.slow
def test_chunked_loss_trains_under_zero3_like_the_plain_loss(tmp_path):
    """2 gloo ranks, real ZeRO-3 (lm_head partitioned), fp32: the same losses step after step.

    Step 1's loss is the loss itself; steps 2 and 3 follow from the gradients of the
    steps before (Adam's updates), so equal losses there mean equal gradients too.
    """
    losses = {}
    for choice in ("none", "chunked"):
        run = _train(tmp_path / choice, f"train.fused_loss={choice}", "train.max_steps=3")
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        assert f"dzctl-train: loss {choice} (train.fused_loss: {choice})" in run.stdout
        steps = [e for e in read_events(tmp_path / choice / "progress.jsonl") if e["event"] == "step"]
        losses[choice] = [e["loss"] for e in steps]
    assert len(losses["none"]) == 3
    assert losses["chunked"] == pytest.approx(losses["none"], rel=1e-5)
    assert losses["none"][0] > losses["none"][-1]  # it trains


def test_trainer_told_liger_without_it_fails_before_loading_anything(tmp_path):
    """A GPU job file that says liger, run where Liger (or CUDA) is missing: exit 2, the fix, no traceback."""
    output = tmp_path / "out"
    argv = [sys.executable, "-m", "orchestrator.train", str(TINY), "--output-dir", str(output), "--no-save"]
    argv += ["--set", "accelerator=gpu", "--set", "train.fused_loss=liger"]
    # No GPU visible even where one is: then whether Liger is installed or not, it cannot run.
    env = dict(_env(), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert "error: --set train.fused_loss=liger: liger" in run.stderr
    assert "train.fused_loss: chunked" in run.stderr and "liger-kernel" in run.stderr
    (event,) = read_events(output / "progress.jsonl")
    assert event["event"] == "error" and "liger" in event["reason"]


@pytest.mark.slow
def test_gradient_check_script_passes_for_chunked_under_zero3(tmp_path):
    """benchmarks/liger_zero3_grads.py's CPU smoke run: gathered ZeRO-3 gradients of chunked equal the plain loss's.

    Tied embeddings, so the one weight is read by the embedding and by the loss.
    """
    import json

    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    argv += [str(ROOT / "benchmarks" / "liger_zero3_grads.py"), "--model", "tiny", "--modes", "chunked", "--tied"]
    argv += ["--out", str(tmp_path)]
    run = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "\nPASS\n" in run.stdout
    result = json.loads((tmp_path / "liger_zero3_grads.json").read_text())
    assert result["world_size"] == 2 and result["dtype"] == "fp32" and result["tied"] is True
    chunked = {r["param"]: r for r in result["rows"] if r["mode"] == "chunked"}
    assert set(chunked) == {"lm_head", "final norm", "embeddings"}
    for row in chunked.values():  # against the unfused loss (fp32 reference, same weights)
        assert row["rel_error"] < 1e-5 and row["cosine"] > 0.99999 and row["reference_grad_norm"] > 0


def test_a_preference_job_file_keeps_its_own_loss_key_while_the_plan_counts_trls_head(tmp_path):
    """The plan counts TRL's fused LM head ("trl"), which is no value of train.fused_loss: the job file
    the nodes read keeps the user's key, and loads. Failed before: the trainer refused its own job file
    (`train.fused_loss: Input should be 'auto', 'liger', 'chunked' or 'none' (got 'trl')`, one H200)."""
    from orchestrator.backends.jobfiles import job_files
    from orchestrator.backends.launcher import memory_choice
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.launchplan import make_plan
    from orchestrator.planning.memory.estimate import PREFERENCE_MOMENT_TERM
    from orchestrator.planning.resolve import resolve_job
    from orchestrator.spec.hostfile import Node

    loaded = load_job(ROOT / "jobs" / "qwen3-8b-dpo.yaml", [])
    inputs = read_inputs(loaded)
    nodes = [Node("node-a", (0, 1))]
    memory, ds_config = memory_choice(inputs, nodes, 143771 / 1024, 256.0, 9.0)
    assert memory.fused_loss == "trl"
    # TRL's tiles, not 2 x 2 rows of full logits (beside the gathered head and its gradient, 2.3 GiB)
    assert memory.estimate.gpu_terms[PREFERENCE_MOMENT_TERM] < 7 * 2**30
    plan = make_plan(loaded.spec, nodes, "job-1")
    resolved = resolve_job(inputs, nodes, memory, ds_config, plan, None)
    files = {f.name: f for f in job_files(resolved, plan.nodes[0])}
    written = tmp_path / "job.yaml"
    written.write_bytes(files["job.yaml"].content)
    assert load_job(written, []).spec.train.fused_loss == loaded.spec.train.fused_loss
