"""``train.method: lora`` end to end: real DeepSpeed ZeRO-3 on 2 CPU processes (gloo), PEFT adapters.

jobs/tiny-cpu.yaml as LoRA (merge on) trains 6 steps, saving every 3; a second run
with ``resume: auto`` continues to step 8. Then: the loss fell; the resume started at
the saved step; the adapter written by dzctl holds exactly the adapter weights of the
final ZeRO checkpoint (read back independently by DeepSpeed's zero_to_fp32) and loads
with ``PeftModel.from_pretrained``; the base stayed frozen; the merged weights equal
base + (alpha/r)·B·A; and base + adapter gives the merged model's outputs.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_train import train

from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow

LORA = ("train.method=lora", "train.lora.merge=true", "train.lora.r=4", "train.lora.alpha=8", "train.save_steps=3")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    output = tmp_path_factory.mktemp("lora") / "out"
    first = train(output, *LORA, "train.max_steps=6")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    first_events = read_events(output / "progress.jsonl")
    second = train(output, *LORA, "train.max_steps=8", "train.resume=auto")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    all_events = read_events(output / "progress.jsonl")
    return output, first_events, all_events[len(first_events) :], first.stdout + second.stdout


def _steps(events):
    return [e for e in events if e["event"] == "step"]


def test_lora_loss_falls_and_only_adapters_train(lora_runs):
    _, first, _, stdout = lora_runs
    losses = [e["loss"] for e in _steps(first)]
    assert len(losses) == 6
    assert sum(losses[:2]) / 2 - sum(losses[-2:]) / 2 > 0.2, losses
    # r=4 on 7 projections of 2 layers (hidden 64, q 64, kv 32, MLP 192):
    # per layer 4·((64+64) + 2·(64+32) + (64+64) + 2·(64+192) + (192+64)) = 4·(128+192+128+512+256)
    assert "LoRA: 9,728 of " in stdout, stdout[-2000:]


def test_lora_resume_continues_from_saved_step(lora_runs):
    _, _, second, _ = lora_runs
    steps = [e["step"] for e in _steps(second)]
    assert steps == [7, 8], steps


def _adapter(output):
    from safetensors.torch import load_file

    return load_file(str(output / "adapter" / "adapter_model.safetensors"))


def test_adapter_holds_the_trained_weights(lora_runs):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    output, _, _, _ = lora_runs
    saved = _adapter(output)
    trained = get_fp32_state_dict_from_zero_checkpoint(str(output / "checkpoint-8"))
    trained_lora = {k: v for k, v in trained.items() if "lora_" in k}
    assert len(saved) == len(trained_lora) == 2 * 7 * 2
    for name, value in trained_lora.items():
        # PEFT's file drops the adapter name: ...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight
        key = name.replace(".default", "")
        assert torch.equal(saved[key], value), name
    config = json.loads((output / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    # B starts at zero in PEFT: a trained B is not.
    assert all(saved[k].abs().sum() > 0 for k in saved if "lora_B" in k)


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_merged_weights_equal_base_plus_scaled_ba(lora_runs):
    output, _, _, _ = lora_runs
    base = dict(_load(output / "base").named_parameters())
    merged = dict(_load(output / "model").named_parameters())
    adapter = _adapter(output)
    assert set(base) == set(merged)
    scale = 8 / 4
    adapted = 0
    for name, weight in base.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        a, b = adapter.get(prefix + ".lora_A.weight"), adapter.get(prefix + ".lora_B.weight")
        if a is None:
            assert torch.equal(merged[name], weight), name
            continue
        adapted += 1
        assert torch.allclose(merged[name], weight + scale * (b @ a), atol=1e-6), name
        assert not torch.allclose(merged[name], weight), name
    assert adapted == 14


def test_adapter_loads_with_peft_and_gives_the_merged_outputs(lora_runs):
    from peft import PeftModel

    output, _, _, _ = lora_runs
    with_adapter = PeftModel.from_pretrained(_load(output / "base"), str(output / "adapter")).eval()
    merged = _load(output / "model")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged(input_ids=ids).logits
        got = with_adapter(input_ids=ids).logits
        plain = _load(output / "base")(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the adapter changes the outputs
