"""``python -m orchestrator.train.export REQUEST.json``: a gathered ZeRO-3 checkpoint → Hugging Face weights.

``dzctl export`` runs this on the controller as its own process (the controller's own
process never imports torch). The request names the checkpoint folder (``latest``
and ``global_step<N>/`` with every rank's shards), the output folder, the method and
dtype the job trained with, and ``adapter`` for the PEFT adapter alone.

The consolidation is DeepSpeed's own (``deepspeed.utils.zero_to_fp32``, lazy mode:
its optimizer files are memory-mapped and each parameter is stitched together from
the ranks' partitions only when asked for). Then:

- full fine-tuning: the fp32 weights cast to the dtype the model trained in, written
  shard by shard (at most ``SHARD_BYTES`` each, HF's names and index), so the
  controller holds one shard and one fp32 tensor at a time, never the whole model;
- LoRA, merged: the base and adapter weights put into the PEFT model built on the
  meta device (no second copy), ``merge_and_unload``, then written the same way;
- LoRA, ``adapter``: PEFT's own ``save_pretrained`` of the adapter.

The config (with the dtype), the tokenizer and its chat template come from the
checkpoint's folder. Then the check: the written folder is loaded with
``from_pretrained`` on the CPU (``PeftModel.from_pretrained`` for an adapter) and
every tensor compared with what the shards consolidate to, in the same dtype: they
must be equal bit for bit.

Progress goes to stdout as JSON lines (``{"event": "write", "done": B, "total": B}``);
the last line is the result, or ``{"error", "fix", "exit_code"}``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..errors import DzError, InputError, RuntimeFailure

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
ADAPTER_NAME = "default"
# The checkpoint's small files the export carries over: config, generation config, tokenizer, chat template.
CARRIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


class ExportCheckFailed(RuntimeFailure):
    """The written weights do not load, or differ from the consolidated shards."""


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def consolidated(checkpoint: Path, tag: str) -> dict:
    """DeepSpeed's ZeRO-3 → fp32 state dict, lazy: GatheredTensor per trained parameter (``.contiguous()``)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag, lazy_mode=True)


def unique_names(state: dict) -> list[str]:
    """Names in order, a tied tensor (one object under two names, e.g. tied embeddings) once: HF re-ties it."""
    seen: set[int] = set()
    names = []
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


