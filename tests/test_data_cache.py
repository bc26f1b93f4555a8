"""The per-node data cache: the same rows as today's path, every source and format, the mix, the checks.

Real files throughout: Parquet written by pyarrow, a ``datasets.save_to_disk`` folder, a
hub ID from an offline Hugging Face cache (made the way ``load_dataset`` leaves it), JSON
arrays and lines. The builder runs with its worker pool (2 processes) as on a node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reference_data import reference_rows
from tinyjob import tiny_job_with_data

from orchestrator.errors import InputError, RuntimeFailure
from orchestrator.planning import datafiles
from orchestrator.planning.datarows import DataError
from orchestrator.planning.inputs import read_inputs
from orchestrator.spec.job import load_job
from orchestrator.train.data import cache, prepare
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "jobs" / "data" / "tiny-alpaca-zh.jsonl"
JOB = ROOT / "jobs" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_level_tokenizer()


_job = tiny_job_with_data


def _prepare(loaded, tokenizer, tmp_path: Path, packing: bool = False, local_rank: int = 0, said=None):
    return prepare.prepare(
        loaded,
        tokenizer,
        packing=packing,
        local_rank=local_rank,
        cache_dir=tmp_path / "cache",
        say=(said.append if said is not None else lambda _: None),
    )


def _rows(prepared) -> list[dict]:
    return [prepared.data.item(i) for i in range(prepared.data.rows)]


def _long_rows(path: Path, count: int = 300) -> Path:
    # Lengths from a few tokens to past max_seq_len: some rows truncate, some are cut away entirely.
    rows = []
    for i in range(count):
        prompt = "问" * (i % 37) + f"question {i}"
        answer = ("答" * (i % 53)) + f" answer {i}"
        rows.append({"instruction": prompt if i % 11 else "长" * 60, "input": "x" * (i % 5), "output": answer})
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("source", ["sample", "long"])
def test_same_rows_as_todays_path(tmp_path, tokenizer, packed, source):
    """Every id, label and example boundary equals the in-memory path's (the reference)."""
    path = SAMPLE if source == "sample" else _long_rows(tmp_path / "long.json")
    loaded = _job(tmp_path, {"path": str(path)}, "train.max_seq_len=128")
    got = _rows(_prepare(loaded, tokenizer, tmp_path, packing=packed))
    want = reference_rows(path, "alpaca", "fail", tokenizer, 128, packed, loaded.spec.train.seed)
    assert len(got) == len(want)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine == theirs, f"row {index} differs"


