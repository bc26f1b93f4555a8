"""Activation checkpointing: asked for in the names the installed transformers expects, and really on.

- the HF Trainer given ``checkpointing.trainer_arguments`` (no DeepSpeed: this is about transformers)
  warns about no deprecated name, and its model keeps one hidden state per checkpointed layer;
- a real run of the tiny job (2 ranks, ZeRO-3 on CPU) with ``train.gradient_checkpointing`` true and
  false prints no FutureWarning about checkpointing, and its ranks report the layers really checkpointed.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from orchestrator.train.model import checkpointing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=192, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)  # fmt: skip
BATCH, SEQ = 2, 32
CHECKPOINT_WARNING = re.compile(r"(gradient|activation)_checkpointing\w*` is deprecated")


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, TINY["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _trained_model(tmp_path: Path, layers: int, enabled: bool, caught: list):
    """A tiny model after one real Trainer step with dzctl's checkpointing arguments."""
    config = transformers.AutoConfig.for_model(**dict(TINY, num_hidden_layers=layers))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"out-{layers}-{enabled}"), max_steps=1, per_device_train_batch_size=BATCH,
            use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
            **checkpointing.trainer_arguments(enabled, transformers.TrainingArguments),
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows())
        trainer.train()
    caught.extend(str(w.message) for w in seen)
    return trainer.model


def _saved_bytes(model) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward in one training forward."""
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return sum(seen.values())


def test_the_trainer_checkpoints_each_layer_when_asked_and_warns_about_no_old_name(tmp_path):
    caught: list[str] = []
    on = {n: _trained_model(tmp_path, n, True, caught) for n in (2, 3)}
    off = {n: _trained_model(tmp_path, n, False, caught) for n in (2, 3)}
    assert not [w for w in caught if CHECKPOINT_WARNING.search(w)], caught
    tokens = BATCH * SEQ
    # Checkpointed, a layer keeps only its bf16 input; without, every activation inside it.
    assert _saved_bytes(on[3]) - _saved_bytes(on[2]) == 2 * TINY["hidden_size"] * tokens
    assert _saved_bytes(off[3]) - _saved_bytes(off[2]) > 4 * 2 * TINY["hidden_size"] * tokens
    assert checkpointing.layers_checkpointed(on[3]) == (3, 3)
    assert checkpointing.layers_checkpointed(off[3]) == (0, 3)


def test_a_transformers_without_the_new_name_gets_the_old_one():
    class Before:  # TrainingArguments before the rename (the GPU machine's 5.17) has only the old field
        gradient_checkpointing = False

    assert checkpointing.trainer_arguments(True, Before) == {
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
    }
    assert checkpointing.trainer_arguments(False, transformers.TrainingArguments) == {
        checkpointing.field_name(transformers.TrainingArguments): False,
        f"{checkpointing.field_name(transformers.TrainingArguments)}_kwargs": None,
    }


def test_wrapping_with_lora_warns_about_no_old_name():
    from orchestrator.spec.job import load_job
    from orchestrator.train.model import lora

    job = load_job(ROOT / "jobs" / "tiny-cpu.yaml", ["train.method=lora"])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**job.spec.model.config))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lora.wrap(model, job)  # PEFT reads is_gradient_checkpointing inside get_peft_model
    assert not [str(w.message) for w in seen if CHECKPOINT_WARNING.search(str(w.message))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_fp32(layers: int):
    config = transformers.AutoConfig.for_model(**dict(TINY, num_hidden_layers=layers))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    return model


def test_checkpointing_the_first_n_layers_keeps_the_loss_and_gradients_and_saves_less():
    """Issue 29: N of L layers recompute; same loss and gradients as none (fp32), and N fewer full layers kept."""
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    results = {}
    for count in (0, 1, 2, 3):
        model = _tiny_fp32(3)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing.CHECKPOINT_KWARGS)
        checkpointing.checkpoint_first(model, count)
        assert checkpointing.layers_checkpointed(model) == (count, 3)
        assert [layer.gradient_checkpointing for layer in checkpointing.decoder_layers(model)] == [
            i < count for i in range(3)
        ]
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t, seen=seen, params=params):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[count] = (loss.item(), grads, sum(seen.values()))
    loss0, grads0, saved0 = results[0]
    for count in (1, 2, 3):
        loss, grads, saved = results[count]
        assert loss == pytest.approx(loss0, rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, grads0[name], rtol=1e-5, atol=1e-6)
        assert saved < results[count - 1][2]  # each layer more checkpointed keeps less
    # Each layer checkpointed instead of run in full saves about the same (a third of all three's saving):
    # what the planner's estimate removes per layer.
    per_layer = (saved0 - results[3][2]) / 3
    assert saved0 - results[1][2] == pytest.approx(per_layer, rel=0.02)
    with pytest.raises(ValueError, match="4 layers to checkpoint, the model has 3"):
        checkpointing.checkpoint_first(_tiny_fp32(3), 4)


@pytest.mark.slow
# 1: the first of the 2 layers only (the Trainer enables checkpointing, then the other layer drops it).
@pytest.mark.parametrize("enabled", [False, True, 1])
def test_a_real_run_says_nothing_about_deprecated_checkpointing(tmp_path, enabled):
    name = f"ckpt-{uuid.uuid4().hex[:6]}"
    sets = [
        f"name={name}", f"launch.remote_dir={tmp_path / 'remote'}", f"launch.master_port={_free_port()}",
        f"launch.python={sys.executable}", "train.max_steps=2", "train.save=false",
        f"train.gradient_checkpointing={str(enabled).lower()}",  # 1: the first of the 2 layers only
    ]  # fmt: skip
    # --skip-collective: the warnings looked for are the trainer's; the check runs no model (about 6 s a launch).
    argv = [sys.executable, "-m", "orchestrator", "launch", "jobs/tiny-cpu.yaml", "--hosts", "hostfiles/localhost.txt",
            "--runtime", "process", "--follow", "--raw", "--skip-collective",
            *(x for s in sets for x in ("--set", s))]  # fmt: skip
    env = {**os.environ, "DZCTL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert not [line for line in output.splitlines() if CHECKPOINT_WARNING.search(line)], output[-3000:]
    assert "FutureWarning" not in output, output[-3000:]
    # Rank 0 reads the flag the layers' forward consults, once the Trainer has set it up.
    expected = "0 of 2" if enabled is False else "2 of 2" if enabled is True else f"{enabled} of 2"
    assert f"activation checkpointing in {expected} decoder layers" in output, output[-3000:]
