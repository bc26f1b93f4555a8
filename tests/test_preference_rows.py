"""Preference and KTO rows (issue 44): the spec's stage keys, the layouts read, and SFT's refusal of them.

Cheap (no torch): the controller's data check (``read_inputs``, before any host is touched) and
the pure row readers of ``planning/preference/rows.py``. The fixtures in tests/fixtures/preference/
are written for these tests in LLaMA-Factory's dpo_en_demo / kto_en_demo layouts, TRL's
conversational layout and LLaMA-Factory's alpaca ranking layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tinyjob import tiny_job_with_data

from orchestrator.errors import InputError
from orchestrator.planning.datarows import DataError
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.preference.rows import to_kto, to_preference
from orchestrator.spec.job import load_job

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "tiny-cpu.yaml"
FIXTURES = ROOT / "tests" / "fixtures" / "preference"
DPO_DEMO = FIXTURES / "dpo_en_demo.json"
KTO_DEMO = FIXTURES / "kto_en_demo.json"


def _job(tmp_path: Path, data: dict, *sets: str):
    """The tiny job with ``data``; its file copied beside the job (a shipped file: checked on the controller)."""
    source = Path(data["path"])
    if source.is_absolute():
        (tmp_path / source.name).write_bytes(source.read_bytes())
        data = {**data, "path": source.name}
    return tiny_job_with_data(tmp_path, data, *sets)


# --- never trained silently wrong -------------------------------------------------------------------


def test_kto_rows_are_refused_under_sft_naming_the_label_and_the_stage(tmp_path):
    # Before issue 44 these rows trained as SFT, their bad answers (label false) as targets.
    with pytest.raises(InputError) as refused:
        read_inputs(_job(tmp_path, {"path": str(KTO_DEMO), "format": "messages"}))
    assert "kto_en_demo.json:row 1: column 'label' holds a KTO label" in refused.value.message
    assert "train.stage is sft" in refused.value.message
    assert refused.value.fix.startswith("set train.stage: kto")


def test_kto_rows_are_refused_under_sft_even_when_bad_rows_are_skipped(tmp_path):
    with pytest.raises(InputError) as refused:
        read_inputs(_job(tmp_path, {"path": str(KTO_DEMO), "format": "messages", "on_error": "skip"}))
    assert "'label'" in refused.value.message and "train.stage: kto" in refused.value.fix


def test_ranking_rows_are_refused_under_sft_naming_chosen_and_dpo(tmp_path):
    with pytest.raises(InputError) as refused:
        read_inputs(_job(tmp_path, {"path": str(DPO_DEMO), "format": "sharegpt"}))
    assert "dpo_en_demo.json:row 1: column 'chosen' holds a chosen/rejected pair" in refused.value.message
    assert refused.value.fix.startswith("set train.stage: dpo")


def test_the_demo_files_pass_the_check_under_their_stage(tmp_path):
    read_inputs(_job(tmp_path, {"path": str(DPO_DEMO), "format": "sharegpt"}, "train.stage=dpo"))
    read_inputs(_job(tmp_path, {"path": str(KTO_DEMO), "format": "messages"}, "train.stage=kto"))


def test_sft_rows_under_stage_dpo_are_refused_naming_what_is_missing(tmp_path):
    sample = ROOT / "jobs" / "data" / "tiny-alpaca-zh.jsonl"
    with pytest.raises(InputError) as refused:
        read_inputs(_job(tmp_path, {"path": str(sample)}, "train.stage=dpo"))
    assert "missing 'chosen' and 'rejected': train.stage: dpo trains on a chosen and a rejected" in (
        refused.value.message
    )


# --- the stage's keys ---------------------------------------------------------------------------------


def test_stage_keys_default_to_llama_factorys():
    train = load_job(JOB, ["train.stage=dpo"]).spec.train
    assert (train.stage, train.pref_loss, train.pref_beta, train.pref_ftx, train.simpo_gamma) == (
        "dpo",
        "sigmoid",
        0.1,
        0.0,
        0.5,
    )
    assert (train.kto_chosen_weight, train.kto_rejected_weight) == (1.0, 1.0)
    assert load_job(JOB).spec.train.stage == "sft"


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (
            ["train.stage=kto", "train.pref_loss=orpo"],
            "train.pref_loss is read by train.stage: dpo; this job's stage is kto",
        ),
        (["train.pref_beta=0.2"], "train.pref_beta is read by train.stage: dpo or kto; this job's stage is sft"),
        (["train.stage=dpo", "train.kto_chosen_weight=2"], "train.kto_chosen_weight is read by train.stage: kto"),
        (
            ["train.stage=dpo", "train.simpo_gamma=1"],
            "train.simpo_gamma is read by pref_loss: simpo; this job's is sigmoid",
        ),
        (
            ["train.stage=dpo", "train.pref_loss=orpo", "train.pref_ftx=0.5"],
            "pref_loss: orpo's loss holds its SFT term",
        ),
        (["train.stage=ppo"], "train.stage"),
    ],
)
def test_a_key_of_another_stage_is_refused_at_its_set(sets, words):
    with pytest.raises(InputError) as refused:
        load_job(JOB, sets)
    assert words in str(refused.value)
    assert "--set" in str(refused.value)  # located where the user wrote it


# --- the layouts ----------------------------------------------------------------------------------


def test_sharegpt_ranking_rows_read_as_prompt_and_two_answers():
    row = json.loads(DPO_DEMO.read_text())[0]
    read = to_preference(row, "sharegpt", "demo:row 1")
    assert read.prompt == (("user", "Tell me about tea (0)."),)
    assert read.chosen.content.startswith("Sure, glad to help") and read.rejected.content == "No. tea bores me."


def test_trl_conversational_rows_keep_their_system_turn():
    row = json.loads((FIXTURES / "trl_conversational.jsonl").read_text().splitlines()[0])
    read = to_preference(row, "messages", "trl:row 1")
    assert read.prompt == (("system", "Be kind."), ("user", "And tea?"))
    assert (read.chosen.content, read.rejected.content) == ("Gladly: tea is lovely.", "No. Not tea.")


def test_alpaca_ranking_rows_read_their_texts():
    row = json.loads((FIXTURES / "alpaca_ranking.jsonl").read_text().splitlines()[0])
    read = to_preference(row, "alpaca", "a:row 1")
    assert read.prompt == (("user", "Describe tea."),)
    assert (read.chosen.content, read.rejected.content) == ("Sure: tea is fine.", "No. tea.")


def test_kto_rows_read_the_last_turn_and_its_label():
    rows = json.loads(KTO_DEMO.read_text())
    good, bad = to_kto(rows[0], "messages", "k:row 1"), to_kto(rows[1], "messages", "k:row 2")
    assert (good.label, bad.label) == (True, False)
    assert (
        bad.prompt == (("user", "Tell me about tea (0). Briefly."),) and bad.completion.content == "No. tea bores me."
    )
    trl_row = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}
    assert to_kto({**trl_row, "label": False}, "messages", "t:row 1").completion.content == "a"
    alpaca = {"instruction": "q", "output": "a", "kto_tag": True}
    assert to_kto(alpaca, "alpaca", "al:row 1").label is True


def test_a_kto_row_without_a_boolean_label_is_named():
    with pytest.raises(DataError) as refused:
        to_kto(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "label": "yes"},
            "messages",
            "k:row 3",
        )
    assert "k:row 3: 'label' must be true or false" in refused.value.message


def test_a_ranking_row_whose_prompt_ends_with_an_answer_is_named():
    row = {
        "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
        "chosen": {"from": "gpt", "value": "b"},
        "rejected": {"from": "gpt", "value": "c"},
    }
    with pytest.raises(DataError) as refused:
        to_preference(row, "sharegpt", "s:row 4")
    assert "s:row 4: the prompt must end with the user's turn" in refused.value.message


# --- rendered as SFT renders them ---------------------------------------------------------------------


@pytest.mark.parametrize("template", ["plain", "chatml"])
def test_a_pair_is_tokenized_as_sft_trains_each_answer(template):
    """prompt + chosen (and prompt + rejected) are SFT's ids of that conversation; the answers its labelled ids."""
    from orchestrator.planning.chattemplate import BUILTIN_TEMPLATES, ChatTemplate
    from orchestrator.train.data.chat import IGNORE, make_renderer
    from orchestrator.train.data.conversations import Conversation, encode
    from orchestrator.train.data.tokenizer import build_byte_level_tokenizer
    from orchestrator.train.preference.encode import Encoded, encode_pair

    tokenizer = build_byte_level_tokenizer()
    renderer = make_renderer(tokenizer, ChatTemplate(template, BUILTIN_TEMPLATES[template]))
    row = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello."},
            {"from": "human", "value": "Tell me about tea."},
        ],
        "system": "Be kind.",
        "chosen": {"from": "gpt", "value": "Gladly: tea is lovely."},
        "rejected": {"from": "gpt", "value": "No."},
    }
    pair = to_preference(row, "sharegpt", "r:row 1")
    example = encode_pair(pair, tokenizer, renderer, 512, Encoded())
    for side, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        conversation = Conversation((*pair.prompt, ("assistant", answer.content)), "r:row 1", (None,) * 4 + (None,))
        ((ids, labels),), _ = encode(conversation, tokenizer, 512, renderer)
        assert example["prompt_ids"] + example[f"{side}_ids"] == ids
        # The answer's tokens are the last labelled run of SFT's example (the history's answer is labelled too).
        first = len(example["prompt_ids"])
        assert all(label != IGNORE for label in labels[first:]) and labels[first - 1] == IGNORE
