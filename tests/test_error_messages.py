"""The exact wording of errors users hit first: one error per mistake, and a fix that is right."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import HostfileError, SpecError
from orchestrator.spec.hostfile import parse_hostfile
from orchestrator.spec.job import load_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "jobs/tiny-cpu.yaml"


def spec_error(*overrides: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_job(TINY, list(overrides))
    return info.value


def test_host_colon_count_is_fixed_as_slots_without_the_colon():
    with pytest.raises(HostfileError) as info:
        parse_hostfile("gpu-node-1 slots=4\ngpu-node-2:4\n", "hosts.txt")
    assert str(info.value).startswith("hosts.txt:2: gpu-node-2:4: ")
    assert info.value.fix == "write 'gpu-node-2 slots=4'"


def test_an_ipv6_address_without_slots_keeps_its_colons():
    with pytest.raises(HostfileError) as info:
        parse_hostfile("fe80::4\n", "hosts.txt")
    assert info.value.fix == "write 'fe80::4 slots=N', N = GPUs on that node"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("train.lr", "learning_rate"),
        ("train.mbs", "micro_batch_size"),
        ("train.gas", "gradient_accumulation_steps"),
        ("train.learning_rat", "learning_rate"),  # a typo still finds its key
    ],
)
def test_an_abbreviated_key_suggests_the_key_it_abbreviates(typed, meant):
    error = spec_error(f"{typed}=1")
    assert f"unknown key; did you mean {meant}?" in str(error), str(error)


def test_a_misspelt_auto_is_one_error_naming_auto_and_an_integer():
    message = str(spec_error("train.micro_batch_size=atuo"))
    assert message == (
        "--set train.micro_batch_size=atuo: train.micro_batch_size: must be an integer or 'auto' (got 'atuo')"
    )


def test_a_misspelt_auto_in_the_file_is_one_error_on_its_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(TINY.read_text().replace("micro_batch_size: 4", "micro_batch_size: atuo"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data/tiny-alpaca-zh.jsonl").write_text((ROOT / "jobs/data/tiny-alpaca-zh.jsonl").read_text())
    with pytest.raises(SpecError) as info:
        load_job(job)
    line = job.read_text().splitlines().index("  micro_batch_size: atuo") + 1
    assert str(info.value).splitlines() == [
        f"{job}:{line}: train.micro_batch_size: must be an integer or 'auto' (got 'atuo')"
    ]
