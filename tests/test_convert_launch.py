"""An axolotl Qwen3 LoRA YAML, as it is, trains through ``dzctl launch`` (issue 43's Done-when).

The cheapest real launch: ``dzctl launch tests/fixtures/foreign/axolotl_qwen3_lora.yaml --hosts
hostfiles/localhost.txt --runtime process --follow`` (real ZeRO-3 on CPU, 2 gloo ranks, no SSH) with the
tiny CPU model of jobs/tiny-cpu.yaml given by ``--set``, and ``train.eval_steps`` answering the one key
the YAML has that dzctl refuses (``evals_per_epoch``). What the YAML's keys asked for is read back from
what ran: the micro-batch and accumulation in the ranks' ds_config, the learning rate in progress.jsonl,
the held-out rows' eval, the LoRA rank and alpha in the saved adapter. The dry-run and plan of the two
LLaMA-Factory YAMLs are in tests/test_convert_yaml.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from test_convert_yaml import AXOLOTL, CPU_SETS
from test_watch_run import ROOT, _dzctl, _env, _free_port

from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow


def test_the_axolotl_yaml_trains_as_it_is_with_its_keys_in_effect(tmp_path):
    home, remote, name = tmp_path / "home", tmp_path / "remote", f"axolotl-{uuid.uuid4().hex[:6]}"
    sets = [
        *CPU_SETS,
        f"name={name}",
        f"launch.remote_dir={remote}",
        f"launch.master_port={_free_port()}",
        f"launch.python={sys.executable}",  # the ranks run this venv's torch and DeepSpeed
        "train.max_steps=2",
        "train.eval_steps=2",  # answers evals_per_epoch, which dzctl refuses
    ]
    argv = [*_dzctl(), "launch", str(AXOLOTL), "--hosts", "hostfiles/localhost.txt", "--runtime", "process"]
    argv += ["--follow", "--skip-collective", *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(home), capture_output=True, text=True, timeout=900)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]

    (ds_config,) = (remote / "jobs").glob("*/ds_config.json")
    config = json.loads(ds_config.read_text())
    # micro_batch_size 2 x gradient_accumulation_steps 2 x 2 ranks: per GPU, as axolotl reads them
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 2)
    assert config["train_batch_size"] == 8

    output = remote / "output" / name
    events = read_events(output / "progress.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2]
    assert max(e["learning_rate"] for e in steps) == pytest.approx(2e-4)  # learning_rate: 0.0002
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and evals[-1]["step"] == 2  # val_set_size: 0.1 held rows out, and they were evaluated
    adapter = json.loads((output / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)  # lora_r, lora_alpha
    assert set(adapter["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
