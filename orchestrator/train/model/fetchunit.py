"""``zero.fetch_unit: layer``: ZeRO-3 gathers, hooks and releases each decoder layer as one unit.

DeepSpeed installs a forward and a backward hook pair on every sub-module and gathers each one's
weights on its own. A Qwen3 layer is 15 modules, and 85 once PEFT has wrapped its seven
projections (each gains 10: ``base_layer``, ``lora_A``/``lora_B``, the dropout and their
containers). On one H200 a LoRA step of the 8B shape at micro 4 without checkpointing left the GPU
idle 46 % of the time while the host ran those hooks, and 13 % by layer
(benchmarks/results/fetchunit2-h200x1-20261204). Marked as ZeRO-3 leaf modules
(``deepspeed.utils.set_z3_leaf_modules``), the layers are fetched whole in their pre-forward hook
and released after, and their children get no hooks at all.

The weights gathered at once are then a whole layer's. That is smaller than the embedding the
memory planner already counts as gathered whole (Qwen3-8B: 0.19 B against 0.62 B elements; 72B:
0.88 B against 1.25 B), so the plan's working set is unchanged.
"""

from __future__ import annotations

from .checkpointing import decoder_layers


def fetch_by_layer(model) -> int:
    """Mark every decoder layer of ``model`` a ZeRO-3 leaf module; return how many were marked.

    Call before ``deepspeed.initialize`` (the Trainer's), which installs the hooks. A model
    without transformers' decoder layers is left as it is (0).
    """
    from deepspeed.utils import set_z3_leaf_modules

    layers = decoder_layers(model)
    if not layers:
        return 0
    if any(not p.requires_grad for p in model.get_input_embeddings().parameters()):
        # A frozen embedding (LoRA) gives the first layer inputs that need no gradient. Its
        # backward hook then fires on the outputs instead (torch's full-backward-hook rule) and
        # ZeRO-3 releases the layer's weights while its backward still reads them ("size of tensor
        # a (0) must match"). With checkpointing on, transformers has turned this on already.
        model.enable_input_require_grads()
    return len(set_z3_leaf_modules(model, sorted({type(layer) for layer in layers}, key=lambda t: t.__name__)))
