"""Chat templates done right: labels against real published templates (Qwen3, Llama 3, ChatML).

The templates are the files in tests/fixtures/chat_templates (their sources and licences are in
its README); the tokenizer is the project's byte-level one (every byte a token, so a decoded
label span is exactly the text it covers), with the template set on it as a model's would be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.planning.chattemplate import ChatTemplate
from orchestrator.train.data.build import BuildSettings, build
from orchestrator.train.data.chat import IGNORE, make_renderer
from orchestrator.train.data.conversations import Conversation, encode, read_conversations
from orchestrator.train.data.mapped import MappedData
from orchestrator.train.data.sources import Source
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"


def template(name: str) -> ChatTemplate:
    return ChatTemplate(f"{name}.jinja", (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_byte_level_tokenizer()
    # Llama 3's template starts with bos_token, as Llama 3's tokenizer has one.
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    return tokenizer


def trained(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])


def examples_of(tokenizer, name, messages, reasoning=(), enable_thinking="auto"):
    """(rendered text, trained text) of each example, and the counts, of one conversation."""
    renderer = make_renderer(tokenizer, template(name), enable_thinking)
    conv = Conversation(tuple(messages), "t:row 1", tuple(reasoning))
    examples, stats = encode(conv, tokenizer, 1 << 16, renderer)
    for ids, labels in examples:
        # Labels are the ids themselves where trained: aligned token for token.
        assert all(label in (IGNORE, token) for token, label in zip(ids, labels, strict=True))
    return [(tokenizer.decode(ids), trained(tokenizer, ids, labels)) for ids, labels in examples], stats


SINGLE = [("user", "2+2?"), ("assistant", "4")]
MULTI = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "2+2?"), ("assistant", "4")]


def test_single_turn_trains_the_answer_and_its_end_under_each_template(tokenizer):
    chatml, _ = examples_of(tokenizer, "chatml", SINGLE)
    assert chatml == [("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n", "4<|im_end|>\n")]
    llama, _ = examples_of(tokenizer, "llama3", SINGLE)
    assert llama == [
        (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
            "4<|eot_id|>",
        )
    ]
    qwen, stats = examples_of(tokenizer, "qwen3", SINGLE)
    # No reasoning, enable_thinking auto: Qwen3's empty think block is part of the target (README, decision).
    assert qwen == [
        (
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
            "<think>\n\n</think>\n\n4<|im_end|>\n",
        )
    ]
    assert stats.untrained_turns == 0 and stats.split_rows == 0


def test_multi_turn_trains_every_assistant_turn_even_where_qwen3_rerenders_history(tokenizer):
    qwen, stats = examples_of(tokenizer, "qwen3", MULTI)
    # Qwen3 renders a finished turn without its think block: the row splits, each turn in the
    # context the model sees at inference, and both are trained (today's encoder trained only the last).
    assert [text for _, text in qwen] == [
        "<think>\n\n</think>\n\nHello<|im_end|>\n",
        "<think>\n\n</think>\n\n4<|im_end|>\n",
    ]
    assert qwen[1][0] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
        "<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n"
    )
    assert stats.split_rows == 1 and stats.untrained_turns == 0
    # Templates that keep the history as it was: one example, both turns trained in it.
    ends = {"chatml": "Hello<|im_end|>\n4<|im_end|>\n", "llama3": "Hello<|eot_id|>4<|eot_id|>"}
    for name, both in ends.items():
        found, stats = examples_of(tokenizer, name, MULTI)
        assert len(found) == 1 and found[0][1] == both, name
        assert stats.split_rows == 0


def test_reasoning_content_is_trained_not_dropped(tmp_path, tokenizer):
    row = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"},
        ]
    }
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    (conv,) = read_conversations(path, "messages", "fail").conversations
    assert conv.reasoning == (None, "Two and two make four.", None, None)
    renderer = make_renderer(tokenizer, template("qwen3"))
    examples, stats = encode(conv, tokenizer, 1 << 16, renderer)
    assert [trained(tokenizer, ids, labels) for ids, labels in examples] == [
        "<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>\n",
        "<think>\nThree and three.\n</think>\n\n6<|im_end|>\n",
    ]
    # The second example's history is the first turn as Qwen3 renders it at inference: no reasoning.
    assert "Two and two" not in tokenizer.decode(examples[1][0])
    assert stats.reasoning_turns == 2 and stats.reasoning_dropped == 0
    # A template that does not read reasoning_content (ChatML) keeps it as a think block in the content.
    chatml, _ = encode(conv, tokenizer, 1 << 16, make_renderer(tokenizer, template("chatml")))
    assert trained(tokenizer, *chatml[0]).startswith("<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>\n")


def test_without_reasoning_enable_thinking_false_puts_the_empty_block_in_the_prompt(tokenizer):
    thinking, _ = examples_of(tokenizer, "qwen3", SINGLE, enable_thinking=True)
    assert thinking[0][1] == "<think>\n\n</think>\n\n4<|im_end|>\n"  # as target, as under auto
    conversation = [*SINGLE, ("user", "3+3?"), ("assistant", "<think>\nx\n</think>\n\n6")]
    plain, stats = examples_of(tokenizer, "qwen3", conversation, enable_thinking=False)
    # The empty block is rendered (as Qwen3's generation prompt adds it) but carries no loss,
    # and reasoning in the data is removed rather than trained after an empty block.
    assert [text for _, text in plain] == ["4<|im_end|>\n", "6<|im_end|>\n"]
    assert plain[0][0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
    assert stats.reasoning_turns == 1 and stats.reasoning_dropped == 1


def test_labels_follow_the_tokens_where_the_tokenizer_merges_across_the_prompt_end():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from orchestrator.train.data.tokenizer import SPECIALS, _byte_to_char

    chars = _byte_to_char()
    vocab = {char: byte for byte, char in chars.items()}
    newline, letter = chars[ord("\n")], chars[ord("I")]
    vocab[newline + letter] = len(vocab)  # one token for "\nI": it spans the prompt's end and the answer
    core = Tokenizer(models.BPE(vocab=vocab, merges=[(newline, letter)]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))
    merging = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=SPECIALS[0], eos_token=SPECIALS[2])
    merging.chat_template = template("chatml").text
    conv = Conversation((("user", "who?"), ("assistant", "I am")), "t:row 1")
    ((ids, labels),), _ = encode(conv, merging, 1 << 16)
    full = "<|im_start|>user\nwho?<|im_end|>\n<|im_start|>assistant\nI am<|im_end|>\n"
    # The ids are the tokenization of the rendered text (no token cut at the prompt's end) ...
    assert ids == merging(full, add_special_tokens=False)["input_ids"]
    # ... and the merged token is trained: it is the first token of the answer the model produces.
    assert trained(merging, ids, labels) == "\nI am<|im_end|>\n"


def test_the_cache_builder_trains_every_qwen3_turn_and_names_the_template(tmp_path, tokenizer):
    from orchestrator.spec.job import DataSource

    rows = [{"messages": [{"role": m[0], "content": m[1]} for m in MULTI]}] * 3
    path = tmp_path / "multi.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    source = Source(0, DataSource(path=str(path), format="messages", columns={}), str(path), "json")
    settings = BuildSettings(256, False, 0, "fail", template=template("qwen3"))
    folder = tmp_path / "cache"
    folder.mkdir()
    result = build([source], tokenizer, settings, folder, lambda _: None, lambda _: None, workers=1)
    (stats,) = result.info["sources"]
    assert stats["examples"] == 6 and stats["split_rows"] == 3 and stats["untrained_turns"] == 0
    assert result.info["template"].startswith("qwen3.jinja (file, sha256 ")
    from orchestrator.train.data.cache import write_manifest

    write_manifest(folder, result.files, result.info)
    data = MappedData(folder)
    item = data.item(1)
    assert trained(tokenizer, item["input_ids"], item["labels"]) == "<think>\n\n</think>\n\n4<|im_end|>\n"


# --- bad input: refused at load, exit 2, before any host is touched (tests/test_input_errors.py's sentinels)

BAD_INPUT_JOB = """\
name: demo
runtime: docker
accelerator: cpu
model:
  name_or_path: tiny
  init: random