def write_shards(state: dict, names: list[str], out: Path, dtype, total: int) -> list[str]:
    """``names`` of ``state`` cast to ``dtype``, as HF safetensors shards; one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    def nbytes(name: str) -> int:
        return state[name].shape.numel() * torch.empty((), dtype=_target(state[name], dtype)).element_size()

    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if groups[-1] and size + nbytes(name) > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes(name)
    files = []
    weight_map = {}
    done = 0
    for index, group in enumerate(groups, start=1):
        file = "model.safetensors" if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in group:
            tensor = state[name].contiguous()  # GatheredTensor: stitched from the ranks' partitions here
            shard[name] = tensor.to(_target(tensor, dtype)).contiguous()
        save_file(shard, str(out / file), metadata={"format": "pt"})
        done += sum(t.numel() * t.element_size() for t in shard.values())
        emit("write", done=done, total=total, file=file)
        weight_map.update(dict.fromkeys(group, file))
        files.append(file)
        del shard
    if len(groups) > 1:
        index_file = {"metadata": {"total_size": done}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2), encoding="utf-8")
    return files


def _target(tensor, dtype):
    return dtype if tensor.dtype.is_floating_point else tensor.dtype


def carry_files(checkpoint: Path, out: Path, dtype_name: str, *, config: bool = True) -> list[str]:
    """The checkpoint's config (dtype set to what it trained in), tokenizer and chat template."""
    carried = []
    for name in CARRIED:
        source = checkpoint / name
        if not source.is_file() or (name == "config.json" and not config):
            continue
        if name == "config.json":
            data = json.loads(source.read_text(encoding="utf-8"))
            data["dtype"] = dtype_name  # transformers 5's key (torch_dtype before it)
            data.pop("torch_dtype", None)
            (out / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(source, out / name)
        carried.append(name)
    return carried


def export_full(request: dict, checkpoint: Path, out: Path) -> dict:
    import torch

    dtype = _dtype(request["dtype"])
    state = consolidated(checkpoint, request["tag"])
    names = unique_names(state)
    total = sum(state[n].shape.numel() * torch.empty((), dtype=_target(state[n], dtype)).element_size() for n in names)
    files = write_shards(state, names, out, dtype, total)
    carried = carry_files(checkpoint, out, request["dtype"])
    compared = check_model(out, lambda name: _value(state[name], dtype), names, dtype)
    return {"files": files, "carried": carried, "tensors": compared, "bytes_written": total}


def _value(tensor, dtype):
    value = tensor.contiguous()
    return value.to(_target(value, dtype))


def check_model(out: Path, expected, names: list[str], dtype) -> int:
    """Load ``out`` with ``from_pretrained`` on the CPU; every tensor must equal ``expected(name)`` exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    emit("check", what="from_pretrained")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype, device_map="cpu")
    except Exception as exc:
        raise ExportCheckFailed(
            f"the written model does not load with from_pretrained: {type(exc).__name__}: {exc}"
        ) from exc
    loaded = model.state_dict()
    missing = [n for n in names if n not in loaded]
    if missing:
        raise ExportCheckFailed(f"{len(missing)} consolidated tensors are not in the loaded model: {missing[:3]}")
    for name in names:
        want = expected(name)
        got = loaded[name]
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            raise ExportCheckFailed(
                f"{name}: the loaded model's tensor ({got.dtype}, {list(got.shape)}) differs from the consolidated "
                f"shards' ({want.dtype}, {list(want.shape)})"
            )
    return len(names)


def peft_model(checkpoint: Path, state: dict, dtype, base: str):
    """The job's PEFT model: the base (``from_pretrained``, on the CPU) with the checkpoint's adapter in it.

    The HF Trainer saves a PEFT model's ZeRO-3 checkpoint without its frozen base
    (``exclude_frozen_parameters``), so the shards hold the adapter alone: the base comes
    from ``base``, the folder or name the adapter was trained on.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, device_map="cpu")
    except Exception as exc:
        raise InputError(
            f"the base model {base} that the adapter was trained on does not load here: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}",
            fix=f"make {base} readable on this machine (a folder at that path, or `hf download {base}` into "
            "this machine's Hugging Face cache), then export again",
        ) from exc
    lora = LoraConfig.from_pretrained(str(checkpoint))
    model = get_peft_model(model, lora)
    tensors = {name: _value(t, dtype) for name, t in state.items()}
    result = model.load_state_dict(tensors, strict=False)
    adapters = [n for n, _ in model.named_parameters() if "lora_" in n]
    unset = [n for n in adapters if n in result.missing_keys]
    if result.unexpected_keys or unset or not adapters:
        raise ExportCheckFailed(
            f"the shards do not fit the adapter: {len(result.unexpected_keys)} tensors unknown to it "
            f"(e.g. {result.unexpected_keys[:2]}), {len(unset)} adapter tensors without a value (e.g. {unset[:2]})"
        )
    return model, tensors


