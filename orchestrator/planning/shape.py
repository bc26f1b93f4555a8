"""A model's shape (sizes that decide memory) from config.json, ``model.config`` or a built-in catalogue.

The memory planner needs the architecture, never the weights: vocabulary, hidden
size, layers, heads, KV heads, head size, MLP size and whether the input and
output embeddings are one tensor. They come from, in order:

1. ``model.config`` of a random-init job (the whole architecture);
2. ``config.json`` in a local directory named by ``model.name_or_path``;
3. the catalogue below, by model name (the last path component also matches, so
   ``/data/hf/Qwen3-8B`` on the nodes finds ``Qwen3-8B``).

For a pretrained model, ``model.config`` holds overrides of 2 or 3 (as the trainer
applies them). Plain JSON, no transformers: the controller never imports it.

Dense decoder-only families are supported (Llama, Mistral, Qwen, Qwen2/2.5, Qwen3);
mixture-of-experts configs are refused, since their memory differs per expert.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SpecError
from ..spec.job import LoadedJob

# The published config.json values of common models (huggingface.co/<name>/blob/main/config.json),
# only the keys that decide memory. Read and checked for this catalogue, 2026-11:
# - Qwen3 0.6B and 1.7B: litgpt's config table cites the Qwen config.json files; 4B, 8B, 14B, 32B:
#   the config.json texts as published (copied verbatim in citsjtu2020/LLM-Prof sglang/Model_Config.md).
# - Qwen2.5 7B, 14B, 32B: same source; 72B: the published config.json (hidden 8192, 29568, 80 layers).
# - Qwen-72B (the original Qwen, model_type "qwen", custom code): its config.json says
#   intermediate_size 49152 and kv_channels 128; its MLP uses intermediate_size // 2 per matrix
#   (modeling_qwen.py: ff_dim_in = config.intermediate_size // 2), and c_attn has a bias.
# - Llama 3 8B / 70B (Meta-Llama-3-*, same shapes as Llama 3.1/3.3): vocab 128256, GQA with 8 KV heads.
_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8}
_QWEN25 = {"model_type": "qwen2", "vocab_size": 152064, "tie_word_embeddings": False}
_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "num_key_value_heads": 8, "tie_word_embeddings": False}

CATALOGUE: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": {
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-1.7B": {
        **_QWEN3,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-4B": {
        **_QWEN3,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-14B": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-32B": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-7B": {
        **_QWEN25,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    "Qwen/Qwen2.5-14B": {
        **_QWEN25,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
    },
    "Qwen/Qwen2.5-32B": {
        **_QWEN25,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
    },
    "Qwen/Qwen2.5-72B": {
        **_QWEN25,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "Qwen/Qwen-72B": {
        # The original Qwen's own keys, kept as published so the "qwen" reader below is exercised.
        "model_type": "qwen",
        "vocab_size": 152064,
        "hidden_size": 8192,
        "intermediate_size": 49152,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "kv_channels": 128,
    },
    "meta-llama/Meta-Llama-3-8B": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "meta-llama/Meta-Llama-3-70B": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
}

# Other published names with the same shapes (instruct/base variants, Llama 3.1/3.3 re-releases).
_ALIASES = {
    "llama-3.1-8b": "meta-llama/Meta-Llama-3-8B",
    "meta-llama-3.1-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3.1-70b": "meta-llama/Meta-Llama-3-70B",
    "meta-llama-3.1-70b": "meta-llama/Meta-Llama-3-70B",
    "llama-3.3-70b": "meta-llama/Meta-Llama-3-70B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
}
_VARIANT_SUFFIXES = ("-instruct", "-base", "-chat", "-hf")

# Families whose layers are the Llama pattern (RMSNorm, GQA attention, SwiGLU MLP).
_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder-only transformer that decide its training memory."""

    name: str
    source: str  # where the numbers came from, shown by `dzctl plan`
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per MLP matrix (SwiGLU: gate, up, down)
    tied_embeddings: bool
    qk_norm: bool = False  # Qwen3 normalises q and k per head (RMSNorm over head_dim)
    qkv_bias: bool = False  # Qwen2/2.5 and Qwen-1 have biases on q, k, v

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        """The input embedding (vocab × hidden)."""
        return self.vocab_size * self.hidden_size

    @property
    def params_per_layer(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attention = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * h * i
        norms = 2 * h
        return attention + mlp + norms

    def weight_numels(self) -> list[int]:
        """Element counts of every parameter tensor, in model order (embedding, layers, norm, head)."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        layer = [h, h * q, h * kv, h * kv, q * h, h, h * i, h * i, i * h]  # norms, q/k/v/o, norm, MLP
        if self.qkv_bias:
            layer += [q, kv, kv]
        if self.qk_norm:
            layer += [self.head_dim, self.head_dim]
        head = [] if self.tied_embeddings else [self.embedding_params]
        return [self.embedding_params, *layer * self.num_layers, h, *head]

    @property
    def small_params_per_layer(self) -> int:
        """Norm weights and biases: below ZeRO-3's persistence threshold, kept whole on every GPU."""
        small = 2 * self.hidden_size
        if self.qkv_bias:
            small += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            small += 2 * self.head_dim
        return small

    @property
    def total_params(self) -> int:
        output = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + output + self.num_layers * self.params_per_layer + self.hidden_size

    @property
    def largest_layer_params(self) -> int:
        """The largest single weight: what ZeRO-3 must gather whole at once (usually the embedding)."""
        h = self.hidden_size
        return max(self.embedding_params, h * self.intermediate_size, h * self.q_dim)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (DESIGN §5): 6·(params − input embedding) + 12·layers·heads·head_dim·seq."""
        dense = 6 * (self.total_params - self.embedding_params)
        attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return float(dense + attention)

    def layer_flops_per_token(self, seq_len: int) -> float:
        """One decoder layer's share of ``flops_per_token``: 6·(its parameters) + 12·heads·head_dim·seq."""
        return float(6 * self.params_per_layer + 12 * self.num_heads * self.head_dim * seq_len)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "model_type": self.model_type,
            "params": self.total_params,
            "largest_layer_params": self.largest_layer_params,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "tied_embeddings": self.tied_embeddings,
        }


