"""A LLaMA-Factory or axolotl training YAML as the job (issue 43, first half): recognised, converted, explained.

Three fixtures of our own in those tools' documented layouts (tests/fixtures/foreign/): a LLaMA-Factory
full-SFT Qwen3 YAML (with its ``deepspeed:`` file and a ``dataset_info.json`` registry beside it), a
LLaMA-Factory LoRA YAML and an axolotl Qwen3 LoRA YAML. Each mapped key's effect is asserted on the job
as ``dzctl launch`` loads it and on its ``--dry-run`` plan (global batch, learning rate, template, LoRA
rank, eval split); the model is the tiny CPU model of jobs/tiny-cpu.yaml, given with ``--set``.
The real launch of one of them: tests/test_convert_launch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.errors import SpecError
from orchestrator.spec import foreign
from orchestrator.spec.job import LORA_DEFAULT_TARGETS, load_job
from orchestrator.spec.keymap import ALL_LINEAR_TARGETS
from orchestrator.spec.yamlsource import load_yaml_with_lines

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "foreign"
LF_FULL = FIXTURES / "lf_qwen3_full_sft.yaml"
LF_LORA = FIXTURES / "lf_qwen3_lora_sft.yaml"
AXOLOTL = FIXTURES / "axolotl_qwen3_lora.yaml"
# jobs/tiny-cpu.yaml's model and CPU settings: what the Qwen3 YAMLs train on here.
TINY = yaml.safe_load((ROOT / "jobs" / "tiny-cpu.yaml").read_text(encoding="utf-8"))
CPU_SETS = (
    f"model={json.dumps(TINY['model'])}",
    "accelerator=cpu",
    "train.precision=fp32",
    "launch.env={OMP_NUM_THREADS: 1}",
)
# The tiny model's shape: hidden 64, 4 query and 2 key/value heads of 16, MLP 192, 2 layers.
TINY_LORA_IN_OUT = 64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 64 + 192 + 64 + 192 + 192 + 64  # the 7 projections


def _conversion(path: Path) -> foreign.Conversion:
    data, lines = load_yaml_with_lines(path)
    return foreign.convert(data, lines, path)


def _llamafactory_lora(path: Path, *replacements: tuple[str, str]) -> Path:
    """LLaMA-Factory's LoRA example at ``path`` with each (old, new) replaced, its datasets read from the fixtures."""
    text = LF_LORA.read_text()
    for old, new in (*replacements, ("dataset_dir: data", f"dataset_dir: {FIXTURES / 'data'}")):
        text = text.replace(old, new)
    path.write_text(text)
    return path


def _line_of(path: Path, key: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), start=1) if line.startswith(f"{key}:"))


def _dry_run(tmp_path: Path, job: Path, *sets: str, slots: int = 2):
    hosts = tmp_path / f"hosts-{slots}.txt"
    hosts.write_text(f"localhost slots={slots}\n")
    argv = ["launch", str(job), "--hosts", str(hosts), "--runtime", "process", "--dry-run", "--json"]
    for item in (*CPU_SETS, *sets):
        argv += ["--set", item]
    return CliRunner().invoke(main, argv, env={"DZCTL_HOME": str(tmp_path / "home")})


def _plan(tmp_path: Path, job: Path, *sets: str, slots: int = 2) -> dict:
    result = _dry_run(tmp_path, job, *sets, slots=slots)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["memory"]


# --- recognition and the table ----------------------------------------------------------------------


def test_each_tool_is_recognised_by_its_keys_and_a_dzctl_job_is_not():
    assert foreign.detect(load_yaml_with_lines(LF_FULL)[0]) == "LLaMA-Factory"
    assert foreign.detect(load_yaml_with_lines(LF_LORA)[0]) == "LLaMA-Factory"
    assert foreign.detect(load_yaml_with_lines(AXOLOTL)[0]) == "axolotl"
    assert foreign.detect(load_yaml_with_lines(ROOT / "jobs" / "tiny-cpu.yaml")[0]) is None
    assert foreign.detect({"name": "x", "template": "qwen3"}) is None  # one marker is not enough


@pytest.mark.parametrize("path", [LF_FULL, LF_LORA, AXOLOTL], ids=lambda p: p.stem)
def test_every_key_of_the_users_yaml_has_a_row_at_its_own_line(path):
    raw = load_yaml_with_lines(path)[0]
    rows = _conversion(path).rows
    keyed = [row for row in rows if row.outcome != "default"]
    assert {row.key.split(".")[0] for row in keyed} == set(raw)
    for row in keyed:
        if "." not in row.key:
            assert row.line == _line_of(path, row.key), row
        assert row.reason or row.outcome == "mapped", row  # every ignored or refused key says why
    assert all(row.reason for row in rows if row.outcome == "default")