def export_lora(request: dict, checkpoint: Path, out: Path) -> dict:

    dtype = _dtype(request["dtype"])
    state = consolidated(checkpoint, request["tag"])
    model, tensors = peft_model(checkpoint, state, dtype, request["base"])
    if request["adapter"]:
        return export_adapter(model, tensors, checkpoint, out, request)
    # Before merging: the base weights of the adapted layers, and each adapter's scale.
    scaling = {name: layer.scaling[ADAPTER_NAME] for name, layer in _lora_layers(model)}
    model_before = {name: layer.get_base_layer().weight.detach().clone() for name, layer in _lora_layers(model)}
    merged = model.merge_and_unload()
    merged_state = merged.state_dict()
    names = unique_names(merged_state)
    total = sum(merged_state[n].numel() * merged_state[n].element_size() for n in names)
    files = write_shards(merged_state, names, out, dtype, total)
    merged.config.save_pretrained(str(out))  # the base's own config, with the dtype it was loaded in
    carried = ["config.json", *carry_files(checkpoint, out, request["dtype"], config=False)]
    compared = check_model(out, lambda name: merged_state[name], names, dtype)
    # The merge itself, checked by hand: W + (alpha / r)·B·A for every adapted weight (PEFT's scaling).
    check_merge(model_before, tensors, merged_state, scaling)
    return {"files": files, "carried": carried, "tensors": compared, "bytes_written": total, "merged": True}


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER_NAME in m.lora_A]


def check_merge(base: dict, tensors: dict, merged: dict, scaling: dict) -> None:
    """Every merged weight equals W + scale·B·A from the shards' adapter, computed here in fp32."""
    import torch

    for name, weight in base.items():
        a = tensors[f"{name}.lora_A.{ADAPTER_NAME}.weight"].float()
        b = tensors[f"{name}.lora_B.{ADAPTER_NAME}.weight"].float()
        want = (weight.float() + scaling[name] * (b @ a)).to(weight.dtype)
        got = merged[name.removeprefix("base_model.model.") + ".weight"]
        if not torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-6):
            raise ExportCheckFailed(f"{name}: the merged weight is not W + scale·B·A of the shards' adapter")


def export_adapter(model, tensors: dict, checkpoint: Path, out: Path, request: dict) -> dict:
    import torch
    from peft import PeftModel, get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model)
    model.peft_config[ADAPTER_NAME].base_model_name_or_path = _base_name(checkpoint)
    model.save_pretrained(str(out), state_dict=adapter, safe_serialization=True, save_embedding_layers=False)
    carried = carry_files(checkpoint, out, request["dtype"], config=False)
    total = sum(t.numel() * t.element_size() for t in adapter.values())
    emit("write", done=total, total=total, file="adapter_model.safetensors")
    # The check: PEFT loads it onto the base (the shards' own), and its adapter equals the shards'.
    emit("check", what="PeftModel.from_pretrained")
    base = model.unload()  # the same base tensors, adapters removed
    try:
        loaded = PeftModel.from_pretrained(base, str(out))
    except Exception as exc:
        raise ExportCheckFailed(f"the written adapter does not load with PeftModel.from_pretrained: {exc}") from exc
    got = get_peft_model_state_dict(loaded)
    if set(got) != set(adapter):
        raise ExportCheckFailed(f"the loaded adapter's tensors differ in name: {sorted(set(got) ^ set(adapter))[:3]}")
    for name, want in adapter.items():
        if not torch.equal(got[name].to(want.dtype), want):
            raise ExportCheckFailed(f"{name}: the loaded adapter differs from the consolidated shards")
    return {
        "files": ["adapter_model.safetensors", "adapter_config.json"],
        "carried": carried,
        "tensors": len(adapter),
        "bytes_written": total,
        "merged": False,
    }


def _base_name(checkpoint: Path) -> str | None:
    try:
        return json.loads((checkpoint / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, ValueError, KeyError):
        return None


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    checkpoint, out = Path(request["checkpoint_dir"]), Path(request["out"])
    try:
        out.mkdir(parents=True, exist_ok=True)
        if request["method"] == "lora":
            result = export_lora(request, checkpoint, out)
        else:
            result = export_full(request, checkpoint, out)
    except DzError as exc:
        print(json.dumps({"error": exc.message, "fix": exc.fix, "exit_code": exc.exit_code}), flush=True)
        return exc.exit_code
    except MemoryError:
        message = "the controller ran out of memory consolidating the checkpoint"
        fix = "run dzctl export on a machine with more free RAM (see README: export, scale)"
        print(json.dumps({"error": message, "fix": fix, "exit_code": 1}), flush=True)
        return 1
    print(json.dumps({"event": "result", **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