data:
  path: data.jsonl
  template: {template}
train:
  max_steps: 5
"""

BAD_TEMPLATES = {
    # (file text or None for a missing file, line named, words in the message)
    "missing": (None, None, "not found"),
    "syntax": ("{% for message in messages %}\n{{ message['content'] }\n{% endfor %}\n", 2, "does not compile"),
    "render": (
        "{% for message in messages %}\n{{ message['content'] }}\n"
        "{% if message['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}\n{% endfor %}\n",
        3,
        "no system role",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TEMPLATES))
def test_a_template_file_that_is_missing_or_does_not_render_is_refused_before_any_host(tmp_path, case):
    import os
    import subprocess
    import sys

    text, line, words = BAD_TEMPLATES[case]
    bin_dir, marks = tmp_path / "bin", tmp_path / "ran"
    bin_dir.mkdir()
    for name in ("docker", "ssh", "scp", "torchrun", "deepspeed", "nvidia-smi"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {marks}\n")
        (bin_dir / name).chmod(0o755)
    template_file = tmp_path / "templates" / "mine.jinja"
    if text is not None:
        template_file.parent.mkdir()
        template_file.write_text(text, encoding="utf-8")
    (tmp_path / "data.jsonl").write_text('{"instruction": "i", "output": "o"}\n', encoding="utf-8")
    job = tmp_path / "job.yaml"
    job.write_text(BAD_INPUT_JOB.format(template="templates/mine.jinja"), encoding="utf-8")
    (tmp_path / "hosts").write_text("node-a slots=2\n", encoding="utf-8")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "launch", str(job), "--hosts", str(tmp_path / "hosts")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{job}:9: data.template" in done.stderr  # the key's own line in the job file
    assert (f"{template_file}:{line}:" if line else str(template_file)) in done.stderr, done.stderr
    assert words in done.stderr and "fix:" in done.stderr
    assert not marks.exists(), f"ran on a host: {marks.read_text()}"


TINY_JOB = (
    "name: demo\nruntime: process\naccelerator: cpu\nmodel:\n  name_or_path: tiny\n  init: random\n"
    "  tokenizer: builtin:byte-level\n  config: {model_type: qwen3, vocab_size: 384, hidden_size: 64, "
    "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}\n"
)


@pytest.mark.parametrize(
    ("turn", "words"),
    [
        ({"role": "assistant", "content": "4", "reasoning_content": 3}, "reasoning_content must be text, got int"),
        ({"role": "user", "content": "q", "reasoning_content": "r"}, "reasoning_content belongs to assistant turns"),
    ],
)
def test_a_bad_reasoning_content_is_refused_at_load_naming_the_row(tmp_path, turn, words):
    from orchestrator.errors import InputError
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.spec.job import load_job

    row = {"messages": [{"role": "user", "content": "2+2?"}, turn, {"role": "assistant", "content": "4"}]}
    (tmp_path / "data.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    (tmp_path / "job.yaml").write_text(TINY_JOB + "data:\n  path: data.jsonl\n  format: messages\n", encoding="utf-8")
    with pytest.raises(InputError) as refused:
        read_inputs(load_job(tmp_path / "job.yaml"))
    assert f"data.path: data.jsonl:row 1: messages[1]: {words}" in str(refused.value)


def test_a_template_file_travels_inside_the_nodes_job_yaml(tmp_path):
    import yaml

    from orchestrator.backends.jobfiles import node_spec
    from orchestrator.backends.launcher import memory_choice
    from orchestrator.planning.chattemplate import node_chat_template
    from orchestrator.planning.inputs import read_inputs
    from orchestrator.planning.launchplan import make_plan
    from orchestrator.planning.resolve import resolve_job
    from orchestrator.spec.hostfile import load_nodes
    from orchestrator.spec.job import load_job

    (tmp_path / "templates").mkdir()
    qwen3 = (FIXTURES / "qwen3.jinja").read_text(encoding="utf-8")
    (tmp_path / "templates" / "qwen3.jinja").write_text(qwen3, encoding="utf-8")
    (tmp_path / "data.jsonl").write_text('{"instruction": "i", "output": "o"}\n', encoding="utf-8")
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n", encoding="utf-8")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        TINY_JOB + "data:\n  path: data.jsonl\n  template: templates/qwen3.jinja\n  enable_thinking: false\n",
        encoding="utf-8",
    )
    inputs = read_inputs(load_job(job_file))
    assert inputs.chat_template.text == qwen3
    nodes = load_nodes(tmp_path / "hosts.txt")
    memory, ds_config = memory_choice(inputs, nodes, None, None)
    plan = make_plan(inputs.spec, nodes, "j-20260101-0000-abcd")
    written = node_spec(resolve_job(inputs, nodes, memory, ds_config, plan, None), plan.nodes[0])
    assert written["data"]["template"] == "templates/qwen3.jinja" and written["data"]["template_text"] == qwen3
    # The node reads it from its job.yaml, where no templates/ folder exists.
    node = tmp_path / "node"
    node.mkdir()
    (node / "job.yaml").write_text(yaml.safe_dump(written, sort_keys=False), encoding="utf-8")
    on_node = node_chat_template(load_job(node / "job.yaml"))
    assert (on_node.name, on_node.text) == ("templates/qwen3.jinja", qwen3)
    assert load_job(node / "job.yaml").spec.data.enable_thinking is False


def test_a_row_the_tokenizers_own_template_cannot_render_names_the_row(tmp_path):
    from orchestrator.planning.datarows import DataError
    from orchestrator.spec.job import DataSource

    strict = build_byte_level_tokenizer()
    # data.template: auto, and the model's own template refuses system turns (as Gemma's and Mistral's do).
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    path = tmp_path / "rows.jsonl"
    rows = [{"instruction": "i", "output": "o"}, {"instruction": "i", "output": "o", "system": "be brief"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    source = Source(0, DataSource(path=str(path), format="alpaca", columns={}), str(path), "json")
    folder = tmp_path / "cache"
    folder.mkdir()
    with pytest.raises(DataError) as refused:  # raised in a worker of the pool, and carried back whole
        build([source], strict, BuildSettings(256, False, 0, "fail"), folder, print, lambda _: None, workers=2)
    assert str(refused.value).startswith(f"{path}:row 2: the chat template (auto: the tokenizer's own (sha256 ")
    assert "does not render this row: TemplateError: no system role" in str(refused.value)
    assert "set data.template" in refused.value.fix
