"""``zero.fetch_unit``: what ZeRO-3 gathers, hooks and releases as one unit (pure; the trainer applies it).

``module`` is DeepSpeed's own way: a forward and a backward hook pair on every sub-module, each
gathering its own weights. ``layer`` marks each decoder layer a ZeRO-3 leaf module
(``train/model/fetchunit.py``): one gather and one hook pair per layer. ``auto`` takes ``layer`` for
LoRA whose weights stay on the GPUs and ``module`` otherwise, as measured on one H200 through ``dzctl
launch`` (``benchmarks/results/fetchunit-h200x1-20261204/`` and ``fetchunit2-h200x1-20261204/``):

* LoRA wraps each of a layer's seven projections in about ten more modules (85 per layer), and at small
  micro-batches their hooks' host time left the GPU idle. By layer, micro 4 without checkpointing ran at
  13,682 tokens/s against 7,566-10,256 by module, and the auto plan at accumulation 1 (micro 6, 6 of 36
  checkpointed) at 12,753-12,830 against 11,924-12,301 in the same call.
* Full fine-tuning has 15 modules per layer and its steps were GPU-bound by module already; by layer it ran
  at 53.5 % / 57.1 % MFU against 53.9-55.6 % / 59.7-60.5 % in other calls, so it is not shown to help
  there and DeepSpeed's default stays.
* With the weights offloaded (``offload: all`` or ``nvme``) nothing was measured by layer, and a layer
  fetched whole from host RAM or NVMe needs swap buffers for all its weights at once, not one module's:
  DeepSpeed's default stays there too.
"""

from __future__ import annotations

from typing import Literal

FetchUnit = Literal["layer", "module"]


def resolve_fetch_unit(setting: str, method: str, offload_param: bool = False) -> FetchUnit:
    """The fetch unit a job runs with: ``zero.fetch_unit`` as written, or ``auto``'s for this method and offload."""
    if setting == "auto":
        return "layer" if method == "lora" and not offload_param else "module"
    if setting not in ("layer", "module"):
        raise ValueError(f"zero.fetch_unit must be auto, layer or module, not {setting!r}")
    return setting  # type: ignore[return-value]
