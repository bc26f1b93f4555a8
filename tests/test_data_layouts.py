"""The other row layouts people bring, through Qwen3's real tokenizer: content parts, plain text, media,
rows of no format, and axolotl's per-turn training keys (roles_to_train, train_on_eos, per-turn flags).

Rows are written here in the layouts the tools document (OpenAI's content parts, LLaMA-Factory's
``{"text": ...}`` pretraining rows, axolotl's chat_template ``train`` key per turn).
"""

from __future__ import annotations

import pytest
from qwen3tokenizer import qwen3_tokenizer

from orchestrator.planning.datarows import DataError, RowOptions, read_row
from orchestrator.train.data.chat import IGNORE, TrainingRule, make_renderer
from orchestrator.train.data.conversations import Conversation, encode

WHERE = "d.jsonl:row 3"


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_tokenizer()


def _encode(tokenizer, row, fmt, options=None, rule=None, max_len=4096):
    read = read_row(row, fmt, WHERE, options)
    return encode(Conversation.of(read, WHERE, rule), tokenizer, max_len, make_renderer(tokenizer))


def _trained(tokenizer, examples) -> list[str]:
    return [
        tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE])
        for ids, labels in examples
    ]


def test_content_part_lists_read_as_the_text_they_hold(qwen3):
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
        ]
    }
    text = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}
    assert _encode(qwen3, parts, "messages")[0] == _encode(qwen3, text, "messages")[0]


@pytest.mark.parametrize(
    "row, named",
    [
        ({"instruction": "<image>What is it?", "output": "A cat.", "images": ["cat.png"]}, "column 'images'"),
        (
            {
                "conversations": [{"from": "human", "value": "<audio>"}, {"from": "gpt", "value": "Hi"}],
                "audios": ["a.wav"],
            },
            "column 'audios'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                    {"role": "assistant", "content": "A cat."},
                ]
            },
            "content[0] is a 'image_url' part",
        ),
    ],
)
def test_media_is_refused_naming_the_column_and_saying_dzctl_trains_text_models(row, named):
    fmt = "alpaca" if "instruction" in row else "sharegpt" if "conversations" in row else "messages"
    with pytest.raises(DataError) as caught:
        read_row(row, fmt, WHERE)
    assert named in caught.value.message and "dzctl trains text models" in caught.value.message
    assert caught.value.message.startswith(WHERE)


def test_text_rows_train_every_token_with_the_end_token_cut_into_blocks_none_lost(qwen3):
    document = "Continued pretraining reads plain documents. " * 12
    (whole,), _ = _encode(qwen3, {"text": document}, "text")
    ids, labels = whole
    assert ids == qwen3(document + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert labels == ids  # every token trained, the end token too
    blocks, _ = _encode(qwen3, {"text": document}, "text", max_len=32)
    assert all(len(block_ids) <= 32 for block_ids, _ in blocks) and len(blocks) > 1
    assert [t for block_ids, _ in blocks for t in block_ids] == ids  # cut into blocks, not truncated


@pytest.mark.parametrize("fmt, missing", [("alpaca", "'instruction'"), ("messages", "'messages'"),
                                          ("sharegpt", "'conversations'")])  # fmt: skip
def test_a_text_row_under_another_format_says_format_text(fmt, missing):
    with pytest.raises(DataError) as caught:
        read_row({"text": "A plain document."}, fmt, WHERE)
    message = caught.value.message
    assert f"missing key {missing}" in message and "set data.format: text" in message


def test_a_row_of_no_format_names_its_layout_and_the_way_to_map_it():
    with pytest.raises(DataError) as caught:
        read_row({"prompt": "2+2?", "completion": "4"}, "alpaca", WHERE)
    message = caught.value.message
    assert "the row's layout ('prompt', 'completion') is none of dzctl's formats" in message
    assert "data.columns" in message and "text: text" in message


MULTI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "train": False},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}


def test_axolotl_per_turn_train_flags_are_honoured(qwen3):
    examples, _ = _encode(qwen3, MULTI, "messages")
    assert _trained(qwen3, examples) == ["<think>\n\n</think>\n\n4<|im_end|>\n"]  # "Hello" is not trained
    # message_field_training names another key; then "train" is an ordinary (ignored) key of the turn.
    renamed = {"messages": [{**t, "learn": t.pop("train")} if "train" in t else t for t in
                            [dict(t) for t in MULTI["messages"]]]}  # fmt: skip
    examples, _ = _encode(qwen3, renamed, "messages", RowOptions(train_field="learn"))
    assert _trained(qwen3, examples) == ["<think>\n\n</think>\n\n4<|im_end|>\n"]
    both, _ = _encode(qwen3, MULTI, "messages", RowOptions(train_field="learn"))
    assert len(_trained(qwen3, both)) == 2  # without its key, both assistant turns train


def test_roles_to_train_and_train_on_eos(qwen3):
    plain = {"messages": [{k: v for k, v in m.items() if k != "train"} for m in MULTI["messages"]]}
    users, _ = _encode(qwen3, plain, "messages", rule=TrainingRule(("user", "assistant"), "turn"))
    trained = "".join(_trained(qwen3, users))
    assert "<|im_start|>user\nHi<|im_end|>\n" in trained and "<|im_start|>user\n2+2?<|im_end|>\n" in trained
    none, _ = _encode(qwen3, plain, "messages", rule=TrainingRule(("assistant",), "none"))
    assert all("<|im_end|>" not in text for text in _trained(qwen3, none))
    last, _ = _encode(qwen3, plain, "messages", rule=TrainingRule(("assistant",), "last"))
    # Qwen3 splits this row per turn: the last turn's end token is the only one trained.
    assert _trained(qwen3, last) == ["<think>\n\n</think>\n\nHello", "<think>\n\n</think>\n\n4<|im_end|>\n"]
    every, _ = _encode(qwen3, plain, "messages", rule=TrainingRule(("assistant",), "all"))
    ids, labels = every[-1]
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    assert all(label == end for token, label in zip(ids, labels, strict=True) if token == end)


def test_the_node_builder_packs_text_rows_every_token_trained_and_names_ignored_columns(tmp_path, qwen3):
    import json

    from orchestrator.spec.job import DataSource
    from orchestrator.train.data.build import BuildSettings, build
    from orchestrator.train.data.cache import write_manifest
    from orchestrator.train.data.mapped import MappedData
    from orchestrator.train.data.sources import Source
    from orchestrator.train.datasets import data_summary

    rows = [{"text": f"Document {n}: " + "plain words " * (5 + 10 * n), "meta": {"url": "x"}} for n in range(4)]
    path = tmp_path / "c4.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    source = Source(0, DataSource(path=str(path), format="text", columns={}), str(path), "json")
    folder = tmp_path / "cache"
    folder.mkdir()
    result = build([source], qwen3, BuildSettings(64, True, 0, "fail"), folder, print, lambda _: None, workers=1)
    write_manifest(folder, result.files, result.info)
    data = MappedData(folder)
    items = [data.example(n) for n in range(result.info["examples"])]
    expected = sum(len(qwen3(r["text"] + "<|im_end|>", add_special_tokens=False)["input_ids"]) for r in rows)
    assert sum(len(item["input_ids"]) for item in items) == expected == result.info["tokens"]  # none lost
    assert all(item["labels"] == item["input_ids"] for item in items)  # every token trained
    assert result.info["rows"] < result.info["examples"]  # packed
    assert "ignored: meta" in data_summary(result.info, 64, packed=True)[0]