def test_relaunch_maps_the_cache_and_a_change_builds_anew(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(SAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    loaded = _job(tmp_path, {"path": str(path)})
    first = _prepare(loaded, tokenizer, tmp_path)
    said: list[str] = []
    again = _prepare(loaded, tokenizer, tmp_path, said=said)
    assert not first.cached and again.cached and again.key == first.key
    assert any(line.startswith("data: cached: mapped 72 examples") for line in said), said
    # Same bytes, new mtime (a re-shipped copy): the content hash finds the same key.
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert _prepare(loaded, tokenizer, tmp_path).key == first.key
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps({"instruction": "新", "output": "行"}, ensure_ascii=False) + "\n")
    changed = _prepare(loaded, tokenizer, tmp_path)
    assert not changed.cached and changed.key != first.key and changed.data.examples == 73
    # Other settings are part of the key too.
    assert _prepare(loaded, tokenizer, tmp_path, packing=True).key != changed.key
    other = _job(tmp_path, {"path": str(path)}, "train.max_seq_len=64")
    assert _prepare(other, tokenizer, tmp_path).key != changed.key


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_cache_is_rebuilt_never_used(tmp_path, tokenizer, damage):
    loaded = _job(tmp_path, {"path": str(SAMPLE)})
    first = _prepare(loaded, tokenizer, tmp_path, packing=True)
    want = _rows(first)
    tokens = first.folder / "tokens.bin"
    raw = bytearray(tokens.read_bytes())
    if damage == "truncate":
        tokens.write_bytes(raw[: len(raw) // 2])
    else:
        raw[len(raw) // 2] ^= 0x01  # same size: only the hash tells
        tokens.write_bytes(raw)
    said: list[str] = []
    again = _prepare(loaded, tokenizer, tmp_path, packing=True, said=said)
    reason = "truncated" if damage == "truncate" else "does not match its hash"
    assert any("failed its check" in line and reason in line for line in said), said
    assert not again.cached and _rows(again) == want


def test_other_ranks_wait_for_the_builder_and_map_its_cache(tmp_path, tokenizer):
    loaded = _job(tmp_path, {"path": str(SAMPLE)})
    results: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: results.update(w=_prepare(loaded, tokenizer, tmp_path, local_rank=1)))
    waiter.start()
    time.sleep(0.5)  # the waiter is polling before the builder starts
    built = _prepare(loaded, tokenizer, tmp_path)
    waiter.join(timeout=60)
    assert results["w"].key == built.key and _rows(results["w"]) == _rows(built)


def test_a_failed_builder_fails_the_waiting_ranks_with_its_reason(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n', encoding="utf-8")
    loaded = _job(tmp_path, {"path": str(bad)})
    with pytest.raises(DataError, match="row 2: missing key 'output'"):
        _prepare(loaded, tokenizer, tmp_path)
    with pytest.raises(DataError, match=r"data builder \(local rank 0\) failed: .*row 2: missing key 'output'"):
        _prepare(loaded, tokenizer, tmp_path, local_rank=1)


def test_waiting_is_bounded(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("DZCTL_DATA_WAIT_S", "1")
    loaded = _job(tmp_path, {"path": str(SAMPLE)})
    started = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"waited 1 s for this node's data builder .*not written"):
        _prepare(loaded, tokenizer, tmp_path, local_rank=1)
    assert time.monotonic() - started < 10


def test_broken_row_names_the_users_file_not_the_nodes_copy(tmp_path, tokenizer):
    copy = tmp_path / "node" / "jobs" / "j1" / "data" / "train.jsonl"
    copy.parent.mkdir(parents=True)
    copy.write_text('{"instruction": "a", "output": "b"}\n{"instruction": 3, "output": "o"}\n', encoding="utf-8")
    loaded = _job(tmp_path, {"path": str(copy), "shipped_from": "data/train.jsonl"})
    with pytest.raises(DataError) as err:
        _prepare(loaded, tokenizer, tmp_path)
    assert str(err.value) == "data/train.jsonl:row 2: 'instruction' must be text, got int"


def _conversation_rows():
    return [
        {
            "conversations": [
                {"from": "system", "value": "简短回答。"},
                {"from": "human", "value": f"{i}+1?"},
                {"from": "gpt", "value": f"{i + 1}"},
            ]
        }
        for i in range(6)
    ]


def test_sharegpt_file(tmp_path, tokenizer):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _conversation_rows()), "utf-8")
    loaded = _job(tmp_path, {"path": str(path), "format": "sharegpt"})
    prepared = _prepare(loaded, tokenizer, tmp_path)
    ids = prepared.data.item(2)["input_ids"]
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\n简短回答。<|im_end|>\n<|im_start|>user\n2+1?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    )
    labels = prepared.data.item(2)["labels"]
    assert tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != -100]) == "3<|im_end|>\n"


def test_alpaca_system_and_history(tmp_path, tokenizer):
    row = {"system": "你是助手。", "history": [["你好", "你好！"]], "instruction": "再见", "output": "再见！"}
    path = tmp_path / "a.json"
    path.write_text(json.dumps([row], ensure_ascii=False), encoding="utf-8")
    prepared = _prepare(_job(tmp_path, {"path": str(path)}), tokenizer, tmp_path)
    item = prepared.data.item(0)
    assert tokenizer.decode(item["input_ids"]).startswith(
        "<|im_start|>system\n你是助手。<|im_end|>\n<|im_start|>user\n你好"
    )
    trained = tokenizer.decode([t for t, lab in zip(item["input_ids"], item["labels"], strict=True) if lab != -100])
    assert trained == "你好！<|im_end|>\n再见！<|im_end|>\n"  # both assistant turns learn


