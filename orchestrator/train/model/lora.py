"""``train.method: lora``: low-rank adapters through PEFT on a ZeRO-3-partitioned model.

The base model is built as for full fine-tuning, inside ``zero.Init``: every rank
holds only its partition of the bf16 weights, and each ``nn.Linear`` keeps an empty
local tensor (its real shape is ``ds_shape``). PEFT's LoRA layers take their sizes
from ``in_features``/``out_features``, which ``nn.Linear`` sets from its arguments,
not from the (empty) weight, so the adapters come out right; ``check_adapter_shapes``
proves it before training. The adapters are created outside ``zero.Init``; the
DeepSpeed engine partitions them when it starts, and only they require gradients,
so only they get fp32 master copies and Adam states.

Saving gathers what it writes, one ZeRO-3 collective at a time, on every rank:

- ``adapter/`` (``save_adapter``): the adapter alone, in PEFT's format
  (``adapter_model.safetensors`` + ``adapter_config.json``), for
  ``PeftModel.from_pretrained``. Only the adapter parameters are gathered, never the
  base model: the Trainer's own ``save_model`` would gather all 72B weights onto
  rank 0's host RAM to keep 0.3 % of them.
- ``model/`` (``save_full``, ``train.lora.merge: true``): merged weights,
  W + (alpha / r)·B·A per adapted layer, gathered one module at a time, written as
  safetensors shards with the model's config, and checked non-empty like the
  full path's consolidated model.
- ``base/`` (``save_full`` without merging) for ``model.init: random`` only: the
  frozen random base exists nowhere else, and the adapter is useless without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ...errors import InputError
from ...spec.job import LoadedJob, LoraSpec
from .. import checkpoints
from . import checkpointing

ADAPTER = "adapter"
MERGED = "model"
BASE = "base"
ADAPTER_NAME = "default"  # PEFT's name for the one adapter
# Shards of the merged weights, as transformers writes them (max_shard_size 5GB).
SHARD_BYTES = 5 * 10**9


def lora_config(spec: LoraSpec):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model, loaded: LoadedJob):
    """The model with LoRA adapters on ``train.lora.target_modules``; the base frozen."""
    from peft import get_peft_model

    spec = loaded.spec.train.lora
    try:
        with checkpointing.peft_reads_the_old_name():
            peft_model = get_peft_model(model, lora_config(spec))
    except ValueError as exc:
        if "not found in the base model" not in str(exc):
            raise
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise InputError(
            f"{loaded.where('train.lora.target_modules')}: none of {list(spec.target_modules)} is a module "
            f"of this model",
            fix=f"name some of its linear layers: {', '.join(names)}",
        ) from None
    # The adapters take the base's dtype (bf16), as every parameter does under DeepSpeed's
    # bf16; its optimizer keeps their fp32 masters. (PEFT upcasts them to fp32 by default.)
    for _, layer in lora_layers(peft_model):
        dtype = layer.get_base_layer().weight.dtype
        layer.lora_A[ADAPTER_NAME].to(dtype)
        layer.lora_B[ADAPTER_NAME].to(dtype)
    check_adapter_shapes(peft_model, spec.r)
    return peft_model


def lora_layers(model) -> Iterator[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            yield name, module


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's real shape: ``ds_shape`` under ZeRO-3 (its local tensor is empty)."""
    shape = getattr(param, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(param.shape)


def check_adapter_shapes(model, r: int) -> None:
    """Each adapter must match its base weight's full shape: A is r × in, B is out × r."""
    found = 0
    for name, layer in lora_layers(model):
        out_features, in_features = full_shape(layer.get_base_layer().weight)
        a = full_shape(layer.lora_A[ADAPTER_NAME].weight)
        b = full_shape(layer.lora_B[ADAPTER_NAME].weight)
        if a != (r, in_features) or b != (out_features, r):
            raise RuntimeError(
                f"LoRA layer {name}: A {a} and B {b} do not fit the base weight ({out_features}, {in_features}) "
                f"at rank {r}: the adapter was sized from a partitioned placeholder"
            )
        found += 1
    if found == 0:
        raise RuntimeError("no LoRA layer was created")


def trainable_summary(model) -> tuple[int, int]:
    """(trainable, all) parameter counts, at full size."""
    trainable = total = 0
    for param in model.parameters():
        n = 1
        for d in full_shape(param):
            n *= d
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


@contextmanager
def gathered(params: list[torch.Tensor]):
    """The full tensors of ZeRO-3 partitioned parameters, on every rank (a collective)."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def save_adapter(model, directory: Path, base_name: str) -> None:
    """Write the adapter in PEFT format (gathered first). All ranks call it; rank 0 writes."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with gathered([p for _, p in named]):
        state = {n: p.detach().to("cpu", copy=True) for n, p in named} if _rank() == 0 else None
    if state is None:
        return
    empty = [n for n, t in state.items() if t.numel() == 0]
    if empty:
        raise RuntimeError(f"adapter tensors still partitioned after gathering: {empty[:3]}")
    model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_name
    # save_embedding_layers=False: no embedding is adapted, and "auto" would ask the Hub.
    model.save_pretrained(str(directory), state_dict=state, safe_serialization=True, save_embedding_layers=False)


def _base_name(name: str) -> str:
    """A name of the PEFT-wrapped model as the plain model calls it."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def expected_base_shapes(model) -> dict[str, list[int]]:
    """Full shapes of the base model's weights (adapters left out), by their plain names."""
    shapes = {}
    for name, param in model.named_parameters():
        if "lora_" not in name:
            shapes[_base_name(name)] = list(full_shape(param))
    return shapes


def _module_tensors(model, merge: bool) -> Iterator[dict[str, torch.Tensor] | None]:
    """Per module, its full weights by plain name (merged where adapted); rank 0 gets them, others None."""
    seen: set[int] = set()
    adapted = dict(lora_layers(model))
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue  # handled with its LoRA layer
        if name in adapted:
            inside.append(name)
            layer = adapted[name]
            base = layer.get_base_layer()
            a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
            own = [p for p in base.parameters(recurse=False) if id(p) not in seen]
            with gathered([*own, a, b]):
                out = None
                if _rank() == 0:
                    out = {}
                    for pname, p in base.named_parameters(recurse=False):
                        value = p.detach().float().cpu()
                        if pname == "weight" and merge:
                            # B·A in fp32, scaled by alpha/r (PEFT's scaling), then back to the weight's dtype.
                            delta = b.detach().float().cpu() @ a.detach().float().cpu()
                            value = value + layer.scaling[ADAPTER_NAME] * delta
                        out[_base_name(f"{name}.{pname}")] = value.to(p.dtype)
            seen.update(id(p) for p in own)
            yield out
            continue
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        names = {id(p): pname for pname, p in module.named_parameters(recurse=False)}
        with gathered(own):
            out = None
            if _rank() == 0:
                out = {_base_name(f"{name}.{names[id(p)]}"): p.detach().to("cpu", copy=True) for p in own}
        seen.update(id(p) for p in own)
        yield out


def save_full(model, directory: Path, *, merge: bool) -> None:
    """Write the base model's full weights (merged with the adapter when ``merge``), as HF safetensors shards.

    One module is gathered at a time, so a GPU never holds more than one whole
    weight beyond its partition; rank 0 collects them on the host. All ranks call it.
    """
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for tensors in _module_tensors(model, merge):
        if tensors is None:
            continue
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][key] = tensor.contiguous()
            size += nbytes
    if _rank() != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        index_file = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2), encoding="utf-8")
    model.get_base_model().config.save_pretrained(str(directory))


def base_name(loaded: LoadedJob, output_dir: Path) -> str:
    """What the adapter is for: the pretrained model's name, or the saved random base."""
    if loaded.spec.model.init == "random":
        return str(output_dir / BASE)
    return loaded.spec.model.name_or_path


def save_outputs(trainer, loaded: LoadedJob, output_dir: Path, rank: int) -> Path:
    """``adapter/`` always; ``base/`` for a random base; ``model/`` merged when asked. All ranks call it."""
    model = trainer.model
    adapter_dir = output_dir / ADAPTER
    trainer.save_model(str(adapter_dir))  # DzTrainer.save_model: the adapter alone, gathered
    if rank == 0:
        trainer.processing_class.save_pretrained(str(adapter_dir))
    full: list[tuple[Path, bool]] = []  # (folder, merged)
    if loaded.spec.model.init == "random":
        full.append((output_dir / BASE, False))
    if loaded.spec.train.lora.merge:
        full.append((output_dir / MERGED, True))
    for directory, merge in full:
        save_full(model, directory, merge=merge)
        if rank == 0:
            trainer.processing_class.save_pretrained(str(directory))
            checkpoints.check_consolidated(directory, expected_base_shapes(model))
    return adapter_dir
