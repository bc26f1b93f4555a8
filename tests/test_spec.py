"""Job spec loading: defaults, --set typing, located errors from inside the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec.job import JobSpec, load_job

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny-cpu", "qwen3-8b", "qwen72b"])
def test_example_jobs_load(name):
    job = load_job(ROOT / f"jobs/{name}.yaml")
    assert job.spec.name == name
    assert job.spec.zero.stage == 3


def test_set_values_are_yaml_typed():
    job = load_job(
        ROOT / "jobs/tiny-cpu.yaml",
        [
            "train.max_steps=7",
            "train.learning_rate=2e-4",
            "train.gradient_checkpointing=true",
            "zero.overrides.zero_optimization.overlap_comm=false",
            "launch.env.NCCL_DEBUG=INFO",
        ],
        runtime="process",
    )
    spec = job.spec
    assert spec.train.max_steps == 7
    assert spec.train.learning_rate == 2e-4
    assert spec.train.gradient_checkpointing is True
    assert spec.zero.overrides == {"zero_optimization": {"overlap_comm": False}}
    assert spec.launch.env["NCCL_DEBUG"] == "INFO"
    assert spec.runtime == "process"
    assert job.where("train.max_steps") == "--set train.max_steps=7"
    assert job.where("model.name_or_path") == f"{ROOT / 'jobs/tiny-cpu.yaml'}:9"


def test_env_numbers_become_text(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("name: j\nmodel: {name_or_path: m}\ndata: {path: d}\nlaunch:\n  env: {PORT: 80, DEBUG: true}\n")
    assert load_job(path).spec.launch.env == {"PORT": "80", "DEBUG": "true"}


def test_every_problem_is_reported_with_its_own_line(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("name: j\nmodel: {name_or_path: m}\ndata: {path: d}\ntrain:\n  max_seq_len: 4\n  epocs: 2\n")
    with pytest.raises(SpecError) as info:
        load_job(path)
    assert info.value.message.splitlines() == [
        f"{path}:5: train.max_seq_len: Input should be greater than or equal to 8 (got 4)",
        f"{path}:6: train.epocs: unknown key; did you mean epochs?",
    ]


@pytest.mark.parametrize("key", ["a[b", ";[", "int", "literal['auto']"])
def test_an_unknown_key_that_looks_like_a_pydantic_branch_name_is_named_as_typed(tmp_path, key):
    # `;[:` loaded as {';[': None}: the key was taken for a union branch name and dropped,
    # and the did-you-mean lookup raised IndexError instead of the located message.
    path = tmp_path / "j.yaml"
    path.write_text(f'name: j\nmodel: {{name_or_path: m}}\ndata: {{path: d}}\n"{key}": 1\n')
    with pytest.raises(SpecError) as info:
        load_job(path)
    known = ", ".join(JobSpec.model_fields)
    assert info.value.message.splitlines() == [f"{path}:4: {key}: unknown key; known keys: {known}"]