def test_the_lora_targets_of_all_are_dzctls_default_targets():
    assert ALL_LINEAR_TARGETS == LORA_DEFAULT_TARGETS


# --- each mapped key's effect on the job as launch loads it -------------------------------------------


def test_llamafactory_full_sft_keys_reach_the_job():
    job = load_job(LF_FULL, CPU_SETS)
    spec = job.spec
    assert job.converted is not None and job.converted.tool == "LLaMA-Factory"
    assert spec.name == "lf_qwen3_full_sft"  # from the file name
    assert spec.train.method == "full"
    assert (spec.train.micro_batch_size, spec.train.gradient_accumulation_steps) == (1, 2)
    assert spec.train.learning_rate == 1e-5 and spec.train.lr_scheduler == "cosine"
    assert spec.train.epochs == 3.0 and spec.train.warmup_ratio == 0.1
    assert spec.train.max_seq_len == 1024 and spec.train.packing is False
    assert spec.train.save_steps == 500 and spec.train.eval_steps == 500
    assert spec.data.template == "auto"  # template: qwen3, the model's own chat template
    assert spec.data.eval_split == 0.1  # val_size
    assert job.resolve_local(spec.zero.config) == FIXTURES / "ds_z3_config.json"  # relative to the YAML
    # dataset: identity,alpaca_en_demo through data/dataset_info.json, concatenated as LLaMA-Factory does
    assert [Path(s.path).name for s in spec.data.all_sources()] == ["identity.json", "alpaca_en_demo.json"]
    assert spec.data.mix_strategy == "concat"


def test_llamafactory_lora_keys_reach_the_job():
    spec = load_job(LF_LORA, CPU_SETS).spec
    assert spec.train.method == "lora"
    lora = spec.train.lora
    assert (lora.r, lora.alpha, lora.dropout) == (16, 32.0, 0.05)
    assert lora.target_modules == list(LORA_DEFAULT_TARGETS)  # lora_target: all
    assert spec.train.learning_rate == 1e-4  # written 1e-4: text to YAML, a number to HF's parser and to dzctl
    assert spec.train.max_steps == 400 and spec.train.warmup_ratio == 0.1  # warmup_steps 40 of 400
    assert spec.train.lr_scheduler == "linear"
    assert spec.data.template == "auto" and spec.data.enable_thinking is False  # template: qwen3_nothink
    assert spec.data.eval_split == 4 and spec.train.eval_steps == 100  # val_size: 4 rows
    assert spec.train.report_to == ["tensorboard"]


def test_axolotl_lora_keys_reach_the_job_once_its_refused_key_is_answered():
    with pytest.raises(SpecError) as refused:
        load_job(AXOLOTL, CPU_SETS)
    line = _line_of(AXOLOTL, "evals_per_epoch")
    assert f"{AXOLOTL}:{line}: evals_per_epoch: dzctl evaluates every train.eval_steps steps" in refused.value.message
    assert "train.eval_steps" in refused.value.fix
    spec = load_job(AXOLOTL, (*CPU_SETS, "train.eval_steps=2")).spec
    assert spec.train.method == "lora"
    assert (spec.train.lora.r, spec.train.lora.alpha) == (4, 8.0)
    assert spec.train.lora.target_modules == list(LORA_DEFAULT_TARGETS)  # lora_target_linear: true
    assert (spec.train.micro_batch_size, spec.train.gradient_accumulation_steps) == (2, 2)
    assert spec.train.learning_rate == 2e-4 and spec.train.warmup_ratio == 0.1
    assert spec.train.max_seq_len == 256 and spec.data.eval_split == 0.1
    assert spec.data.template == "auto"  # chat_template: qwen3
    (source,) = spec.data.sources
    assert (source.path, source.format) == ("rows.jsonl", "messages")
    assert source.columns == {"messages": "conversations", "role": "from", "content": "value"}


# --- the plan: the global batch grows with the GPUs, as in the tool, until train.global_batch_size fixes it ---


def test_the_global_batch_grows_with_the_gpus_as_in_llamafactory_and_global_batch_size_fixes_it(tmp_path):
    one, two = (_plan(tmp_path, LF_FULL, slots=n) for n in (1, 2))
    assert (one["micro_batch_size"], one["gradient_accumulation_steps"], one["train_batch_size"]) == (1, 2, 2)
    assert (two["micro_batch_size"], two["gradient_accumulation_steps"], two["train_batch_size"]) == (1, 2, 4)
    fixed = ("train.global_batch_size=8", "train.micro_batch_size=auto")  # the fix the table names
    assert [_plan(tmp_path, LF_FULL, *fixed, slots=n)["train_batch_size"] for n in (1, 2)] == [8, 8]
    note = next(r for r in _conversion(LF_FULL).rows if r.key == "per_device_train_batch_size").reason
    assert "1 x 2 x the number of GPUs" in note and "--set train.global_batch_size=N" in note