def test_parquet_with_a_column_map(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": [f"题{i}" for i in range(40)], "completion": [f"解{i}" for i in range(40)]})
    path = tmp_path / "train.parquet"
    pq.write_table(table, path, row_group_size=16)
    loaded = _job(tmp_path, {"path": str(path), "columns": {"instruction": "prompt", "output": "completion"}})
    prepared = _prepare(loaded, tokenizer, tmp_path)
    assert prepared.data.examples == 40
    assert "题39" in tokenizer.decode(prepared.data.item(39)["input_ids"])
    missing = _job(tmp_path, {"path": str(path), "columns": {"instruction": "question"}})
    with pytest.raises(DataError, match=r"train.parquet:row 1: missing key 'question' \(data.columns: instruction\)"):
        _prepare(missing, tokenizer, tmp_path)


def test_save_to_disk_folder(tmp_path, tokenizer):
    import datasets

    rows = {"instruction": [f"q{i}" for i in range(25)], "output": [f"a{i}" for i in range(25)]}
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    prepared = _prepare(_job(tmp_path, {"path": str(folder)}), tokenizer, tmp_path)
    assert prepared.data.examples == 25 and "a24" in tokenizer.decode(prepared.data.item(24)["input_ids"])
    again = _prepare(_job(tmp_path, {"path": str(folder)}), tokenizer, tmp_path)
    assert again.cached


HUB_SCRIPT = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
home = Path(os.environ["HF_HOME"])
# The cache as datasets.load_dataset("acme/tiny-sft") leaves it: <cache>/acme___tiny-sft/default/0.0.0/<hash>/
rows = home / "train.jsonl"
rows.write_text("".join(json.dumps({{"instruction": f"q{{i}}", "output": f"a{{i}}"}}) + "\\n" for i in range(12)))
import datasets
from datasets.packaged_modules.json.json import Json
builder = Json(dataset_name="tiny-sft", data_files={{"train": str(rows)}}, hash="0123abcd")
builder.download_and_prepare()
root = Path(datasets.config.HF_DATASETS_CACHE)
(root / "acme___tiny-sft").mkdir()
os.rename(Path(builder.cache_dir).parent.parent, root / "acme___tiny-sft" / "default")
"""

HUB_READ = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from orchestrator.spec.job import load_job
from orchestrator.train.data import prepare
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer
loaded = load_job({job!r})
out = prepare.prepare(loaded, build_byte_level_tokenizer(), packing=False, local_rank=0,
                      cache_dir=Path({cache!r}), say=print)
print("EXAMPLES", out.data.examples, out.cached)
"""


def test_hub_id_from_an_offline_cache(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    (tmp_path / "hf").mkdir()
    made = subprocess.run([sys.executable, "-c", HUB_SCRIPT.format(root=str(ROOT))], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    _job(tmp_path, {"path": "hf:acme/tiny-sft:train"})
    read = HUB_READ.format(root=str(ROOT), job=str(tmp_path / "job.yaml"), cache=str(tmp_path / "cache"))
    for cached in ("False", "True"):
        done = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"EXAMPLES 12 {cached}" in done.stdout, done.stdout
    _job(tmp_path, {"path": "hf:acme/absent"})
    done = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "hf:acme/absent: cannot load acme/absent split 'train' from the Hugging Face datasets cache" in done.stderr


def test_mix_of_two_sources_with_weights_3_to_1(tmp_path, tokenizer):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"instruction": f"a{i}", "output": "x"}) + "\n" for i in range(5000)), "utf-8")
    b = tmp_path / "b.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"conversations": [{"from": "human", "value": f"b{i}"}, {"from": "gpt", "value": "y"}]} for i in range(1200)
    ]
    pq.write_table(pa.Table.from_pylist(rows), b)
    data = {"sources": [{"path": str(a), "weight": 3}, {"path": str(b), "format": "sharegpt", "weight": 1}]}
    said: list[str] = []
    prepared = _prepare(_job(tmp_path, data), tokenizer, tmp_path, said=said)
    first, second = prepared.data.info["sources"]
    counts = [int((prepared.data.sources == i).sum()) for i in (0, 1)]
    assert counts == [first["examples"], second["examples"]]
    assert counts[0] / counts[1] == pytest.approx(3, rel=0.02)
    assert second["read"] == 1200 and first["available"] == 5000  # b runs out first
    from orchestrator.train.run import data_summary

    lines = data_summary(prepared.data.info, 128, False)
    assert lines[0].startswith(f"data source 1 ({a}): weight 3, 3,600 of 5,000 rows, 3,600 examples")
    assert lines[1].startswith(f"data source 2 ({b}): weight 1, 1,200 of 1,200 rows, 1,200 examples")
    again = _prepare(_job(tmp_path, data), tokenizer, tmp_path)
    assert again.cached and again.key == prepared.key  # deterministic: the same mix again


