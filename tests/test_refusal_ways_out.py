"""The 72B refusal on the seed's hardware names the ways out the README says it names, each with numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[1]
SEED = ["--hosts", str(ROOT / "hostfiles/2x4.txt"), "--gpu-mem-gib", "40", "--host-mem-gib", "256"]


def readme_ways_out() -> list[str]:
    """The first code span of each bullet under "When the job does not fit": what the refusal must say."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("\n## When the job does not fit")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(r"^- \*\*[^*]+\*\* \(`([^`]+)`", section, flags=re.M)


def test_the_refusal_names_every_way_out_the_readme_lists():
    ways = readme_ways_out()
    assert len(ways) == 3, ways
    result = CliRunner().invoke(main, ["plan", str(ROOT / "jobs/qwen72b.yaml"), *SEED])
    assert result.exit_code == 2, result.output
    fix = next(line for line in result.output.splitlines() if line.startswith("fix: "))
    for way in ways:
        assert way in fix, f"README says the refusal names `{way}`; its fix is: {fix}"


def test_the_nvme_way_out_comes_with_the_plan_it_would_be():
    result = CliRunner().invoke(main, ["plan", str(ROOT / "jobs/qwen72b.yaml"), *SEED, "--json"])
    alternative = json.loads(result.stdout)["nvme_alternative"]
    sets = ["--set", "zero.offload=nvme", "--set", "zero.nvme_path=/nvme"]
    on_disk = CliRunner().invoke(main, ["plan", str(ROOT / "jobs/qwen72b.yaml"), *SEED, *sets, "--json"])
    assert on_disk.exit_code == 0, on_disk.output
    planned = json.loads(on_disk.stdout)
    assert alternative["set"] == "--set zero.offload=nvme --set zero.nvme_path=DIR"
    assert alternative["per_gpu_required_gib"] == planned["per_gpu_required_gib"]
    assert alternative["host_per_node_gib"] == planned["host_per_node_gib"]
    assert alternative["nvme_per_node_gib"] == planned["nvme"]["per_node_gib"]
    text = CliRunner().invoke(main, ["plan", str(ROOT / "jobs/qwen72b.yaml"), *SEED]).output
    line = next(line for line in text.splitlines() if "offload to NVMe would fit" in line)
    assert f"{planned['per_gpu_required_gib']} GiB per GPU" in line
    assert f"{planned['nvme']['per_node_gib']} GiB of NVMe per node" in line