def catalogue_config(name: str) -> tuple[str, dict[str, Any]] | None:
    """The catalogue's (canonical name, config) for a model name or path, or ``None``."""
    key = _normalise(name)
    for canonical, config in CATALOGUE.items():
        if _normalise(canonical) == key:
            return canonical, dict(config)
    alias = _ALIASES.get(key)
    if alias:
        return alias, dict(CATALOGUE[alias])
    return None


def _normalise(name: str) -> str:
    last = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in _VARIANT_SUFFIXES:
        last = last.removesuffix(suffix)
    return last.removeprefix("meta-") if last.startswith("meta-llama-3-") else last


def shape_from_config(config: Mapping[str, Any], *, name: str, source: str) -> ModelShape:
    """A shape from Hugging Face config values. ``source`` prefixes error messages (``file`` or ``file:line``)."""
    if not isinstance(config, Mapping):
        raise SpecError(f"{source}: a model config is a mapping of keys, not a {type(config).__name__}")
    model_type = str(config.get("model_type", "llama"))
    moe_keys = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)]
    if moe_keys or "moe" in model_type:
        raise SpecError(
            f"{source}: {name} is a mixture-of-experts model ({moe_keys[0] if moe_keys else model_type}); "
            "the memory planner models dense decoder-only models",
            fix="set train.micro_batch_size, train.gradient_checkpointing and zero.offload explicitly",
        )
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise SpecError(
            f"{source}: {name}: config lacks {', '.join(missing)}",
            fix="give these keys in model.config (they decide the model's size)",
        )
    values = {k: _positive_int(config[k], k, source) for k in _REQUIRED}
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if model_type == "qwen":
        # The original Qwen: c_attn is one biased q/k/v projection without GQA, the MLP
        # matrices are intermediate_size // 2 wide, embeddings are not tied.
        head_dim = _positive_int(config.get("kv_channels", hidden // heads), "kv_channels", source)
        return ModelShape(
            name=name,
            source=source,
            model_type=model_type,
            vocab_size=values["vocab_size"],
            hidden_size=hidden,
            num_layers=values["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=head_dim,
            intermediate_size=values["intermediate_size"] // 2,
            tied_embeddings=False,
            qkv_bias=True,
        )
    kv_heads = _positive_int(config.get("num_key_value_heads") or heads, "num_key_value_heads", source)
    head_dim = _positive_int(config.get("head_dim") or hidden // heads, "head_dim", source)
    if heads % kv_heads:
        raise SpecError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    # transformers' Llama/Qwen2/Qwen3 configs default tie_word_embeddings to False.
    tied = bool(config.get("tie_word_embeddings", False))
    return ModelShape(
        name=name,
        source=source,
        model_type=model_type,
        vocab_size=values["vocab_size"],
        hidden_size=hidden,
        num_layers=values["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=values["intermediate_size"],
        tied_embeddings=tied,
        qk_norm=model_type == "qwen3",
        # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
    )


def _positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{source}: {key} must be a positive whole number (got {value!r})")
    return value


def shape_for_job(job: LoadedJob) -> ModelShape:
    """The shape of the job's model; errors name the spec line and list what would work."""
    model = job.spec.model
    name = model.name_or_path
    overrides = dict(model.config or {})
    where_config = job.where("model.config")
    if model.init == "random" and overrides:
        return shape_from_config(overrides, name=name, source=f"{where_config}: model.config")
    base, source = _base_config(job)
    if base is None:
        known = ", ".join(CATALOGUE)
        close = difflib.get_close_matches(name.rsplit("/", 1)[-1], [k.rsplit("/", 1)[-1] for k in CATALOGUE], n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise SpecError(
            f"{job.where('model.name_or_path')}: model.name_or_path: cannot tell the shape of {name!r}: "
            f"no config.json there on this machine and not in the planner's catalogue.{hint}",
            fix=f"copy the model's config.json into a local directory and name it, give the architecture in "
            f"model.config, or use a catalogue model: {known}",
        )
    if overrides:
        base.update(overrides)
        source = f"{source} + model.config ({where_config})"
    return shape_from_config(base, name=name, source=source)


def _base_config(job: LoadedJob) -> tuple[dict[str, Any] | None, str]:
    name = job.spec.model.name_or_path
    local = job.resolve_local(name)
    config_path = local / "config.json" if local.is_dir() else local if local.name == "config.json" else None
    if config_path is not None and config_path.is_file():
        return _read_config_json(config_path), str(config_path)
    found = catalogue_config(name)
    if found is not None:
        canonical, config = found
        return config, f"catalogue: {canonical} (published config.json)"
    return None, ""


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: config.json is a JSON object, not a {type(data).__name__}")
    # Multimodal/wrapped configs keep the language model under text_config.
    text = data.get("text_config")
    return dict(text) if isinstance(text, dict) and "hidden_size" not in data else data
