"""``dzctl export`` on real test hosts (issue 26, export): node-local checkpoints gathered over SSH.

Two real runs of jobs/tiny-cpu.yaml through ``dzctl launch`` on the shared pair of
process hosts (one rank each, real ZeRO-3 over gloo, ``{host}`` in the remote dir, so
each node keeps its own rank's shards: node-local storage), made once for the module:

- full fine-tuning, 4 steps, a checkpoint every 2: the export of the middle one
  (checkpoint-2) loads with ``from_pretrained``, and its logits on a fixed batch equal
  those of the weights the trainer itself gathered at step 2 (the HF Trainer's
  ``model.safetensors`` in that checkpoint, from the live ZeRO-3 parameters: another
  path than the export's, which rebuilds them from the optimizer's fp32 partitions);
  the export of checkpoint-4 equals the run's own end model (``model/``);
- LoRA, 2 steps: the merged export and the ``--adapter`` export both load, the
  adapter with ``PeftModel.from_pretrained`` on the run's base, and give the same
  logits as the run's own adapter on that base.

Then, on the full run's record: a checkpoint missing on one node is refused naming
that node (exit 2, nothing written to --out), and bad input gets its fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_e2e import Controller

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCH = [[5, 17, 42, 99, 230, 7, 64, 128, 300, 11, 3, 250]]  # fixed token ids under the tiny vocab (384)


@pytest.fixture(scope="module")
def runs(shared_process_hosts, tmp_path_factory):
    """The full and the LoRA run, each launched once, to the end (--follow)."""
    made = {}
    timings = {}
    try:
        for kind, extra, steps in (
            ("full", ["--set", "train.save_steps=2", "--set", "train.save_total_limit=3"], 4),
            ("lora", ["--set", "train.save_steps=1", "--set", "train.method=lora"], 2),
        ):
            controller = Controller(shared_process_hosts, tmp_path_factory.mktemp(f"export-{kind}"), "process")
            started = time.monotonic()
            # No export reads the collective check's figures (about 6 s a launch): test_e2e's launch does.
            result = controller.launch("--follow", "--skip-collective", *extra, steps=steps)
            timings[kind] = round(time.monotonic() - started, 1)
            assert result.returncode == 0, result.stderr[-4000:]
            made[kind] = controller
        print(f"launch seconds: {timings}")
        yield made
    finally:
        shared_process_hosts.reset()


def export(controller: Controller, *args: str) -> tuple[object, dict | None]:
    result = controller.dzctl(
        "export", controller.job, *args, "--ssh-config", str(controller.cluster.ssh_config), "--json"
    )
    try:
        return result, json.loads(result.stdout)
    except ValueError:
        return result, None


def logits(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(BATCH)).logits


def test_the_middle_checkpoint_exports_and_gives_the_trainers_own_logits(runs, tmp_path):
    full = runs["full"]
    node0, node1 = full.output_dir(0), full.output_dir(1)
    # Node-local: each node holds its own rank's shards only.
    assert sorted(p.name for p in (node1 / "checkpoint-2/global_step2").iterdir() if "rank" in p.name) == [
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    out = tmp_path / "step2"
    result, answer = export(full, "--checkpoint", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    assert answer["checkpoint"] == "checkpoint-2" and answer["storage"] == "node-local"
    assert answer["source"] == "ssh" and answer["verified"] is True
    assert [n["node_rank"] for n in answer["nodes"]] == [0, 1] and all(n["bytes"] > 0 for n in answer["nodes"])
    assert "gathered: " in result.stderr and " MB (100%)" in result.stderr  # progress in bytes
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert (out / "chat_template.jinja").read_text() == (node0 / "checkpoint-2/chat_template.jinja").read_text()
    # The trainer's own weights at step 2: what it gathered from the live ZeRO-3 parameters into the checkpoint.
    trainers = tmp_path / "trainers-step2"
    trainers.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(node0 / "checkpoint-2" / name, trainers / name)
    import torch

    exported, own = logits(out), logits(trainers)
    assert torch.equal(exported, own), (exported - own).abs().max()
    # Training moved on after step 2: this really is the middle checkpoint, not the end model.
    assert not torch.equal(exported, logits(node0 / "model"))


def test_the_last_checkpoint_exports_as_the_runs_own_end_model(runs, tmp_path):
    full = runs["full"]
    out = tmp_path / "latest"
    result, answer = export(full, "--checkpoint", "latest", "--out", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    assert answer["step"] == 4
    import torch

    assert torch.equal(logits(out), logits(full.output_dir(0) / "model"))


def test_a_lora_checkpoint_exports_merged_and_as_an_adapter_and_both_load(runs, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = runs["lora"]
    node0 = lora.output_dir(0)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    result, answer = export(lora, "--checkpoint", "1", "--out", str(merged))
    assert result.returncode == 0, result.stderr[-4000:]
    assert answer["method"] == "lora" and answer["adapter"] is False
    # Without --json: the one line of the result on stdout, the progress on stderr.
    result = lora.dzctl("export", lora.job, "--checkpoint", "1", "--out", str(adapter), "--adapter",
                        "--ssh-config", str(lora.cluster.ssh_config))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith(f"exported checkpoint-1 of {answer['job_id']} (PEFT adapter, float32) to {adapter}")
    assert "checked against the shards after loading with PeftModel.from_pretrained" in result.stdout
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}

    def on_base(adapter_dir: Path):
        base = AutoModelForCausalLM.from_pretrained(str(node0 / "base"), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(adapter_dir))
        model.eval()
        with torch.no_grad():
            return model(input_ids=torch.tensor(BATCH)).logits

    # The trainer's own adapter at step 1 (gathered from the live parameters into the checkpoint).
    trainers = tmp_path / "trainers-adapter"
    trainers.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(node0 / "checkpoint-1" / name, trainers / name)
    own = on_base(trainers)
    assert torch.equal(on_base(adapter), own)
    # Merged W + scale·B·A: the same function up to float rounding.
    assert torch.allclose(logits(merged), own, rtol=0, atol=1e-5), (logits(merged) - own).abs().max()
    # And not the base alone: step 1 changed the adapter (B starts at zero).
    base_only = logits(node0 / "base")
    assert not torch.allclose(base_only, own, rtol=0, atol=1e-5)


def test_a_checkpoint_missing_on_one_node_is_refused_naming_that_node(runs, tmp_path):
    full = runs["full"]
    node1 = full.cluster.hosts[1].name
    marker = full.output_dir(1) / "checkpoint-4" / "dzctl-complete.json"
    aside = marker.with_name("aside.json")
    marker.rename(aside)
    try:
        out = tmp_path / "refused"
        result, answer = export(full, "--checkpoint", "4", "--out", str(out))
        assert result.returncode == 2, result.stderr
        assert f"checkpoint-4 is not complete on node 1 ({node1}): dzctl-complete.json missing" in result.stderr
        assert "fix: export one complete on every node: checkpoint-2" in result.stderr
        assert answer["exit_code"] == 2 and "Traceback" not in result.stderr
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folder left beside it
    finally:
        aside.rename(marker)


@pytest.mark.parametrize(
    ("args", "message", "fix"),
    [
        (["--checkpoint", "99"], "checkpoint-99 is not on node 0", "export one complete on every node"),
        (["--checkpoint", "best"], "kept no best checkpoint", "train.save_best: true"),
        (["--checkpoint", "newest"], "--checkpoint 'newest': not a step number", "latest, or best"),
        (["--checkpoint", "2", "--adapter"], "trained with train.method: full", "leave out --adapter"),
    ],
)
def test_bad_input_is_refused_with_its_fix(runs, tmp_path, args, message, fix):
    out = tmp_path / "out"
    result, answer = export(runs["full"], *args, "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "fix: " in result.stderr and fix in result.stderr, result.stderr
    assert answer["exit_code"] == 2 and message in answer["error"]
    assert not out.exists()


def test_an_out_folder_that_is_not_empty_is_refused_before_any_node_is_asked(runs, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    result, answer = export(runs["full"], "--checkpoint", "2", "--out", str(out))
    assert result.returncode == 2
    assert f"--out {out} already exists and is not empty" in result.stderr
    assert answer["fix"] == f"name a new folder, or empty {out} first"
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_shared_storage_seen_here_is_read_in_place(runs, tmp_path):
    """The full run's checkpoint-2 put together in one folder, as shared storage holds it, marked by the
    trainer's own write_marker (every rank's shards in one folder), for a job recorded on localhost."""
    from orchestrator.observe.store import JobStore
    from orchestrator.train import checkpoints

    full = runs["full"]
    shared = tmp_path / "shared-output"
    folder = shared / "checkpoint-2"
    shutil.copytree(full.output_dir(0) / "checkpoint-2", folder)
    for shard in (full.output_dir(1) / "checkpoint-2/global_step2").iterdir():
        shutil.copy(shard, folder / "global_step2" / shard.name)
    lineage = json.loads((folder / checkpoints.MARKER).read_text())["lineage"]
    checkpoints.write_marker(folder, 2, 2, lineage=lineage)
    home = tmp_path / "home"
    job = "export-shared"
    spec = {"train": {"method": "full", "precision": "fp32", "output_storage": "shared"}, "model": {}}
    plan = {"nodes": [{"host": "localhost", "node_rank": 0, "output_dir": str(shared), "slots": 2}]}
    with JobStore(home / "jobs.sqlite") as store:
        store.add(job_id=f"{job}-1", name=job, runtime="process", image=None, hosts=["localhost"], spec=spec,
                  plan=plan, ssh_config=None)  # fmt: skip
    out = tmp_path / "in-place"
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "export", job, "--checkpoint", "2", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "DZCTL_HOME": str(home)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    assert (answer["source"], answer["storage"], len(answer["nodes"])) == ("in-place", "shared", 1)
    assert "gathered: " not in result.stderr and f"reading checkpoint-2 in place: {folder}" in result.stderr
    import torch

    trainers = tmp_path / "trainers-step2"
    trainers.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, trainers / name)
    assert torch.equal(logits(out), logits(trainers))
