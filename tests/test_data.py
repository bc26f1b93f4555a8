"""Training data: parsing alpaca/messages rows, errors naming file:row, labels on responses only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.train.data import conversations as data
from orchestrator.train.data.conversations import IGNORE, Conversation, DataError, encode, read_conversations
from orchestrator.train.data.tokenizer import BYTE_LEVEL_VOCAB, build_byte_level_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "jobs" / "data" / "tiny-alpaca-zh.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_level_tokenizer()


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _trained_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])


def test_byte_level_round_trips_chinese(tokenizer):
    text = "保持健康的三个提示。\nemoji 🙂, tab\t, 全角！"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == BYTE_LEVEL_VOCAB == 259
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 256


def test_sample_data_is_valid_and_large_enough():
    report = read_conversations(SAMPLE, "alpaca", "fail")
    # tiny-cpu.yaml: 30 steps of micro-batch 4 on 2 ranks; the rows repeat over epochs.
    assert len(report.conversations) >= 64 and not report.skipped
    assert any("计算" in c.messages[0][1] for c in report.conversations)


def test_alpaca_labels_cover_only_the_response(tmp_path, tokenizer):
    path = _write(
        tmp_path / "a.jsonl", [{"instruction": "翻译成英文。", "input": "我喜欢喝茶。", "output": "I like tea."}]
    )
    (conv,) = read_conversations(path, "alpaca", "fail").conversations
    assert conv.messages == (("user", "翻译成英文。\n我喜欢喝茶。"), ("assistant", "I like tea."))
    ((ids, labels),), stats = encode(conv, tokenizer, 1024)
    assert stats.untrained_turns == 0
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\n翻译成英文。\n我喜欢喝茶。<|im_end|>\n<|im_start|>assistant\nI like tea.<|im_end|>\n"
    )
    # The response, its end-of-turn token (so the model learns to stop) and the newline after it.
    assert _trained_text(tokenizer, ids, labels) == "I like tea.<|im_end|>\n"
    first = labels.index(next(label for label in labels if label != IGNORE))
    assert all(label == IGNORE for label in labels[:first])


def test_plain_template_without_chat_template(tmp_path, tokenizer):
    plain = build_byte_level_tokenizer()
    plain.chat_template = None
    conv = Conversation((("system", "Be brief."), ("user", "2+2?"), ("assistant", "4")), "x:row 1")
    ((ids, labels),), _ = encode(conv, plain, 1024)
    assert plain.decode(ids) == "Be brief.\n\n### Instruction:\n2+2?\n\n### Response:\n4<|im_end|>\n\n"
    assert _trained_text(plain, ids, labels) == "4<|im_end|>\n\n"


def test_messages_multi_turn_trains_every_assistant_turn(tmp_path, tokenizer):
    row = {
        "messages": [
            {"role": "user", "content": "你好"},
            {"role": "assistant", "content": "你好！"},
            {"role": "user", "content": "再见"},
            {"role": "assistant", "content": "再见！"},
        ]
    }
    (conv,) = read_conversations(_write(tmp_path / "m.jsonl", [row]), "messages", "fail").conversations
    ((ids, labels),), stats = encode(conv, tokenizer, 1024)
    assert stats.untrained_turns == 0 and stats.split_rows == 0  # ChatML keeps the history: one example
    assert _trained_text(tokenizer, ids, labels) == "你好！<|im_end|>\n再见！<|im_end|>\n"


def test_template_that_rewrites_history_trains_every_turn_in_its_own_example(tokenizer):
    class Rewriting:
        """A chat template that drops earlier assistant turns' text (as Qwen3's drops their reasoning)."""

        chat_template = "x"
        eos_token = "<|im_end|>"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            last = len(messages) - 1
            parts = [
                f"{m['role']}: {m['content'] if m['role'] != 'assistant' or i == last else '...'}\n"
                for i, m in enumerate(messages)
            ]
            return "".join(parts) + ("assistant: " if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens):
            return tokenizer(text, add_special_tokens=add_special_tokens)

    conv = Conversation((("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")), "x:row 1")
    examples, stats = encode(conv, Rewriting(), 1024)
    assert stats.untrained_turns == 0 and stats.split_rows == 1
    # Turn 1 with its own text; turn 2 after the history as the template re-renders it.
    assert [tokenizer.decode(ids) for ids, _ in examples] == [
        "user: a\nassistant: b\n",
        "user: a\nassistant: ...\nuser: c\nassistant: d\n",
    ]
    assert [_trained_text(tokenizer, ids, labels) for ids, labels in examples] == ["b\n", "d\n"]


def test_truncation_and_rows_cut_away(tmp_path, tokenizer):
    rows = [
        {"instruction": "短", "output": "好"},
        {"instruction": "长" * 100, "output": "答"},  # 300 bytes of prompt: the response is past 64 tokens
    ]
    report = read_conversations(_write(tmp_path / "t.jsonl", rows), "alpaca", "fail")
    encoded = data.encode_all(report.conversations, tokenizer, 64)
    assert encoded.truncated_away == 1 and len(encoded.examples) == 1
    assert all(len(e["input_ids"]) <= 64 for e in encoded.examples)


def test_json_array_file(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "i", "input": "", "output": "o"}] * 3, ensure_ascii=False), "utf-8")
    assert len(read_conversations(path, "alpaca", "fail").conversations) == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"instruction": "i"', "row 2: not valid JSON"),
        ('{"instruction": "i", "input": ""}', "row 2: missing key 'output'"),
        ('{"instruction": 3, "output": "o"}', "row 2: 'instruction' must be text, got int"),
        ('{"instruction": "i", "output": "   "}', "row 2: 'output' is empty"),
        ('["i", "o"]', "row 2: expected a JSON object, got list"),
        (
            '{"messages": [{"role": "user", "content": "x"}]}',
            "row 2: missing key 'instruction'; the row has 'messages': set data.format: messages",
        ),
    ],
)
def test_malformed_alpaca_row_names_file_and_row(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "ok", "output": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_conversations(path, "alpaca", "fail")
    assert str(err.value).startswith(f"{path}:{message}")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0]: role must be one of system, user, assistant"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]: content must be text, got NoneType"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn with text"),
        (
            {"instruction": "i", "output": "o"},
            "missing key 'messages'; the row has 'instruction': set data.format: alpaca",
        ),
    ],
)
def test_malformed_messages_row(tmp_path, row, message):
    path = _write(tmp_path / "m.jsonl", [row])
    with pytest.raises(DataError, match="row 1: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        read_conversations(path, "messages", "fail")


def test_on_error_skip_keeps_good_rows_and_lists_bad_ones(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\nnot json\n\n{"instruction": "c"}\n', encoding="utf-8")
    report = read_conversations(path, "alpaca", "skip")
    assert len(report.conversations) == 1
    assert [s.split(": ", 1)[0] for s in report.skipped] == [f"{path}:row 2", f"{path}:row 4"]


def test_nothing_usable_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="no usable rows"):
        read_conversations(path, "alpaca", "skip")


def test_not_utf8_names_the_row(tmp_path):
    path = tmp_path / "gbk.jsonl"
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n' + '{"instruction": "中文"}'.encode("gbk") + b"\n")
    with pytest.raises(DataError, match=r"row 2: not UTF-8"):
        read_conversations(path, "alpaca", "fail")


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        read_conversations(tmp_path / "nope.jsonl", "alpaca", "fail")