def test_json_array_streams_across_chunks_with_lines_in_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(datafiles, "CHUNK", 7)  # every row and number crosses a read boundary
    rows = [{"instruction": f"第{i}题", "n": 12345.678 + i, "output": "好" * i} for i in range(30)]
    path = tmp_path / "rows.json"
    path.write_text("\ufeff[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n", "utf-8")
    assert [row for _, row in datafiles.iter_rows(path)] == rows
    assert [where for where, _ in datafiles.iter_rows(path)][-1] == f"{path}:row 30"
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"instruction": "a", "output": "b"},\n{"instruction": "c" "output": "d"}\n]', "utf-8")
    with pytest.raises(DataError, match=r"broken.json:line 3: not valid JSON: Expecting ','"):
        list(datafiles.iter_rows(broken))
    with pytest.raises(DataError, match="expected a JSON array of rows, got a dict"):
        (tmp_path / "o.json").write_text('{"a": 1}', "utf-8")
        list(datafiles.iter_rows(tmp_path / "o.json"))


def test_format_mismatch_is_refused_by_launch_before_any_host(tmp_path):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _conversation_rows()), "utf-8")
    loaded = _job(tmp_path, {"path": "sharegpt.jsonl"})
    with pytest.raises(InputError) as err:
        read_inputs(loaded)
    lines = (tmp_path / "job.yaml").read_text(encoding="utf-8").splitlines()
    line = next(n for n, text in enumerate(lines, start=1) if text.startswith("data:"))
    assert str(err.value) == (
        f"{tmp_path / 'job.yaml'}:{line}: data.path: sharegpt.jsonl:row 1: missing key 'instruction'; "
        "the row has 'conversations': set data.format: sharegpt"
    )
    assert read_inputs(_job(tmp_path, {"path": "sharegpt.jsonl", "format": "sharegpt"})).shipped[0].local == path


def test_old_and_new_data_forms_load(tmp_path):
    old = _job(tmp_path, {"path": "data.jsonl", "format": "messages"}).spec.data
    assert [(s.path, s.format) for s in old.all_sources()] == [("data.jsonl", "messages")]
    new = _job(tmp_path, {"format": "sharegpt", "sources": [{"path": "a.jsonl"}, {"path": "hf:o/n", "weight": 2}]})
    assert [(s.path, s.format, s.weight) for s in new.spec.data.all_sources()] == [
        ("a.jsonl", "sharegpt", 1.0),
        ("hf:o/n", "sharegpt", 2.0),
    ]
    with pytest.raises(InputError, match=r"give data.path .* or data.sources .*, not both"):
        _job(tmp_path, {"path": "a.jsonl", "sources": [{"path": "b.jsonl"}]})
    # (``prompt`` is a field of messages now: TRL's conversational preference rows, issue 44)
    with pytest.raises(InputError, match="'question' is not a field of format messages"):
        _job(tmp_path, {"path": "a.jsonl", "format": "messages", "columns": {"question": "q"}})


