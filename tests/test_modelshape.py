"""Model shapes: the catalogue against published sizes, config.json reading, and counts checked on real HF models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.planning.shape import CATALOGUE, catalogue_config, shape_for_job, shape_from_config
from orchestrator.spec.job import load_job

REPO = Path(__file__).resolve().parent.parent

# Published parameter counts (total, non-embedding), in billions, from the model cards
# (huggingface.co/<name>): Qwen3 cards give both; Qwen2.5 cards give both; Qwen-72B
# and Llama 3 give totals. The card figures are rounded, hence the tolerance.
PUBLISHED = {
    "Qwen/Qwen3-0.6B": (0.6, 0.44),
    "Qwen/Qwen3-1.7B": (1.7, 1.4),
    "Qwen/Qwen3-4B": (4.0, 3.6),
    "Qwen/Qwen3-8B": (8.2, 6.95),
    "Qwen/Qwen3-14B": (14.8, 13.2),
    "Qwen/Qwen3-32B": (32.8, 31.2),
    "Qwen/Qwen2.5-7B": (7.61, 6.53),
    "Qwen/Qwen2.5-14B": (14.7, 13.1),
    "Qwen/Qwen2.5-32B": (32.5, 31.0),
    "Qwen/Qwen2.5-72B": (72.7, 70.0),
    "Qwen/Qwen-72B": (72.0, None),
    "meta-llama/Meta-Llama-3-8B": (8.03, None),
    "meta-llama/Meta-Llama-3-70B": (70.6, None),
}


def _shape(name: str):
    return shape_from_config(CATALOGUE[name], name=name, source="catalogue")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalogue_matches_published_parameter_counts(name):
    shape = _shape(name)
    total, non_embedding = PUBLISHED[name]
    # Rounded card figures ("0.6B", "1.7B") allow more slack than the two-decimal ones.
    tolerance = 0.05 if total < 2 else 0.015
    assert shape.total_params / 1e9 == pytest.approx(total, rel=tolerance)
    if non_embedding is not None:
        embeddings = shape.embedding_params * (1 if shape.tied_embeddings else 2)
        assert (shape.total_params - embeddings) / 1e9 == pytest.approx(non_embedding, rel=tolerance)


def test_catalogue_covers_the_required_models():
    required = [
        "Qwen3-0.6B",
        "Qwen3-1.7B",
        "Qwen3-4B",
        "Qwen3-8B",
        "Qwen3-14B",
        "Qwen3-32B",
        "Qwen2.5-7B",
        "Qwen2.5-14B",
        "Qwen2.5-32B",
        "Qwen2.5-72B",
        "Qwen-72B",
        "Meta-Llama-3-8B",
        "Meta-Llama-3-70B",
    ]
    for name in required:
        assert catalogue_config(name) is not None, name


def test_qwen3_8b_shape_is_the_one_measured_on_h200():
    shape = _shape("Qwen/Qwen3-8B")
    # DESIGN §5: 8.19 B parameters; the input embedding and the LM head are separate tensors.
    assert round(shape.total_params / 1e9, 2) == 8.19
    assert (shape.vocab_size, shape.hidden_size, shape.num_layers) == (151936, 4096, 36)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (32, 8, 128, 12288)
    assert not shape.tied_embeddings and shape.qk_norm
    assert shape.largest_layer_params == 151936 * 4096


def test_original_qwen_keys_are_read_as_published():
    # Qwen-72B's config.json: intermediate_size 49152 is twice the width of each MLP matrix.
    shape = _shape("Qwen/Qwen-72B")
    assert shape.intermediate_size == 24576
    assert shape.num_kv_heads == shape.num_heads == 64
    assert shape.head_dim == 128 and shape.qkv_bias and not shape.tied_embeddings


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),
        ("qwen/qwen3-8b", "Qwen/Qwen3-8B"),
        ("/data/hf/Qwen3-8B-Base", "Qwen/Qwen3-8B"),
        ("Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-72B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3-8B"),
        ("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Meta-Llama-3-70B"),
    ],
)
def test_catalogue_names_and_variants(name, canonical):
    found = catalogue_config(name)
    assert found is not None and found[0] == canonical


def test_unknown_names_are_not_guessed():
    assert catalogue_config("Qwen/Qwen3-9B") is None
    assert catalogue_config("gpt2") is None


# --- counts against real transformers models (tiny configs, CPU) ---------------------

TINY = {
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=False,
    ),
    "qwen3-tied": dict(
        model_type="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "llama": dict(
        model_type="llama",
        vocab_size=300,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
    ),
    "mistral": dict(
        model_type="mistral",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64 * 3,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("key", sorted(TINY))
def test_parameter_count_equals_transformers(key):
    transformers = pytest.importorskip("transformers")
    config = TINY[key]
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights once
    shape = shape_from_config(config, name=key, source="test")
    assert shape.total_params == sum(p.numel() for p in unique)
    assert shape.largest_layer_params == max(p.numel() for p in unique)
    assert sorted(shape.weight_numels()) == sorted(p.numel() for p in unique)
    small = sum(p.numel() for p in unique if p.dim() == 1)
    assert shape.num_layers * shape.small_params_per_layer + shape.hidden_size == small


# --- config.json and model.config -------------------------------------------------------


def _job(tmp_path: Path, model: str, extra: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: t\nmodel:\n{model}\ndata:\n  path: d.jsonl\n{extra}", encoding="utf-8")
    return path


def test_local_config_json_is_read(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY["qwen2"]), encoding="utf-8")
    job = load_job(_job(tmp_path, "  name_or_path: my-model"))
    shape = shape_for_job(job)
    assert shape.hidden_size == 64 and shape.qkv_bias
    assert shape.source == str(model_dir / "config.json")


def test_local_config_json_overrides_the_catalogue(tmp_path):
    # A local directory named like a catalogue model: its own config.json wins.
    model_dir = tmp_path / "Qwen3-8B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY["qwen3"]), encoding="utf-8")
    shape = shape_for_job(load_job(_job(tmp_path, "  name_or_path: Qwen3-8B")))
    assert shape.hidden_size == 64


def test_catalogue_plus_model_config_overrides(tmp_path):
    job = load_job(_job(tmp_path, "  name_or_path: Qwen/Qwen3-8B\n  config:\n    num_hidden_layers: 4"))
    shape = shape_for_job(job)
    assert shape.num_layers == 4 and shape.hidden_size == 4096
    assert "model.config" in shape.source


def test_random_init_uses_model_config():
    shape = shape_for_job(load_job(REPO / "jobs" / "tiny-cpu.yaml"))
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size, shape.head_dim) == (64, 2, 384, 16)
    assert "model.config" in shape.source


def test_unknown_model_is_a_located_error_with_suggestion(tmp_path):
    path = _job(tmp_path, "  name_or_path: Qwen/Qwen3-8b-chatty")
    with pytest.raises(SpecError) as info:
        shape_for_job(load_job(path))
    message = str(info.value)
    assert message.startswith(f"{path}:3: model.name_or_path:")
    assert "Qwen3-8B" in message  # did you mean
    assert "catalogue" in info.value.fix


def test_mixture_of_experts_is_refused(tmp_path):
    config = dict(TINY["qwen3"], model_type="qwen3_moe", num_experts=128)
    with pytest.raises(SpecError, match="mixture-of-experts"):
        shape_from_config(config, name="moe", source="x")


def test_missing_and_bad_keys_are_named(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    config = dict(TINY["llama"])
    del config["intermediate_size"]
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(SpecError, match=r"config.json: m: config lacks intermediate_size"):
        shape_for_job(load_job(_job(tmp_path, "  name_or_path: m")))
    with pytest.raises(SpecError, match="hidden_size must be a positive whole number"):
        shape_from_config(dict(TINY["llama"], hidden_size="64"), name="x", source="x")
    with pytest.raises(SpecError, match="not a multiple"):
        shape_from_config(dict(TINY["llama"], num_key_value_heads=4), name="x", source="x")


def test_broken_config_json_names_the_line(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{\n  "hidden_size": 64,\n  oops\n}', encoding="utf-8")
    with pytest.raises(SpecError, match=r"config.json:3: not valid JSON"):
        shape_for_job(load_job(_job(tmp_path, "  name_or_path: m")))


def test_multimodal_text_config_is_used(tmp_path):
    model_dir = tmp_path / "vl"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"text_config": TINY["qwen3"]}), encoding="utf-8")
    assert shape_for_job(load_job(_job(tmp_path, "  name_or_path: vl"))).hidden_size == 64


def test_flops_per_token_formula():
    shape = _shape("Qwen/Qwen3-8B")
    expected = 6 * (shape.total_params - shape.embedding_params) + 12 * 36 * 32 * 128 * 4096
    assert shape.flops_per_token(4096) == expected
