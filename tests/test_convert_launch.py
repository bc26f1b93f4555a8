"""An axolotl Qwen3 LoRA YAML, as it is, trains through ``dzctl launch`` (issue 43's Done-when).

The cheapest real launch: ``dzctl launch tests/fixtures/foreign/axolotl_qwen3_lora.yaml --hosts
hostfiles/localhost.txt --runtime process --follow`` (real ZeRO-3 on CPU, 2 gloo ranks, no SSH) with the
tiny CPU model of jobs/tiny-cpu.yaml given by ``--set``, and ``train.eval_steps`` answering the one key
the YAML has that dzctl refuses (``evals_per_epoch``). What the YAML's keys asked for is read back from
what ran: the micro-batch and accumulation in the ranks' ds_config, the learning rate in progress.jsonl,
the held-out rows' eval, the LoRA rank and alpha in the saved adapter. The dry-run and plan of the two
LLaMA-Factory YAMLs are in tests/test_convert_yaml.py; their own launches are in the extended set
(tests/conftest.py EXTENDED: ~25 s each), as the one below is for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from test_convert_yaml import AXOLOTL, CPU_SETS, LF_FULL, LF_LORA
from test_watch_run import ROOT, _dzctl, _env, _free_port

from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow


def _launch(tmp_path, yaml_file, *extra: str):
    """``dzctl launch YAML`` on localhost's 2 process ranks; (the job's remote folder, its output folder)."""
    home, remote, name = tmp_path / "home", tmp_path / "remote", f"foreign-{uuid.uuid4().hex[:6]}"
    sets = [
        *CPU_SETS,
        f"name={name}",
        f"launch.remote_dir={remote}",
        f"launch.master_port={_free_port()}",
        f"launch.python={sys.executable}",
        *extra,
    ]
    argv = [*_dzctl(), "launch", str(yaml_file), "--hosts", "hostfiles/localhost.txt", "--runtime", "process"]
    argv += ["--follow", "--skip-collective", *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(home), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (ds_config,) = (remote / "jobs").glob("*/ds_config.json")
    return json.loads(ds_config.read_text()), remote / "output" / name


@pytest.mark.parametrize(
    ("yaml_file", "micro", "accumulation", "learning_rate", "lora_r"),
    [(LF_FULL, 1, 2, 1e-5, None), (LF_LORA, 2, 4, 1e-4, 16)],
    ids=["llamafactory-full", "llamafactory-lora"],
)
def test_the_llamafactory_yamls_train_as_they_are(tmp_path, yaml_file, micro, accumulation, learning_rate, lora_r):
    """per_device_train_batch_size x gradient_accumulation_steps per rank, learning_rate, lora_rank, val_size."""
    # logging_steps: 10 in both (mapped): every step is logged here
    config, output = _launch(tmp_path, yaml_file, "train.max_steps=2", "train.eval_steps=2", "train.logging_steps=1")
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (micro, accumulation)
    assert config["train_batch_size"] == micro * accumulation * 2
    events = read_events(output / "progress.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2]
    assert max(e["learning_rate"] for e in steps) <= learning_rate * (1 + 1e-9)
    assert any(e["event"] == "eval" for e in events)  # val_size held rows out, and they were evaluated
    if lora_r is not None:
        assert json.loads((output / "adapter" / "adapter_config.json").read_text())["r"] == lora_r


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