def test_prune_keeps_the_three_most_recent_and_spares_recent_use(tmp_path):
    now = time.time()
    for number in range(5):
        folder = tmp_path / f"k{number}"
        folder.mkdir()
        (folder / cache.MANIFEST).write_text("{}", "utf-8")
        cache.touch_used(folder)
        age = (5 - number) * 7200 if number != 0 else 60  # k0 was used a minute ago
        os.utime(folder / cache.LAST_USED, (now - age, now - age))
    removed = cache.prune(tmp_path, current="k4", now=now)
    # Kept: k4 (current), k0 (used a minute ago), k3; k2 and k1 are older and unused for hours.
    assert sorted(removed) == ["k1", "k2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k0", "k3", "k4"]


def test_planner_counts_the_data_once_per_node_and_a_private_allowance_per_rank(tmp_path):
    from orchestrator.planning.memory.estimate import DATA_RANK_PRIVATE_GIB, GIB
    from orchestrator.planning.memory.fromjob import plan_for_job

    inputs = read_inputs(load_job(JOB))
    size = SAMPLE.stat().st_size
    assert inputs.shipped[0].size == size
    small, large = (plan_for_job(inputs, [slots], gpu_mem_gib=None, host_mem_gib=None)[0] for slots in (2, 8))
    once = dict(small.hardware.data_terms)
    assert once["data cache pages (page cache, once per node)"] == 2 * size
    assert small.estimate.host_terms_per_rank["data (mapped cache, private)"] == int(DATA_RANK_PRIVATE_GIB * GIB)
    # Per node: each rank's terms times the ranks, and the data's node terms once (not per rank).
    for plan, slots in ((small, 2), (large, 8)):
        per_rank = plan.estimate.host_per_rank + plan.estimate.gpu_peak  # CPU ranks hold their "GPU" terms too
        assert plan.host_per_node[0] == slots * per_rank + sum(once.values())
    assert set(small.to_dict(None)["breakdown"]["host_per_node_once"]) == set(once)


def test_a_data_cache_dir_is_mounted_into_each_nodes_container():
    from orchestrator.planning.launchplan import make_plan
    from orchestrator.spec.hostfile import Node

    job = load_job(ROOT / "jobs" / "qwen72b.yaml", ["data.cache_dir=/scratch/{host}/dzctl-data"])
    plan = make_plan(job.spec, [Node("gpu-a", (0, 1, 2, 3)), Node("gpu-b", (0, 1, 2, 3))], "j-1")
    for node in plan.nodes:
        volume = f"/scratch/{node.host}/dzctl-data:/scratch/{node.host}/dzctl-data:rw"
        assert volume in node.argv and node.argv[node.argv.index(volume) - 1] == "--volume"


def test_the_live_view_shows_the_builds_rate_and_eta_then_cached():
    import io

    from rich.console import Console

    from orchestrator.observe.view import render
    from orchestrator.observe.watchstate import JobWatch, NodeView

    def text(watch: JobWatch) -> str:
        console = Console(file=io.StringIO(), width=120, color_system=None)
        console.print(render(watch, now=20.0))
        return console.file.getvalue()

    watch = JobWatch("j", "j-1", [NodeView(0, "node0", 2)], started_at=0.0, accelerator="cpu")
    for second, rows in ((5.0, 12_000), (10.0, 25_000)):
        line = (
            f"[rank0]:dzctl-train: data: building: {rows:,} rows read (source 1 (train.json)), 2,500 rows/s, eta 6m00s"
        )
        watch.feed(0, line, second)
    assert "latest: dzctl-train: data: building: 25,000 rows read (source 1 (train.json)), 2,500 rows/s, eta 6m00s" in (
        text(watch)
    )
    watch.feed(0, "[rank0]:dzctl-train: data: cached: mapped 1,000,000 examples (700,000,000 tokens) in 2.1 s", 12.0)
    assert "latest: dzctl-train: data: cached: mapped 1,000,000 examples" in text(watch)


