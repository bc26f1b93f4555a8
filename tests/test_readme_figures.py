"""The README's figures and claims, held to the tool and the files they describe (issue 41, item 19).

Each figure the README quotes from ``dzctl plan`` is read out of the README's own sentence and
compared, at the precision the README writes it, with what the real ``dzctl plan --json`` says
today: a planner change that moves a figure fails here until the README says the new one.
The other claims (what the shipped jobs set, where the tests keep state, what ``--rank`` is)
are held to the jobs, the test modules and the CLI's own help.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import localdocker
import pytest
import yaml
from baseimage import CACHE_DIR
from click.testing import CliRunner

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SEED = ("--hosts", str(ROOT / "hostfiles/2x4.txt"), "--gpu-mem-gib", "40", "--host-mem-gib", "256")
# The commands the README names for these figures.
PLANS = {
    "full": ("plan", str(ROOT / "jobs/qwen72b.yaml"), *SEED, "--json"),
    "lora": ("plan", str(ROOT / "jobs/qwen72b-lora.yaml"), *SEED, "--json"),
}


@functools.cache
def plan(which: str) -> dict:
    result = CliRunner().invoke(main, list(PLANS[which]))
    # The full job does not fit (exit 2): its plan is printed first, the refusal after it on stderr.
    assert result.exit_code in (0, 2), result.output
    return json.JSONDecoder().raw_decode(result.stdout)[0]


def _nvme_tb(p: dict) -> float:
    return p["nvme_alternative"]["nvme_per_node_gib"] * len(p["host_per_node_gib_each"]) * 2**30 / 1e12


# (what, the README's words with the figure as a group, the plan, the tool's value)
FIGURES = [
    ("72B full: host RAM per node", r"needs (\d+) GiB of host RAM per node there", "full",
     lambda p: p["host_per_node_gib"]),
    ("72B full: nodes that would fit", r"\(`use (\d+) such nodes`\)", "full", lambda p: p["min_nodes"]),
    ("72B full: NVMe over both nodes", r"spread over the nodes' disks \(([\d.]+) TB for 72B\)", "full", _nvme_tb),
    ("LoRA: frozen base per GPU", r"partitioned over the GPUs \(~(\d+) GiB each on 8\)", "lora",
     lambda p: p["breakdown"]["gpu"]["params"]),
    ("LoRA: trainable parameters", r"q/k/v/o/gate/up/down: ([\d.]+) M parameters", "lora",
     lambda p: p["trainable_params"] / 1e6),
    ("LoRA: share trained", r"M parameters, ([\d.]+) %\)", "lora",
     lambda p: 100 * p["trainable_params"] / p["model"]["params"]),
    ("LoRA: micro-batch", r"`: micro-batch (\d+) with \d+ of \d+ layers checkpointed", "lora",
     lambda p: p["micro_batch_size"]),
    ("LoRA: checkpointed layers", r"micro-batch \d+ with (\d+) of \d+ layers checkpointed", "lora",
     lambda p: p["checkpointed_layers"]),
    ("LoRA: GPU memory needed", r"([\d.]+) GiB needed per 40 GiB GPU", "lora", lambda p: p["per_gpu_required_gib"]),
    ("LoRA: host RAM per node", r"allocator margin, ([\d.]+) GiB host RAM per\s+node", "lora",
     lambda p: p["host_per_node_gib"]),
]  # fmt: skip


def test_the_readme_names_the_commands_its_figures_come_from():
    shown = " ".join(README.split())
    for args in PLANS.values():
        words = " ".join(Path(a).relative_to(ROOT).as_posix() if a.startswith(str(ROOT)) else a for a in args[:-1])
        assert f"dzctl {words}" in shown, f"the README does not name `dzctl {words}`"


@pytest.mark.parametrize(("what", "pattern", "which", "value"), FIGURES, ids=[f[0] for f in FIGURES])
def test_each_plan_figure_the_readme_quotes_is_what_dzctl_plan_says(what, pattern, which, value):
    found = re.search(pattern, README)
    assert found, f"{what}: the README no longer says /{pattern}/"
    written = found.group(1)
    decimals = len(written.partition(".")[2])
    tool = value(plan(which))
    assert round(tool, decimals) == float(written), (
        f"{what}: the README says {written}, dzctl plan says {tool:.{decimals + 2}f}"
    )


def test_what_the_readme_says_the_shipped_jobs_set_is_what_they_set():
    assert "the shipped GPU jobs set `HF_HOME: /data/hf` under a read-only `/data:/data:ro` mount" in " ".join(
        README.split()
    )
    assert "which the shipped jobs do not set" in README
    for name in ("qwen3-8b", "qwen72b", "qwen72b-lora"):
        launch = yaml.safe_load((ROOT / f"jobs/{name}.yaml").read_text())["launch"]
        assert launch["env"]["HF_HOME"] == "/data/hf" and "/data:/data:ro" in launch["mounts"], name
        assert "HF_HUB_OFFLINE" not in launch["env"], f"jobs/{name}.yaml sets HF_HUB_OFFLINE: say so in the README"


def test_the_readme_names_every_folder_the_tests_leave_behind():
    for folder, variable in ((CACHE_DIR, "DZCTL_TEST_CACHE"), (localdocker.STATE, "DZCTL_TEST_DOCKER_STATE")):
        assert f"`{variable}`" in README, variable
        if variable not in os.environ:  # the folder is the default the README names
            assert f"`{folder}`" in README, folder


def test_the_runbook_index_says_what_logs_rank_is_as_the_cli_does():
    index = " ".join((ROOT / "docs/runbooks/README.md").read_text(encoding="utf-8").split())
    help_text = " ".join(CliRunner().invoke(main, ["logs", "--help"]).output.split())
    assert "--rank INTEGER Only the node that runs this global rank" in help_text
    assert "`--rank` is the node rank" not in index
    assert "`--rank R` is a global rank" in index and "`--node N` is the node rank" in index
