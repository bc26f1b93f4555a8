"""Tool calls, both layouts, through Qwen3's real tokenizer and chat template, token by token.

The rows are written here in the layouts the tools document: OpenAI's (``tool_calls`` on an
assistant turn, ``role: tool``, a ``tools`` list; axolotl's chat_template docs) and LLaMA-Factory's
sharegpt (``function_call`` and ``observation`` turns, a ``tools`` column of JSON text, as its
data/README.md and glaive_toolcall demo have them). Each is checked against
``apply_chat_template`` of the same conversation: the ids are the template's own, the call carries
loss, and the tools block and the tool's result carry none.
"""

from __future__ import annotations

import json

import pytest
from qwen3tokenizer import qwen3_tokenizer

from orchestrator.planning.chattemplate import ChatTemplate
from orchestrator.planning.datarows import DataError, RowOptions, read_row
from orchestrator.train.data.chat import IGNORE, make_renderer
from orchestrator.train.data.conversations import Conversation, encode
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
RESULT = '{"temp_c": 21, "sky": "clear"}'
ANSWER = "It is 21 °C and clear in Paris."

OPENAI_ROW = {
    "messages": [
        {"role": "system", "content": "You help with travel."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": CALL}]},
        {"role": "tool", "content": RESULT},
        {"role": "assistant", "content": ANSWER},
    ],
    "tools": [{"type": "function", "function": WEATHER}],
}
# LLaMA-Factory's sharegpt layout of the same conversation: the call is JSON text, tools a JSON string.
SHAREGPT_ROW = {
    "conversations": [
        {"from": "human", "value": "What is the weather in Paris?"},
        {"from": "function_call", "value": json.dumps(CALL)},
        {"from": "observation", "value": RESULT},
        {"from": "gpt", "value": ANSWER},
    ],
    "system": "You help with travel.",
    "tools": json.dumps([WEATHER]),
}
# The conversation as transformers' apply_chat_template takes it.
TEMPLATE_MESSAGES = [
    {"role": "system", "content": "You help with travel."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": RESULT},
    {"role": "assistant", "content": ANSWER},
]
TOOLS = [{"type": "function", "function": WEATHER}]


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_tokenizer()


def _examples(tokenizer, row, fmt, options=None):
    read = read_row(row, fmt, "t.jsonl:row 1", options)
    examples, stats = encode(Conversation.of(read, "t.jsonl:row 1"), tokenizer, 4096, make_renderer(tokenizer))
    return examples, stats


def _ids(tokenizer, messages, generation_prompt=False):
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"], text


def _check_against_the_template(tokenizer, examples):
    """Two examples (Qwen3 renders a finished call without its think block): each the template's own ids,
    the loss exactly on what the template adds for the assistant turn."""
    assert len(examples) == 2
    for (ids, labels), upto in zip(examples, (3, 5), strict=True):
        whole, _ = _ids(tokenizer, TEMPLATE_MESSAGES[:upto])
        prompt, prompt_text = _ids(tokenizer, TEMPLATE_MESSAGES[: upto - 1], generation_prompt=True)
        assert ids == whole  # token for token the template's rendering
        assert whole[: len(prompt)] == prompt
        assert labels == [IGNORE] * len(prompt) + whole[len(prompt) :]
        assert "<tools>" in prompt_text and "get_weather" in prompt_text  # the tools block: in the prompt
    (first_ids, first_labels), (second_ids, second_labels) = examples
    trained_first = tokenizer.decode([t for t, label in zip(first_ids, first_labels, strict=True) if label != IGNORE])
    assert trained_first == (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
    )
    untrained_second = tokenizer.decode(
        [t for t, label in zip(second_ids, second_labels, strict=True) if label == IGNORE]
    )
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in untrained_second  # the result: no loss
    trained_second = tokenizer.decode(
        [t for t, label in zip(second_ids, second_labels, strict=True) if label != IGNORE]
    )
    assert trained_second == f"<think>\n\n</think>\n\n{ANSWER}<|im_end|>\n"


def test_openai_tool_calls_train_the_call_and_not_the_result_or_the_tools_block(qwen3):
    examples, stats = _examples(qwen3, OPENAI_ROW, "messages")
    _check_against_the_template(qwen3, examples)
    assert stats.untrained_turns == 0


def test_sharegpt_function_call_and_observation_train_as_the_openai_layout_does(qwen3):
    examples, _ = _examples(qwen3, SHAREGPT_ROW, "sharegpt")
    _check_against_the_template(qwen3, examples)
    assert examples == _examples(qwen3, OPENAI_ROW, "messages")[0]


def test_sharegpt_tags_with_other_role_names_read_the_same_conversation(qwen3):
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
            "observation_tag": "tool", "function_tag": "call", "system_tag": "system"}  # fmt: skip
    renamed = {
        "conversations": [
            {"role": {"human": "user", "function_call": "call", "observation": "tool", "gpt": "assistant"}[t["from"]],
             "content": t["value"]}
            for t in SHAREGPT_ROW["conversations"]
        ],
        "system": SHAREGPT_ROW["system"],
        "tools": SHAREGPT_ROW["tools"],
    }  # fmt: skip
    examples, _ = _examples(qwen3, renamed, "sharegpt", RowOptions(tags=tags))
    assert examples == _examples(qwen3, SHAREGPT_ROW, "sharegpt")[0]


def test_a_template_without_tools_refuses_a_tool_row_naming_it():
    # The byte-level tokenizer's ChatML has no tools: the call would vanish from the text.
    tokenizer = build_byte_level_tokenizer()
    read = read_row(OPENAI_ROW, "messages", "t.jsonl:row 4")
    with pytest.raises(
        DataError, match=r"t.jsonl:row 4: the row has tool calls, and the chat template .* renders none"
    ):
        encode(Conversation.of(read, "t.jsonl:row 4"), tokenizer, 4096, make_renderer(tokenizer))
    plain = make_renderer(tokenizer, ChatTemplate("plain", None))
    with pytest.raises(DataError, match="renders none"):
        encode(Conversation.of(read, "t.jsonl:row 4"), tokenizer, 4096, plain)


def test_the_node_builder_caches_both_layouts_with_the_calls_trained(tmp_path, qwen3):
    from orchestrator.spec.job import DataSource
    from orchestrator.train.data.build import BuildSettings, build
    from orchestrator.train.data.cache import write_manifest
    from orchestrator.train.data.mapped import MappedData
    from orchestrator.train.data.sources import Source

    found = []
    for index, (row, fmt) in enumerate(((OPENAI_ROW, "messages"), (SHAREGPT_ROW, "sharegpt"))):
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text(json.dumps(row) + "\n", encoding="utf-8")
        found.append(Source(index, DataSource(path=str(path), format=fmt, columns={}), str(path), "json"))
    folder = tmp_path / "cache"
    folder.mkdir()
    settings = BuildSettings(4096, False, 0, "fail", mix="concat")
    result = build(found, qwen3, settings, folder, lambda _: None, lambda _: None, workers=1)
    assert [(s["examples"], s["tool_rows"], s["ignored"]) for s in result.info["sources"]] == [(2, 1, []), (2, 1, [])]
    write_manifest(folder, result.files, result.info)
    data = MappedData(folder)
    items = [data.item(n) for n in range(4)]
    assert [item["input_ids"] for item in items[:2]] == [item["input_ids"] for item in items[2:]]
    call = [t for t, label in zip(items[0]["input_ids"], items[0]["labels"], strict=True) if label != IGNORE]
    assert "<tool_call>" in qwen3.decode(call) and "<tools>" in qwen3.decode(items[0]["input_ids"])
    answer = [t for t, label in zip(items[1]["input_ids"], items[1]["labels"], strict=True) if label != IGNORE]
    assert "<tool_response>" not in qwen3.decode(answer) and ANSWER in qwen3.decode(answer)