def test_the_lora_rank_is_the_plans_trainable_parameters(tmp_path):
    plan = _plan(tmp_path, LF_LORA, "train.max_steps=4")
    assert plan["method"] == "lora"
    assert plan["trainable_params"] == 16 * TINY_LORA_IN_OUT * 2  # rank 16, 7 projections, 2 layers
    assert plan["micro_batch_size"] == 2 and plan["train_batch_size"] == 2 * 4 * 2


# --- bad input: exit 2 naming the user's file, line and key ------------------------------------------


def test_keys_that_change_training_and_cannot_run_are_refused_each_at_its_line(tmp_path):
    job = tmp_path / "lf.yaml"
    text = LF_LORA.read_text().replace("lora_dropout: 0.05\n", "lora_dropout: 0.05\nuse_dora: true\nlora_rnak: 8\n")
    job.write_text(text.replace("stage: sft\n", "stage: sft\nquantization_bit: 4\n"))
    result = _dry_run(tmp_path, job)
    assert result.exit_code == 2, result.output
    for key, says in (
        ("quantization_bit", "quantized (QLoRA) training"),
        ("use_dora", "DoRA adapters"),
        ("lora_rnak", "did you mean lora_rank?"),
    ):
        assert f"{job}:{_line_of(job, key)}: {key}: " in result.output and says in result.output, result.output
    assert "Traceback" not in result.output and "dzctl convert" in result.output


def test_a_value_dzctl_refuses_names_the_users_line_and_key(tmp_path):
    job = tmp_path / "lf.yaml"
    job.write_text(LF_LORA.read_text().replace("learning_rate: 1e-4", "learning_rate: -3"))
    result = _dry_run(tmp_path, job)
    assert result.exit_code == 2, result.output
    line = _line_of(job, "learning_rate")
    assert f"{job}:{line} (learning_rate): train.learning_rate: " in result.output, result.output


def test_set_applies_dzctl_keys_after_the_conversion():
    job = load_job(LF_LORA, (*CPU_SETS, "train.learning_rate=0.5", "train.lora.r=2", "name=mine"))
    assert (job.spec.train.learning_rate, job.spec.train.lora.r, job.spec.name) == (0.5, 2, "mine")
    assert job.where("train.learning_rate") == "--set train.learning_rate=0.5"
    assert job.where("train.max_steps") == f"{LF_LORA}:{_line_of(LF_LORA, 'max_steps')} (max_steps)"


# --- dzctl convert -------------------------------------------------------------------------------------


def test_convert_prints_the_job_and_every_key():
    result = CliRunner().invoke(main, ["convert", str(LF_FULL), "--set", "name=sft-run"])
    assert result.exit_code == 0, result.output
    job_text, _, table = result.stdout.partition("\n\n")
    job = yaml.safe_load(job_text)
    assert job["name"] == "sft-run" and job["train"]["learning_rate"] == 1e-5
    assert job["zero"]["config"] == "ds_z3_config.json"
    line = _line_of(LF_FULL, "report_to")
    assert f"{line:>4}  ignored  report_to: none  (logging only: no tracker)" in table
    line = _line_of(LF_FULL, "per_device_train_batch_size")
    assert f"{line:>4}  mapped   per_device_train_batch_size: 1  ->  train.micro_batch_size: 1" in table
    assert "default  runtime: docker" in table


def test_convert_json_lists_every_key_and_exits_2_while_a_refusal_stands():
    refused = CliRunner().invoke(main, ["convert", str(AXOLOTL), "--json"])
    assert refused.exit_code == 2
    found = json.loads(refused.stdout.splitlines()[0])
    assert found["tool"] == "axolotl" and found["refused"] == ["evals_per_epoch"]
    assert {k["key"] for k in found["keys"] if "." not in k["key"] and k["outcome"] != "default"} == set(
        load_yaml_with_lines(AXOLOTL)[0]
    )
    answered = CliRunner().invoke(main, ["convert", str(AXOLOTL), "--json", "--set", "train.eval_steps=3"])
    assert answered.exit_code == 0, answered.output
    assert json.loads(answered.stdout)["job"]["train"]["eval_steps"] == 3


def test_convert_refuses_a_dzctl_job_naming_the_file():
    result = CliRunner().invoke(main, ["convert", str(ROOT / "jobs" / "tiny-cpu.yaml")])
    assert result.exit_code == 2
    assert "tiny-cpu.yaml: not a LLaMA-Factory or axolotl training YAML" in result.output


