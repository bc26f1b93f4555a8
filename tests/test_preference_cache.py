"""A preference stage's rows in the node's data cache (issue 44): built once per node, mapped by every rank.

Real files and processes: the builder's pool of 2 forked workers, two rank processes of one
launch (local rank 0 builds, local rank 1 waits and maps), the byte-level tokenizer, the fixtures
written in LLaMA-Factory's dpo_en_demo and kto_en_demo layouts. No training launch: what the
ranks hand TRL is a ``datasets.Dataset`` mapped from the cache, checked here against what
``encode.py`` makes in memory (tests/test_preference_train.py trains on it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from datasets.table import MemoryMappedTable
from tinyjob import tiny_job_with_data

from orchestrator.observe.lines import eval_text
from orchestrator.train.data import cache
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer
from orchestrator.train.preference import encode, stage
from orchestrator.train.progress import ProgressLog, read_events

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "preference"
STAGES = {"dpo": ("dpo_en_demo.json", "sharegpt"), "kto": ("kto_en_demo.json", "messages")}


class _Ranks:
    def __init__(self, local_rank: int = 0) -> None:
        self.rank = self.local_rank = local_rank
        self.world_size = 2


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_level_tokenizer()


_job = tiny_job_with_data


def _stage_job(folder: Path, stage_name: str, *sets: str, path: Path | None = None):
    name, fmt = STAGES[stage_name]
    return _job(folder, {"path": str(path or FIXTURES / name), "format": fmt}, f"train.stage={stage_name}", *sets)


def _load(loaded, tokenizer, output: Path, said: list[str] | None = None, monkeypatch=None):
    if said is not None and monkeypatch is not None:
        monkeypatch.setattr(stage, "say", lambda ranks, text: said.append(text))
    return stage.load_data(loaded, tokenizer, _Ranks(), output)


@pytest.mark.parametrize("stage_name", ["dpo", "kto"])
def test_mapped_examples_are_the_in_memory_ones_id_for_id(tmp_path, tokenizer, stage_name):
    loaded = _stage_job(tmp_path, stage_name, "data.eval_split=0.25", "train.max_seq_len=96")
    train, held = _load(loaded, tokenizer, tmp_path / "out")
    want_train, want_held = encode.split(encode.encode_job(loaded, tokenizer), 0.25)
    assert train.to_list() == want_train and held.to_list() == want_held
    assert len(held) == round(0.25 * (len(want_train) + len(want_held)))
    # Mapped, not loaded: the table is the cache file's memory map, in the node's cache folder.
    assert isinstance(train.data, MemoryMappedTable) and isinstance(held.data, MemoryMappedTable)
    assert Path(train.cache_files[0]["filename"]).parent.parent == tmp_path / "out" / "data-cache"


def test_data_eval_is_a_cache_of_its_own_sources(tmp_path, tokenizer):
    name, fmt = STAGES["dpo"]
    other = FIXTURES / "trl_conversational.jsonl"
    loaded = _job(
        tmp_path,
        {"path": str(FIXTURES / name), "format": fmt, "eval": {"path": str(other), "format": "messages"}},
        "train.stage=dpo",
    )
    train, held = _load(loaded, tokenizer, tmp_path / "out")
    assert train.to_list() == encode.encode_job(loaded, tokenizer).examples
    assert held.to_list() == encode.encode_job(loaded, tokenizer, "eval").examples


def test_eval_split_holds_out_the_same_rows_whatever_the_files_order(tmp_path, tokenizer):
    name, _ = STAGES["dpo"]
    rows = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    reversed_file = tmp_path / "reversed.json"
    reversed_file.write_text(json.dumps(rows[::-1]), encoding="utf-8")
    _, held = _load(_stage_job(tmp_path / "a", "dpo", "data.eval_split=5"), tokenizer, tmp_path / "a" / "out")
    loaded = _stage_job(tmp_path / "b", "dpo", "data.eval_split=5", path=reversed_file)
    _, held_reversed = _load(loaded, tokenizer, tmp_path / "b" / "out")
    key = lambda e: json.dumps(e)  # noqa: E731
    assert len(held) == 5 and sorted(map(key, held.to_list())) == sorted(map(key, held_reversed.to_list()))


RANK = """
import json, sys
from pathlib import Path
from orchestrator.spec.job import load_job
from orchestrator.train.preference import cache as cached
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer
from orchestrator.train.preference import stage

