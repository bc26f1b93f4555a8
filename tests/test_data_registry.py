"""LLaMA-Factory's dataset registry (``data.dataset_info`` + ``data.dataset``) and the mix strategies.

The registry and its files are written here in the layout LLaMA-Factory's data/README.md documents
(``file_name`` a file or a folder, ``formatting``, ``columns``, ``tags``, ``hf_hub_url``). Each
dataset is built by the node's real builder with Qwen3's real tokenizer: concatenation (its default)
trains every row of each, as LLaMA-Factory's ``dataset: identity,alpaca_en_demo`` does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qwen3tokenizer import qwen3_tokenizer

from orchestrator.errors import InputError
from orchestrator.spec.job import load_job
from orchestrator.train.data import prepare as data_prepare
from orchestrator.train.data import sources
from orchestrator.train.data.build import BuildSettings, build
from orchestrator.train.datasets import data_summary

JOB = Path(__file__).resolve().parent.parent / "jobs" / "tiny-cpu.yaml"

IDENTITY = [{"instruction": "hi", "input": "", "output": f"I am model {n}.", "id": n} for n in range(3)]
CHAT = [
    {"messages": [{"role": "user", "content": f"Question {n}?"}, {"role": "assistant", "content": f"Answer {n}."}],
     "images": []}
    for n in range(5)
]  # fmt: skip
REGISTRY = {
    "identity": {"file_name": "identity.json"},
    "chat_demo": {
        "file_name": "chat",  # a folder: every data file in it
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    },
    "hub": {"hf_hub_url": "org/some-set", "split": "validation"},
    "chat_first": {
        "file_name": "chat/part-1.jsonl",
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    },
    "pictures": {"file_name": "identity.json", "columns": {"prompt": "instruction", "images": "images"}},
    "sampled": {"file_name": "identity.json", "num_samples": 2},
}


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_tokenizer()


def _job(tmp_path: Path, data: dict) -> Path:
    folder = tmp_path / "llamafactory-data"
    (folder / "chat").mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(REGISTRY), encoding="utf-8")
    (folder / "identity.json").write_text(json.dumps(IDENTITY), encoding="utf-8")
    for name, rows in (("part-0.jsonl", CHAT[:2]), ("part-1.jsonl", CHAT[2:])):
        (folder / "chat" / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    text = JOB.read_text(encoding="utf-8")
    head, _, rest = text.partition("data:\n")
    job = tmp_path / "job.yaml"
    job.write_text(head + "data: " + json.dumps(data) + "\n" + rest[rest.index("train:") :], encoding="utf-8")
    return job


def _build(tmp_path: Path, loaded, tokenizer):
    found = sources.resolve_sources(loaded)
    settings = BuildSettings(256, False, 0, "fail", mix=loaded.spec.data.mix)
    folder = tmp_path / "cache"
    folder.mkdir(exist_ok=True)
    return build(found, tokenizer, settings, folder, lambda _: None, lambda _: None, workers=1), found, settings


def test_dataset_a_b_trains_every_row_of_both_and_reads_the_tags(tmp_path, qwen3):
    loaded = load_job(_job(tmp_path, {"dataset_info": "llamafactory-data", "dataset": "identity,chat_demo"}))
    data = loaded.spec.data
    assert [(s.path, s.format) for s in data.all_sources()] == [
        ("llamafactory-data/identity.json", "alpaca"),
        ("llamafactory-data/chat/part-0.jsonl", "sharegpt"),
        ("llamafactory-data/chat/part-1.jsonl", "sharegpt"),
    ]
    assert data.mix == "concat" and data.all_sources()[1].tags.role_tag == "role"
    result, found, settings = _build(tmp_path, loaded, qwen3)
    assert [s["examples"] for s in result.info["sources"]] == [3, 2, 3]  # every row: 8, not a weighted share
    # Every column accounted for: the ones no format reads are named in the summary.
    assert result.info["sources"][0]["ignored"] == ["id"] and result.info["sources"][1]["ignored"] == ["images"]
    lines = data_summary(result.info, 256, packed=False)
    assert "ignored: id" in lines[0] and "ignored: images" in lines[1]
    # The same sources in today's weighted mix take equal shares (3 of each): another cache key.
    weighted = BuildSettings(256, False, 0, "fail", mix="weights")
    concat_key = data_prepare.key_material(found, qwen3, settings, tmp_path / "c1")
    assert concat_key != data_prepare.key_material(found, qwen3, weighted, tmp_path / "c2")
    assert concat_key["sources"][1]["tags"]["role_tag"] == "role"  # tags change the tokens: in the key


def test_interleave_probs_under_and_over(tmp_path, qwen3):
    job = {"dataset_info": "llamafactory-data/dataset_info.json", "dataset": ["identity", "chat_first"],
           "mix_strategy": "interleave_under", "interleave_probs": [0.75, 0.25]}  # fmt: skip
    under = load_job(_job(tmp_path, job))
    assert [s.weight for s in under.spec.data.all_sources()] == [0.75, 0.25]
    result, _, _ = _build(tmp_path, under, qwen3)
    assert [s["read"] for s in result.info["sources"]] == [3, 1]  # stops when identity's 3 rows are used up
    over = load_job(_job(tmp_path / "over", {**job, "mix_strategy": "interleave_over"}))
    result, _, _ = _build(tmp_path / "over", over, qwen3)
    # Every row of both: chat_first's 3 rows are 25%, so identity's 3 rows are repeated to 9.
    assert [s["read"] for s in result.info["sources"]] == [9, 3]


def test_hub_entries_read_from_the_nodes_cache(tmp_path):
    loaded = load_job(_job(tmp_path, {"dataset_info": "llamafactory-data", "dataset": ["hub"]}))
    assert [s.path for s in loaded.spec.data.all_sources()] == ["hf:org/some-set:validation"]


@pytest.mark.parametrize(
    "names, words",
    [
        (["nope"], "data.dataset: 'nope' is not in llamafactory-data"),
        (["pictures"], "columns.images: 'images' holds images: dzctl trains text models"),
        (["sampled"], "'num_samples': sampling N rows is not done"),
    ],
)
def test_registry_entries_dzctl_cannot_honour_are_refused_by_name(tmp_path, names, words):
    with pytest.raises(InputError) as caught:
        load_job(_job(tmp_path, {"dataset_info": "llamafactory-data", "dataset": names}))
    assert words in caught.value.message and "job.yaml" in caught.value.message


def test_interleave_probs_weigh_data_sources_too_and_text_jobs_pack_on_cpu(tmp_path):
    from orchestrator.planning.packing import resolve_packing

    sources = [{"path": "a.jsonl"}, {"path": "b.jsonl"}]
    mixed = load_job(_job(tmp_path, {"sources": sources, "mix_strategy": "interleave_under",
                                     "interleave_probs": [0.2, 0.8]}))  # fmt: skip
    assert [s.weight for s in mixed.spec.data.all_sources()] == [0.2, 0.8] and mixed.spec.data.mix == "interleave_under"
    assert resolve_packing(mixed.spec) is False  # the tiny CPU job: packing auto is off on CPU...
    text = load_job(_job(tmp_path, {"path": "c4.jsonl", "format": "text"}))
    assert resolve_packing(text.spec) is True  # ... but continued pretraining packs its documents


def test_data_tags_and_turn_keys_read_the_eval_rows_as_the_training_rows(tmp_path):
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    data = {"path": "a.jsonl", "format": "sharegpt", "tags": tags, "roles_to_train": ["user", "assistant"]}
    loaded = load_job(_job(tmp_path, {**data, "eval": {"path": "e.jsonl"}}))
    (train,), (held,) = loaded.spec.data.all_sources(), loaded.spec.data.eval_sources()
    assert train.tags == held.tags and held.tags.role_tag == "role"
    assert train.roles_to_train == held.roles_to_train == ["user", "assistant"]


def test_an_openai_formatting_entry_trains_tool_calls_as_the_messages_format_does(tmp_path, qwen3):
    from test_data_toolcalls import OPENAI_ROW

    from orchestrator.planning.datarows import read_row
    from orchestrator.train.data.chat import make_renderer
    from orchestrator.train.data.conversations import Conversation, encode_all

    folder = tmp_path / "agent-data"
    folder.mkdir()
    entry = {"file_name": "agent.jsonl", "formatting": "openai", "columns": {"messages": "messages", "tools": "tools"}}
    (folder / "dataset_info.json").write_text(json.dumps({"agent": entry}), encoding="utf-8")
    (folder / "agent.jsonl").write_text(json.dumps(OPENAI_ROW) + "\n", encoding="utf-8")
    loaded = load_job(_job(tmp_path, {"dataset_info": "agent-data", "dataset": "agent"}))
    (source,) = loaded.spec.data.all_sources()
    assert (source.format, source.tags.observation_tag) == ("sharegpt", "tool")
    result, _, _ = _build(tmp_path, loaded, qwen3)
    assert result.info["sources"][0]["tool_rows"] == 1 and result.info["sources"][0]["examples"] == 2
    from orchestrator.train.data.cache import write_manifest
    from orchestrator.train.data.mapped import MappedData

    write_manifest(tmp_path / "cache", result.files, result.info)
    mapped = MappedData(tmp_path / "cache")
    reference = Conversation.of(read_row(OPENAI_ROW, "messages", "row"), "row")
    expected = encode_all([reference], qwen3, 256, make_renderer(qwen3)).examples
    assert [mapped.item(n) for n in range(2)] == expected
