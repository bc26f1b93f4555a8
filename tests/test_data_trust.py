"""What the data path promises, held to it (issue 41, items 1, 2, 4, 7, 11 and 20).

Real files, the real builder (one worker: the same encoding as the pool's) and the byte-level
tokenizer throughout; the preflight check runs its real shell script on this machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_data_cache import SAMPLE, _job, _prepare

from orchestrator.errors import InputError
from orchestrator.planning import datafiles
from orchestrator.planning.chattemplate import ChatTemplate
from orchestrator.planning.datarows import DataError
from orchestrator.planning.inputs import read_inputs
from orchestrator.preflight.datacheck import check_data
from orchestrator.train.data import cache
from orchestrator.train.data.build import BuildSettings, build
from orchestrator.train.data.sources import resolve_sources
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer
from orchestrator.train.datasets import data_summary
from orchestrator.transport.local import LocalConnection


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_level_tokenizer()


def _lines(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _build(tmp_path: Path, tokenizer, data: dict, settings: BuildSettings, *sets: str):
    folder = tmp_path / "built"
    folder.mkdir()
    found = resolve_sources(_job(tmp_path, data, *sets))
    return build(found, tokenizer, settings, folder, lambda _: None, lambda _: None, workers=1)


# --- item 1: a rewrite that keeps size and mtime ---------------------------------------------------


def test_a_rewrite_with_the_same_size_and_mtime_builds_anew(tmp_path, tokenizer):
    path = _lines(tmp_path / "d.jsonl", [{"instruction": "q", "output": "OLD"}])
    loaded = _job(tmp_path, {"path": str(path)})
    first = _prepare(loaded, tokenizer, tmp_path)
    stat = path.stat()
    _lines(path, [{"instruction": "q", "output": "NEW"}])  # cp -p, rsync -t, tar x: same size, mtime kept
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    again = _prepare(loaded, tokenizer, tmp_path)
    assert not again.cached and again.key != first.key
    assert "NEW" in tokenizer.decode(again.data.item(0)["input_ids"])


def test_an_unchanged_file_is_not_read_again_once_its_stat_is_settled(tmp_path, tokenizer, monkeypatch):
    """The stat shortcut stays: a file last changed more than RACY_S before its hash is not hashed again."""
    path = _lines(tmp_path / "d.jsonl", [{"instruction": "q", "output": "a"}])
    prints = cache.Fingerprints(tmp_path)
    digest = prints.of(path)
    entry = prints.known[str(path.resolve())]
    entry[4] += cache.RACY_S + 1  # as if hashed a while after the file's last change
    read: list[Path] = []
    monkeypatch.setattr(cache, "file_hash", lambda p: read.append(p) or "rehashed")
    assert prints.of(path) == digest and read == []
    entry[4] -= cache.RACY_S + 1  # hashed within a clock tick of the change: not trusted
    assert prints.of(path) == "rehashed" and read == [path]


# --- item 2: data.eval_split counts rows ------------------------------------------------------------

# Earlier assistant turns rendered as "...": every turn starts an example of its own (as Qwen3's does).
REWRITING = (
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}assistant: ...\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_eval_split_holds_out_n_rows_whatever_the_examples_per_row(tmp_path, tokenizer):
    rows = [
        {"messages": [{"role": r, "content": f"{r} {t} of row {i}"} for t in range(4) for r in ("user", "assistant")]}
        for i in range(20)
    ]
    data = _lines(tmp_path / "chats.jsonl", rows)
    settings = BuildSettings(256, False, 42, "fail", eval_split=10, template=ChatTemplate("rewrite.jinja", REWRITING))
    result = _build(tmp_path, tokenizer, {"path": str(data), "format": "messages"}, settings)
    assert result.info["sources"][0]["split_rows"] == 20 and result.info["examples"] == 80
    assert result.info["eval_examples"] == 40, "10 rows of 4 examples each are held out"
    assert result.info["eval_rows_held"] == 10 and result.info["train_rows"] == 10


# --- item 4: a lone UTF-16 surrogate ---------------------------------------------------------------


def _rows_with_a_surrogate(tmp_path: Path) -> Path:
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(260)]
    path = _lines(tmp_path / "surrogate.jsonl", rows)
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[250] = '{"instruction": "q250", "output": "broken \\ud800 text"}'  # valid JSON, not UTF-8 text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_lone_surrogate_is_a_skipped_row_under_on_error_skip(tmp_path, tokenizer):
    path = _rows_with_a_surrogate(tmp_path)
    result = _build(tmp_path, tokenizer, {"path": str(path)}, BuildSettings(64, False, 42, "skip"))
    [source] = result.info["sources"]
    assert source["skipped"] == 1 and source["examples"] == 259
    assert result.skipped_lines == [
        f"{path}:row 251: 'output' holds a lone UTF-16 surrogate \\ud800 at character 8: not text a tokenizer can read"
    ]


def test_a_lone_surrogate_fails_naming_the_file_and_row(tmp_path, tokenizer):
    path = _rows_with_a_surrogate(tmp_path)
    with pytest.raises(DataError, match=rf"{path}:row 251: 'output' holds a lone UTF-16 surrogate") as failed:
        _build(tmp_path, tokenizer, {"path": str(path)}, BuildSettings(64, False, 42, "fail"))
    assert failed.value.exit_code == 2 and "on_error: skip" in failed.value.fix


# --- item 7: an empty source in a mix, and preflight's "not empty" ---------------------------------


def test_a_mix_with_an_empty_source_names_that_source(tmp_path, tokenizer):
    big = _lines(tmp_path / "big.jsonl", [{"instruction": f"q{i}", "output": "a"} for i in range(100)])
    empty = tmp_path / "empty.json"
    empty.write_text("[]", encoding="utf-8")
    data = {"sources": [{"path": str(big)}, {"path": str(empty)}]}
    with pytest.raises(DataError) as failed:
        _build(tmp_path, tokenizer, data, BuildSettings(64, False, 42, "fail"))
    assert failed.value.message.startswith(f"{empty}: no rows (data.sources[1], in a mix of 2 sources"), failed.value
    assert str(big) not in failed.value.message


@pytest.mark.parametrize("content", ["[]", " [ ]\n", "\n\n"])
def test_preflight_finds_no_rows_in_an_empty_array_or_blank_lines(tmp_path, content):
    empty = tmp_path / "empty.json"
    empty.write_text(content, encoding="utf-8")
    loaded = _job(tmp_path, {"path": str(empty)}, "runtime=process")
    [check] = check_data(LocalConnection(), SimpleNamespace(spec=loaded.spec, python="python3"))
    assert check.status == "fail" and f"data.path {empty} has no rows on localhost" in check.detail, check
    good_job = _job(tmp_path, {"path": str(SAMPLE)}, "runtime=process")
    [good] = check_data(LocalConnection(), SimpleNamespace(spec=good_job.spec, python="python3"))
    assert good.status == "ok", good


# --- item 11: turns cut away by max_seq_len ---------------------------------------------------------


def test_the_summary_counts_turns_that_max_seq_len_cut_away(tmp_path, tokenizer):
    turns = [("user", "short"), ("assistant", "kept"), ("user", "x" * 200), ("assistant", "cut away")]
    row = {"messages": [{"role": r, "content": c} for r, c in turns]}
    data = _lines(tmp_path / "chats.jsonl", [row])
    result = _build(
        tmp_path, tokenizer, {"path": str(data), "format": "messages"}, BuildSettings(64, False, 42, "fail")
    )
    [source] = result.info["sources"]
    assert source["examples"] == 1 and source["truncated_away"] == 0  # the example stays, for its first turn
    [line] = data_summary({**result.info, "skipped_lines": []}, 64, False)
    assert "1 assistant turns left out of the loss (1 past max_seq_len 64)" in line, line


# --- item 20: data-file errors ----------------------------------------------------------------------


def test_a_csv_file_is_named_as_a_format_dzctl_does_not_read(tmp_path):
    table = tmp_path / "rows.csv"
    table.write_text("instruction,output\nq,a\n", encoding="utf-8")
    with pytest.raises(InputError) as refused:
        read_inputs(_job(tmp_path, {"path": "rows.csv"}))
    message = refused.value.message
    assert "rows.csv: a CSV file: CSV is not a data format dzctl reads; it reads a JSON array (.json)" in message
    assert "not valid JSON" not in message and "data.format" not in refused.value.fix
    assert "to_json('data.jsonl', orient='records', lines=True" in refused.value.fix


def test_a_truncated_json_line_is_reported_at_its_own_column(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text('{"instruction": "q", "output": "a"}\n{"instruction": "a", "output": "b"\n', encoding="utf-8")
    (_, first), (where, second) = datafiles.iter_rows(path)
    assert first == {"instruction": "q", "output": "a"} and where == f"{path}:row 2"
    assert second.reason == "not valid JSON: Expecting ',' delimiter (column 35: the row ends there, cut short?)"
