"""What one decoder layer keeps for the backward on a preference stage's path, measured on a GPU (issue 44).

dzctl's DPO and KTO runs go through TRL's trainers: HF's own modules (no Liger kernels), SDPA on padded
pairs with an attention mask, and TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``: log-probs
in tiles, the logits never whole). This builds that path at the Qwen3-8B layer shape for 1 and 3 layers,
runs the policy's forward on a micro-batch of pairs, the reference's (adapters off, or the same weights,
under ``no_grad``) and the backward, and reads ``torch.cuda.memory_allocated`` after the forward and the
peak. The difference between the layer counts is one layer's saved activations per token, which it prints
beside the planner's ``layer_activation_bytes_per_token`` (+ LoRA's term); what does not grow with the
layers (the head, the loss) is the intercept.

    python3 benchmarks/preference_activation_probe.py --out DIR [--pairs 2] [--seq 2048]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from zero3_h200 import MODELS  # noqa: E402

from orchestrator.planning.memory.estimate import LoraShape, layer_activation_bytes_per_token  # noqa: E402
from orchestrator.planning.shape import shape_from_config  # noqa: E402

GIB = 2**30
DEVICE = "cuda"  # a CPU smoke run of the path sets "cpu" (and reads no memory figures)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(layers: int, lora: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = Qwen3Config(**{**MODELS["qwen3-8b"], "num_hidden_layers": layers}, attn_implementation="sdpa")
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    add_fused_lm_head(model)  # as TRL's DPOTrainer does, before PEFT wraps the model
    if lora:
        from peft import LoraConfig, get_peft_model

        config_lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS))
        # bf16 adapters, as under DeepSpeed's bf16 (PEFT would keep them in fp32 and cast every input)
        model = get_peft_model(model, config_lora, autocast_adapter_dtype=False)
    model.train()
    return model, config


def measure(layers: int, lora: bool, pairs: int, seq: int, padded: bool) -> dict:
    gc.collect()  # TRL's patched forward holds the model in a cycle: the last one's memory goes only now
    torch.cuda.empty_cache()
    model, config = build(layers, lora)
    rows = 2 * pairs  # chosen and rejected of each pair, one batch (TRL's concatenated forward)
    ids = torch.randint(0, config.vocab_size, (rows, seq), device=DEVICE)
    labels = ids.clone()
    labels[:, : seq // 4] = -100  # the prompt is not scored
    mask = torch.ones_like(ids)
    if padded:  # TRL pads each batch's pairs: the shorter answers end in padding, which the mask hides
        mask[1::2, -seq // 8 :] = 0
        labels[1::2, -seq // 8 :] = -100
    # A mask of ones is dropped by transformers (causal SDPA, K and V per KV head); a padded one is
    # passed to SDPA with K and V repeated for every query head.
    kwargs = {"input_ids": ids, "labels": labels, "fused_lm_head": True, "attention_mask": mask}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = model(**kwargs)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    with torch.no_grad():  # the reference's log-probs: adapters off, or (full FT) the same weights standing in
        if lora:
            with model.disable_adapter():
                model(**kwargs)
        else:
            model(**kwargs)
    out.loss.backward()
    torch.cuda.synchronize()
    result = {
        "layers": layers, "lora": lora, "adapter_dtype": "bf16" if lora else None, "padded": padded,
        "pairs": pairs, "seq": seq, "tokens": rows * seq,
        "kept_after_forward_gib": (after_forward - base) / GIB,
        "peak_over_weights_gib": (torch.cuda.max_memory_allocated() - base) / GIB,
    }  # fmt: skip
    del out, model
    return result


def planned_bytes_per_token(lora: bool) -> int:
    shape = shape_from_config(MODELS["qwen3-8b"], name="qwen3-8b", source="benchmarks/zero3_h200.py")
    per_token = layer_activation_bytes_per_token(shape, 2, "hf")
    if lora:
        per_token += LoraShape(16, TARGETS, 0.0).activation_bytes_per_token(shape, 2)
    return per_token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for lora, padded in ((True, True), (False, True), (True, False), (False, False)):
        points = [measure(n, lora, args.pairs, args.seq, padded) for n in (1, 3)]
        tokens = points[0]["tokens"]
        slope = (points[1]["kept_after_forward_gib"] - points[0]["kept_after_forward_gib"]) / 2 * GIB / tokens
        intercept = points[0]["kept_after_forward_gib"] - slope * tokens / GIB
        row = {
            "lora": lora, "padded": padded, "points": points, "layer_bytes_per_token": round(slope),
            "planned_layer_bytes_per_token": planned_bytes_per_token(lora), "not_per_layer_gib": round(intercept, 3),
        }  # fmt: skip
        rows.append(row)
        print(
            f"{'LoRA r16' if lora else 'full FT '}, {'padded' if padded else 'no padding'}: "
            f"one layer keeps {slope:,.0f} B a token "
            f"(planned {row['planned_layer_bytes_per_token']:,}); not per layer {intercept:.2f} GiB; "
            + "; ".join(f"{p['layers']} layers: kept {p['kept_after_forward_gib']:.2f}, "
                        f"peak {p['peak_over_weights_gib']:.2f} GiB" for p in points),
            flush=True,
        )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(), "at": time.time(), "rows": rows}
    (out / "preference-activations.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
