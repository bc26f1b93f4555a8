"""The export's pure parts (issue 26): what a node reports, which checkpoint is chosen, which files move.

Each node's folders are made on disk and marked by the trainer's own
``checkpoints.write_marker``; the node script (``export/survey.py``) runs on them
for real (``python3 -c``, as over SSH), so the marker it reads is the one the trainer
writes. No torch, no hosts: these run in well under a second each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.errors import InputError
from orchestrator.export.choose import NoSuchCheckpoint, choose, parse_which
from orchestrator.export.plan import (
    SHARD_BYTES,
    NodeFiles,
    disk_needed,
    in_place,
    lora_base,
    make_plan,
    parameters,
    ram_needed,
    tar_bytes,
)
from orchestrator.export.survey import parse_survey, survey_argv
from orchestrator.train import checkpoints

SPEC = {"train": {"method": "full", "precision": "bf16"}, "model": {"name_or_path": "Qwen/Qwen3-8B"}}


def node_checkpoint(out: Path, step: int, ranks: list[int], world: int, *, lineage="run-a", small=False) -> Path:
    """A node-local save as one node's disk holds it (its ranks' shards; node 0 also the small files)."""
    path = out / f"checkpoint-{step}"
    shards = path / f"global_step{step}"
    shards.mkdir(parents=True)
    (path / "latest").write_text(f"global_step{step}")
    for rank in ranks:
        (shards / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"m" * 100)
        (shards / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 1200)
    if small:
        for name in ("trainer_state.json", "config.json", "tokenizer.json", "chat_template.jinja"):
            (path / name).write_text("{}")
        for name in ("model.safetensors", "rng_state_0.pth", "scheduler.pt", "training_args.bin", "zero_to_fp32.py"):
            (path / name).write_bytes(b"w" * 50)
    checkpoints.write_marker(path, world, step, ranks=ranks, lineage=lineage)
    return path


def survey(out: Path, node_rank: int, host: str | None = None):
    ran = subprocess.run(survey_argv(sys.executable, str(out)), capture_output=True, text=True, check=True)
    return parse_survey(host or f"h{node_rank}", node_rank, str(out), ran.stdout)


@pytest.fixture
def two_nodes(tmp_path):
    """Two nodes, one rank each: checkpoint-2 and -4 complete on both; -6 only on node 0."""
    n0, n1 = tmp_path / "n0", tmp_path / "n1"
    for step in (2, 4, 6):
        node_checkpoint(n0, step, [0], 2, small=True)
    for step in (2, 4):
        node_checkpoint(n1, step, [1], 2)
    partial = n1 / "checkpoint-6" / "global_step6"
    partial.mkdir(parents=True)  # node 1 died mid-save: no marker
    (partial / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"m")
    return n0, n1


def test_the_node_script_reads_the_trainers_markers(two_nodes):
    n0, n1 = two_nodes
    found = survey(n1, 1)
    assert sorted(found.checkpoints) == [2, 4, 6]
    four = found.checkpoints[4]
    assert (four.complete, four.world_size, four.ranks, four.lineage) == (True, 2, (1,), "run-a")
    assert four.files["global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"] == 1200
    assert found.checkpoints[6].problem == "dzctl-complete.json missing: the save did not finish on this node"
    # A shard cut short after the save: the manifest's size catches it.
    with (n0 / "checkpoint-4/global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt").open("r+b") as handle:
        handle.truncate(10)
    assert "is 10 bytes, dzctl-complete.json says 100" in survey(n0, 0).checkpoints[4].problem


def test_latest_is_the_newest_complete_on_every_node(two_nodes):
    n0, n1 = two_nodes
    chosen = choose("latest", [survey(n0, 0), survey(n1, 1)], "node-local", "job-1")
    assert (chosen.step, chosen.world_size, sorted(chosen.parts)) == (4, 2, [0, 1])


def test_a_checkpoint_incomplete_on_one_node_is_refused_naming_it(two_nodes):
    n0, n1 = two_nodes
    with pytest.raises(NoSuchCheckpoint) as refused:
        choose(6, [survey(n0, 0), survey(n1, 1, "gpu-b")], "node-local", "job-1")
    assert refused.value.message == (
        "checkpoint-6 is not complete on node 1 (gpu-b): dzctl-complete.json missing: the save did not finish on "
        "this node"
    )
    assert refused.value.fix == "export one complete on every node: checkpoint-2, checkpoint-4 (or --checkpoint latest)"
    assert refused.value.exit_code == 2


def test_a_checkpoint_absent_on_one_node_is_refused_naming_it(two_nodes, tmp_path):
    n0, _ = two_nodes
    with pytest.raises(NoSuchCheckpoint, match=r"checkpoint-2 is not on node 1 \(h1\): .* has no checkpoint-2 "
                       r"\(the output dir itself is missing on that node\)"):  # fmt: skip
        choose(2, [survey(n0, 0), survey(tmp_path / "gone", 1)], "node-local", "job-1")


def test_parts_of_different_runs_or_a_missing_rank_are_refused(tmp_path):
    n0, n1, n2 = tmp_path / "n0", tmp_path / "n1", tmp_path / "n2"
    node_checkpoint(n0, 2, [0], 2)
    node_checkpoint(n1, 2, [1], 2, lineage="run-b")
    with pytest.raises(NoSuchCheckpoint, match="the nodes' markers name different runs"):
        choose(2, [survey(n0, 0), survey(n1, 1)], "node-local", "j")
    node_checkpoint(n2, 2, [0], 2)  # rank 0 again, rank 1 nowhere
    with pytest.raises(NoSuchCheckpoint, match="rank 0's shards are on node 0 and node 1"):
        choose(2, [survey(n0, 0), survey(n2, 1)], "node-local", "j")
    with pytest.raises(NoSuchCheckpoint, match=r"no node holds the shards of ranks \[1\] of its 2"):
        choose(2, [survey(n0, 0)], "node-local", "j")


def test_on_shared_storage_node_0_holds_it_all(tmp_path):
    shared = tmp_path / "shared"
    path = shared / "checkpoint-3"
    node_checkpoint(shared, 3, [0, 1], 2)
    (path / "dzctl-complete.json").write_text(
        json.dumps({**json.loads((path / "dzctl-complete.json").read_text()), "ranks": [0, 1]})
    )
    nodes = [survey(shared, 0), survey(tmp_path / "unused", 1)]  # node 1's view is not consulted
    chosen = choose("latest", nodes, "shared", "j")
    plan = make_plan(chosen, nodes, job_id="j", spec=SPEC, adapter=False, storage="shared")
    assert [(n.node_rank, len(n.files)) for n in plan.nodes] == [(0, 5)]


def test_best_is_what_dzctl_best_json_names_or_a_refusal_with_the_fix(two_nodes):
    n0, n1 = two_nodes
    with pytest.raises(NoSuchCheckpoint) as refused:
        choose("best", [survey(n0, 0), survey(n1, 1)], "node-local", "job-1")
    assert f"job job-1 kept no best checkpoint: {n0} on node 0 (h0) has no dzctl-best.json" == refused.value.message
    assert "train.save_best: true" in refused.value.fix
    (n0 / "dzctl-best.json").write_text(json.dumps({"checkpoint": "checkpoint-2", "step": 2, "eval_loss": 1.5}))
    assert choose("best", [survey(n0, 0), survey(n1, 1)], "node-local", "job-1").step == 2


def test_which_parses_steps_and_names():
    assert [parse_which(x) for x in ("12", "checkpoint-12", "latest", "best")] == [12, 12, "latest", "best"]
    with pytest.raises(InputError, match="not a step number, latest or best"):
        parse_which("last")


def test_the_plan_moves_each_nodes_own_shards_and_node_0s_small_files(two_nodes):
    n0, n1 = two_nodes
    nodes = [survey(n0, 0), survey(n1, 1)]
    plan = make_plan(choose(4, nodes, "node-local", "j"), nodes, job_id="j", spec=SPEC, adapter=False,
                     storage="node-local")  # fmt: skip
    assert plan.tag == "global_step4" and plan.dtype == "bfloat16"
    assert [f for f, _ in plan.nodes[0].files] == [
        "chat_template.jinja",
        "config.json",
        "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "latest",
        "tokenizer.json",
        "trainer_state.json",
    ]  # not the Trainer's 16-bit model.safetensors, RNG states, scheduler, arguments or scripts
    assert [f for f, _ in plan.nodes[1].files] == [
        "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    assert plan.nodes[1].folder == f"{n1}/checkpoint-4" and plan.nodes[1].nbytes == 1300
    assert plan.nbytes == 1300 * 2 + 2 * 4 + len("global_step4")
    with pytest.raises(InputError, match=r"--adapter: job j trained with train\.method: full"):
        make_plan(choose(4, nodes, "node-local", "j"), nodes, job_id="j", spec=SPEC, adapter=True,
                  storage="node-local")  # fmt: skip


def test_reading_in_place_needs_every_file_at_its_size(two_nodes):
    n0, n1 = two_nodes
    nodes = [survey(n0, 0), survey(n1, 1)]
    plan = make_plan(choose(4, nodes, "node-local", "j"), nodes, job_id="j", spec=SPEC, adapter=False,
                     storage="node-local")  # fmt: skip
    sizes = {f"{n.folder}/{rel}": size for n in plan.nodes for rel, size in n.files}
    assert in_place(plan, sizes)
    one = next(iter(sizes))
    assert not in_place(plan, {**sizes, one: None})
    assert not in_place(plan, {**sizes, one: sizes[one] + 1})


def test_ram_needed_grows_with_the_model_in_its_dtype(two_nodes):
    n0, n1 = two_nodes
    nodes = [survey(n0, 0), survey(n1, 1)]
    full = make_plan(choose(4, nodes, "node-local", "j"), nodes, job_id="j", spec=SPEC, adapter=False,
                     storage="node-local")  # fmt: skip
    assert parameters(full) == 2 * 1200 // 12  # Adam: 12 bytes of optimizer state per trained parameter
    assert ram_needed(full) == 2 * 200 * 2  # bf16 model for the check + one shard (no larger than the model)
    lora_spec = {"train": {"method": "lora", "precision": "bf16"}, "model": {"init": "random"}}
    lora = make_plan(choose(4, nodes, "node-local", "j"), nodes, job_id="j", spec=lora_spec, adapter=False,
                     storage="node-local")  # fmt: skip
    frozen = 2 * 100 // 2  # LoRA: the model-state files' bytes in bf16
    assert parameters(lora) == 200 + frozen
    assert ram_needed(lora) == 2 * (200 + frozen) * 2 + SHARD_BYTES  # the PEFT model and the loaded merge
    assert lora.base == f"{n0}/base" and lora_base(SPEC, "/o") == "Qwen/Qwen3-8B"
    # 72B, full fine-tuning in bf16 on 2 nodes of 8: 864 GB of optimizer states move (54 GB per rank), and
    # the controller needs the bf16 model for the check (144 GB) and one 5 GB shard, not 288 GB of fp32.
    ranks = [
        (f"global_step9/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 12 * 72 * 10**9 // 16) for r in range(16)
    ]
    big = replace(full, nodes=(NodeFiles("a", 0, "/x", tuple(ranks[:8])), NodeFiles("b", 1, "/x", tuple(ranks[8:]))))
    assert big.nodes[0].nbytes == 432 * 10**9 and parameters(big) == 72 * 10**9
    assert ram_needed(big) == 149 * 10**9
    # Disk beside --out: the gathered 864 GB and the written 144 GB; read in place, only the model.
    assert (disk_needed(big, False), disk_needed(big, True)) == (1008 * 10**9, 144 * 10**9)


def test_pure_bf16_optimizer_files_hold_6_bytes_a_trained_parameter(two_nodes):
    # train.pure_bf16: the master copy and Adam's m and v are bf16, so the same files hold twice the parameters.
    n0, n1 = two_nodes
    nodes = [survey(n0, 0), survey(n1, 1)]
    spec = {**SPEC, "train": {**SPEC["train"], "pure_bf16": True}}
    pure = make_plan(choose(4, nodes, "node-local", "j"), nodes, job_id="j", spec=spec, adapter=False,
                     storage="node-local")  # fmt: skip
    assert parameters(pure) == 2 * 1200 // 6
    assert ram_needed(pure) == 2 * 400 * 2  # the bf16 model for the check + one shard, both of 400 parameters


def test_the_progress_total_is_what_tar_really_sends(two_nodes):
    n0, n1 = two_nodes
    nodes = [survey(n0, 0), survey(n1, 1)]
    plan = make_plan(choose(4, nodes, "node-local", "j"), nodes, job_id="j", spec=SPEC, adapter=False,
                     storage="node-local")  # fmt: skip
    for node in plan.nodes:
        sent = subprocess.run(["tar", "-C", node.folder, "-cf", "-", "--", *[f for f, _ in node.files]],
                              capture_output=True, check=True).stdout  # fmt: skip
        assert tar_bytes(node.files) == len(sent)
    assert plan.stream_bytes == sum(tar_bytes(n.files) for n in plan.nodes) > plan.nbytes


def test_a_node_without_the_python_to_answer_is_named_with_the_fix(tmp_path):
    """The survey's side effect, through the real local transport (localhost needs no SSH)."""
    from orchestrator.errors import RemoteError
    from orchestrator.export.gather import survey_nodes
    from orchestrator.observe.store import JobRecord
    from orchestrator.transport.pool import HostPool

    nodes = [{"host": "localhost", "node_rank": 0, "output_dir": str(tmp_path)}]
    record = JobRecord("j-1", "j", "running", "process", None, ["localhost"], {"launch": {"python": "/no/python3"}},
                       {"nodes": nodes}, None, 0.0, None, None)  # fmt: skip
    with HostPool(["localhost"]) as pool, pytest.raises(RemoteError) as refused:
        survey_nodes(record, pool)
    assert "node 0 (localhost): no /no/python3 there to list" in refused.value.message
    assert refused.value.fix.startswith("install Python 3 on the node")
    good = replace(record, spec={"launch": {"python": sys.executable}})
    node_checkpoint(tmp_path, 3, [0], 1)
    with HostPool(["localhost"]) as pool:
        assert sorted(survey_nodes(good, pool)[0].checkpoints) == [3]