builds = []
real = cached.build
cached.build = lambda *a, **k: builds.append(1) or real(*a, **k)
local_rank = int(sys.argv[3])
ranks = type("Ranks", (), {"rank": local_rank, "local_rank": local_rank, "world_size": 2})()
loaded = load_job(Path(sys.argv[1]), json.loads(sys.argv[4]))
train, held = stage.load_data(loaded, build_byte_level_tokenizer(), ranks, Path(sys.argv[2]))
print(json.dumps({"builds": len(builds), "file": train.cache_files[0]["filename"], "rows": train.to_list()}))
"""


def _ranks(loaded, output: Path, local_ranks: list[int]) -> list[dict]:
    """Rank processes of one launch (children of this process: one launch token), each's report."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(loaded.path), str(output), str(rank), json.dumps(loaded.overrides)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in local_ranks
    ]
    out = []
    for process in started:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_built_once_per_node_the_other_rank_maps_it(tmp_path, tokenizer):
    loaded = _stage_job(tmp_path, "dpo")
    waiter, builder = _ranks(loaded, tmp_path / "out", [1, 0])
    assert (builder["builds"], waiter["builds"]) == (1, 0)
    assert waiter["file"] == builder["file"] and waiter["rows"] == builder["rows"]
    assert waiter["rows"] == encode.encode_job(loaded, tokenizer).examples


def test_a_changed_stage_or_max_seq_len_is_another_cache(tmp_path, tokenizer, monkeypatch):
    said: list[str] = []
    out = tmp_path / "out"
    first = _load(_stage_job(tmp_path, "dpo"), tokenizer, out, said, monkeypatch)[0]
    _load(_stage_job(tmp_path, "dpo"), tokenizer, out, said, monkeypatch)
    shorter = _load(_stage_job(tmp_path, "dpo", "train.max_seq_len=64"), tokenizer, out, said, monkeypatch)[0]
    # The relaunch with the same inputs mapped the first cache: two builds for three launches.
    assert sum(line.startswith("data: building cache") for line in said) == 2
    assert sum(line.startswith("data: cached: mapped") for line in said) == 1
    assert first.cache_files[0]["filename"] != shorter.cache_files[0]["filename"]
    assert max(len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in shorter.to_list()) <= 64

    # The same file read for another stage: the stage is in the key (a KTO cache never answers a DPO launch).
    from orchestrator.train.preference import cache as cached

    def key(stage_name: str) -> str:
        loaded = _stage_job(tmp_path / stage_name, stage_name, path=FIXTURES / STAGES["dpo"][0])
        found = cached.sources.resolve_sources(loaded)
        return cache.cache_key(cached.key_material(loaded, found, tokenizer, tmp_path / "keys", None))

    assert key("dpo") != key("kto")


def test_a_preference_eval_event_counts_its_pairs_and_tokens(tmp_path, tokenizer):
    from orchestrator.train.run import ProgressCallback

    loaded = _stage_job(tmp_path, "dpo", "data.eval_split=4")
    _, held = _load(loaded, tokenizer, tmp_path / "out")
    _, want = encode.split(encode.encode_job(loaded, tokenizer), 4)
    tokens = sum(len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in want)
    assert stage.eval_fields(held, "dpo") == {"eval_rows": 4, "eval_unit": "pairs", "eval_tokens": tokens}

    log = ProgressLog(tmp_path / "progress.jsonl", echo=False)
    callback = ProgressCallback(log, _Ranks(), save=False, lineage="l")
    callback.preference, callback.preference_eval = True, stage.eval_fields(held, "dpo")
    state = type("State", (), {"global_step": 4, "max_steps": 10, "epoch": 1.0})()
    callback.on_log(None, state, None, logs={"eval_loss": 0.6931, "eval_rewards/accuracies": 0.5})
    (event,) = [e for e in read_events(log.path) if e["event"] == "eval"]
    assert eval_text(event) == f"eval  step 4/10  eval loss 0.6931 over 4 pairs ({tokens:,} tokens)"


@pytest.mark.parametrize("stage_name", ["dpo", "kto"])
def test_columns_no_reader_reads_are_named_in_the_data_line(tmp_path, tokenizer, monkeypatch, stage_name):
    """A preference row's extra columns (an id, a score) are named, never dropped silently; the ones read
    (the prompt's, the answers', KTO's label) are not."""
    name, _ = STAGES[stage_name]
    rows = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    with_extra = tmp_path / name
    with_extra.write_text(json.dumps([{**r, "id": i, "score": 0.5} for i, r in enumerate(rows)]), encoding="utf-8")
    said: list[str] = []
    _load(_stage_job(tmp_path, stage_name, path=with_extra), tokenizer, tmp_path / "out", said, monkeypatch)
    (line,) = [text for text in said if text.startswith(f"data ({stage_name})")]
    assert line.endswith(f"; ignored in {with_extra}: id, score"), line
    said.clear()
    _load(_stage_job(tmp_path / "plain", stage_name), tokenizer, tmp_path / "plain" / "out", said, monkeypatch)
    assert not any("ignored" in text for text in said), said