# --- preference training: onto issue 44's train keys -------------------------------------------------


def test_llamafactory_dpo_and_axolotl_rl_keys_become_train_stage_and_pref_keys(tmp_path):
    dpo = "stage: dpo\npref_beta: 0.2\npref_loss: ipo\npref_ftx: 0.5"
    lf = _llamafactory_lora(tmp_path / "dpo.yaml", ("stage: sft", dpo))
    train = load_job(lf, CPU_SETS).spec.train
    assert (train.stage, train.pref_loss, train.pref_beta, train.pref_ftx) == ("dpo", "ipo", 0.2, 0.5)
    ax = tmp_path / "rl.yaml"
    ax.write_text(AXOLOTL.read_text().replace("adapter: lora", "rl: orpo\nrl_beta: 0.3\nadapter: lora"))
    train = load_job(ax, (*CPU_SETS, "train.eval_steps=2")).spec.train
    assert (train.stage, train.pref_loss, train.pref_beta) == ("dpo", "orpo", 0.3)
    sft = _conversion(LF_LORA)
    assert "stage" not in sft.data["train"]  # stage: sft is dzctl's default, named in the table only
    assert next(r for r in sft.rows if r.key == "stage").target == "train.stage"


def test_a_template_whose_prompt_is_not_the_models_own_is_refused_until_data_template_is_set(tmp_path):
    # LLaMA-Factory's qwen template adds Qwen2.5's default system prompt; Qwen3's own template does not.
    job = _llamafactory_lora(tmp_path / "lf.yaml", ("template: qwen3_nothink", "template: qwen"))
    with pytest.raises(SpecError) as refused:
        load_job(job, CPU_SETS)
    assert f"{job}:{_line_of(job, 'template')}: template: qwen adds Qwen2.5's system prompt" in refused.value.message
    assert load_job(job, (*CPU_SETS, "data.template=chatml")).spec.data.template == "chatml"
    job.write_text(job.read_text().replace("Qwen/Qwen3-4B", "Qwen/Qwen2.5-7B-Instruct"))
    assert load_job(job, CPU_SETS).spec.data.template == "auto"  # Qwen2.5's own template has that prompt


def test_max_samples_truncates_each_registry_dataset_as_in_llamafactory(tmp_path):
    job = tmp_path / "lf.yaml"
    job.write_text(
        LF_FULL.read_text().replace("max_samples: 1000", "max_samples: 5") + f"dataset_dir: {FIXTURES / 'data'}\n"
    )
    assert [s.max_rows for s in load_job(job, CPU_SETS).spec.data.all_sources()] == [5, 5]


# --- pure bf16: bf16 master weights, gradients and AdamW states (train.pure_bf16) ----------------------

# The CPU settings without their fp32 precision: the converted precision is what is checked.
CPU_SETS_OWN_PRECISION = tuple(item for item in CPU_SETS if not item.startswith("train.precision="))


def test_llamafactory_pure_bf16_becomes_train_pure_bf16_in_bf16(tmp_path):
    job = _llamafactory_lora(tmp_path / "lf.yaml", ("bf16: true", "pure_bf16: true"))
    train = load_job(job, CPU_SETS_OWN_PRECISION).spec.train
    assert (train.pure_bf16, train.precision) == (True, "bf16")
    rows = [r for r in _conversion(job).rows if r.key == "pure_bf16"]
    assert [(r.outcome, r.target, r.target_value) for r in rows] == [
        ("mapped", "train.pure_bf16", True),
        ("mapped", "train.precision", "bf16"),
    ]
    assert rows[0].line == _line_of(job, "pure_bf16")


@pytest.mark.parametrize("key", ["bf16: full", "bfloat16: true"])
def test_axolotls_bf16_without_amp_becomes_train_pure_bf16(tmp_path, key):
    # axolotl's bf16: full turns AMP off on weights loaded in bf16, as its bfloat16: true ("No AMP") does.
    job = tmp_path / "ax.yaml"
    job.write_text(AXOLOTL.read_text().replace("bf16: auto", key))
    train = load_job(job, (*CPU_SETS_OWN_PRECISION, "train.eval_steps=2")).spec.train
    assert (train.pure_bf16, train.precision) == (True, "bf16")
    # bf16: true stays mixed precision (fp32 master weights)
    job.write_text(AXOLOTL.read_text().replace("bf16: auto", "bf16: true"))
    train = load_job(job, (*CPU_SETS_OWN_PRECISION, "train.eval_steps=2")).spec.train
    assert (train.pure_bf16, train.precision) == (False, "bf16")