def test_on_error_skip_builds_from_the_good_rows_and_lists_the_bad(tmp_path, tokenizer):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\nnot json\n\n{"instruction": "c"}\n', encoding="utf-8")
    loaded = _job(tmp_path, {"path": str(path), "on_error": "skip"})
    prepared = _prepare(loaded, tokenizer, tmp_path)
    want = reference_rows(path, "alpaca", "skip", tokenizer, loaded.spec.train.max_seq_len, False, 0)
    assert _rows(prepared) == want and len(want) == 1
    from orchestrator.train.run import data_summary

    lines = data_summary(prepared.data.info, loaded.spec.train.max_seq_len, False)
    assert lines[:2] == [
        f"skipped row: {path}:row 2: not valid JSON: Expecting value (column 1)",
        f"skipped row: {path}:row 4: missing key 'output'",
    ]
    assert "1 examples, 2 rows skipped" in lines[2]


def test_each_shipped_source_gets_its_node_path_and_keeps_the_users_name(tmp_path):
    from orchestrator.backends.jobfiles import node_spec
    from orchestrator.backends.launcher import memory_choice
    from orchestrator.planning.launchplan import make_plan
    from orchestrator.planning.resolve import resolve_job
    from orchestrator.spec.hostfile import load_nodes

    (tmp_path / "sets").mkdir()
    for name in ("a.jsonl", "sets/a.jsonl"):  # the same file name twice: each keeps its own copy
        (tmp_path / name).write_text('{"instruction": "hi", "output": "hello"}\n', encoding="utf-8")
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n", encoding="utf-8")
    sources = [{"path": "a.jsonl"}, {"path": "sets/a.jsonl", "weight": 2}, {"path": "/shared/c.parquet"}]
    inputs = read_inputs(_job(tmp_path, {"sources": sources}, "runtime=process"))
    assert [(s.index, s.name) for s in inputs.shipped] == [(0, "data/0-a.jsonl"), (1, "data/1-a.jsonl")]
    nodes = load_nodes(tmp_path / "hosts.txt")
    memory, ds_config = memory_choice(inputs, nodes, None, None)
    plan = make_plan(inputs.spec, nodes, "j-20260101-0000-abcd")
    written = node_spec(resolve_job(inputs, nodes, memory, ds_config, plan, None), plan.nodes[0])["data"]["sources"]
    job_dir = plan.nodes[0].job_dir
    assert [(s["path"], s["shipped_from"]) for s in written] == [
        (f"{job_dir}/data/0-a.jsonl", "a.jsonl"),
        (f"{job_dir}/data/1-a.jsonl", "sets/a.jsonl"),
        ("/shared/c.parquet", None),  # on the nodes already: read where it is
    ]


def test_shipped_sources_in_a_docker_node_spec_are_not_looked_for_as_node_side_paths(tmp_path):
    """Slurm's in-allocation preflight reads the node spec, where a shipped file is /job/data/...: the
    container's view of the job directory, which no launch.mounts entry holds. The launcher checked that
    file locally before shipping it; only sources the user put on the nodes are looked for there."""
    import yaml

    from orchestrator.backends.jobfiles import node_spec
    from orchestrator.backends.launcher import memory_choice
    from orchestrator.planning.launchplan import make_plan
    from orchestrator.planning.resolve import resolve_job
    from orchestrator.preflight.datacheck import node_side_sources
    from orchestrator.spec.hostfile import load_nodes

    (tmp_path / "a.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n', encoding="utf-8")
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n", encoding="utf-8")
    sources = [{"path": "a.jsonl"}, {"path": "/shared/c.parquet"}]
    inputs = read_inputs(_job(tmp_path, {"sources": sources}, "runtime=docker", "launch.mounts=[/shared:/shared:ro]"))
    nodes = load_nodes(tmp_path / "hosts.txt")
    memory, ds_config = memory_choice(inputs, nodes, None, None)
    plan = make_plan(inputs.spec, nodes, "j-20260101-0000-abcd")
    written = tmp_path / "node" / "job.yaml"
    written.parent.mkdir()
    spec = node_spec(resolve_job(inputs, nodes, memory, ds_config, plan, None), plan.nodes[0])
    written.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    assert spec["data"]["sources"][0]["path"] == "/job/data/0-a.jsonl"
    assert node_side_sources(load_job(str(written), (), None).spec) == [("data.sources[1].path", "/shared/c.parquet")]
