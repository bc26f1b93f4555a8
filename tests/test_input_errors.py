"""Malformed hostfiles, filters and specs: exit 2, one located message, no traceback, nothing run.

Each case goes through the real CLI in a subprocess whose PATH starts with a
folder of sentinels named like every program dzctl could run on a host
(docker, ssh, torchrun, ...): if any ran, it leaves a mark and the test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SENTINELS = ("docker", "ssh", "scp", "sftp", "pdsh", "torchrun", "deepspeed", "nvidia-smi")

GOOD_JOB = textwrap.dedent(
    """\
    name: demo
    runtime: docker
    accelerator: cpu
    model:
      name_or_path: tiny
      init: random
    data:
      path: data.jsonl
    train:
      max_steps: 5
      learning_rate: 1.0e-4
    launch:
      master_port: 29500
    """
)
GOOD_HOSTS = "node-a slots=2\nnode-b slots=2\n"


@pytest.fixture
def sandbox(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marks = tmp_path / "ran"
    for name in SENTINELS:
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\necho {name} >> {marks}\nexit 0\n")
        script.chmod(0o755)
    return tmp_path, bin_dir, marks


def run_dzctl(sandbox, job_text, hosts_text, *extra):
    tmp_path, bin_dir, marks = sandbox
    job = tmp_path / "job.yaml"
    hosts = tmp_path / "hosts.txt"
    if job_text is not None:
        job.write_text(job_text)
    if hosts_text is not None:
        hosts.write_text(hosts_text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    # Without --dry-run: a bad input must be refused before anything could start.
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "launch", str(job), "--hosts", str(hosts), *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    return result, job, hosts, marks


def replace_line(old, new):
    assert old in GOOD_JOB
    return GOOD_JOB.replace(old, new)


# (id, job text, hostfile text, extra args, which file the message names, line, text in the message)
CASES = [
    # --- hostfiles
    ("hosts-missing-slots", GOOD_JOB, "node-a slots=2\nnode-b\n", [], "hosts", 2, "missing slots=N"),
    ("hosts-slots-word", GOOD_JOB, "node-a slots=two\n", [], "hosts", 1, "not a whole number"),
    ("hosts-slots-zero", GOOD_JOB, "node-a slots=0\n", [], "hosts", 1, "at least 1 slot"),
    ("hosts-slots-negative", GOOD_JOB, "node-a slots=-1\n", [], "hosts", 1, "not a whole number"),
    ("hosts-slots-float", GOOD_JOB, "node-a slots=1.5\n", [], "hosts", 1, "not a whole number"),
    ("hosts-slots-empty", GOOD_JOB, "node-a slots=\n", [], "hosts", 1, "not a whole number"),
    ("hosts-duplicate", GOOD_JOB, "node-a slots=2\n# x\nnode-a slots=4\n", [], "hosts", 3, "duplicate host"),
    ("hosts-unknown-token", GOOD_JOB, "node-a slots=2 gpus=2\n", [], "hosts", 1, "unknown token 'gpus=2'"),
    ("hosts-slots-twice", GOOD_JOB, "node-a slots=2 slots=4\n", [], "hosts", 1, "slots given 2 times"),
    ("hosts-empty", GOOD_JOB, "", [], "hosts", 1, "lists no hosts"),
    ("hosts-only-comments", GOOD_JOB, "# nothing\n\n", [], "hosts", 1, "lists no hosts"),
    ("hosts-hostile-name", GOOD_JOB, "$(touch${IFS}x) slots=1\n", [], "hosts", 1, "not a valid host name"),
    ("hosts-semicolon", GOOD_JOB, "a;reboot slots=1\n", [], "hosts", 1, "not a valid host name"),
    ("hosts-huge-slots", GOOD_JOB, "node-a slots=80000\n", [], "hosts", 1, "more than any node has"),
    ("hosts-not-found", GOOD_JOB, None, [], "hosts", None, "hostfile not found"),
    # --- filters
    ("filter-unknown-host", GOOD_JOB, GOOD_HOSTS, ["--include", "node-z"], "hosts", None, "not in"),
    ("filter-unknown-slot", GOOD_JOB, GOOD_HOSTS, ["--include", "node-a:5"], "hosts", None, "no slot 5"),
    ("filter-both", GOOD_JOB, GOOD_HOSTS, ["--include", "node-a", "--exclude", "node-b"], None, None, "exclusive"),
    ("filter-all-excluded", GOOD_JOB, GOOD_HOSTS, ["--exclude", "node-a@node-b"], "hosts", None, "no hosts"),
    ("filter-too-many-nodes", GOOD_JOB, GOOD_HOSTS, ["--num-nodes", "3"], "hosts", None, "only 2 node(s)"),
    ("filter-too-many-gpus", GOOD_JOB, GOOD_HOSTS, ["--num-gpus", "3"], "hosts", 1, "only 2 slot(s)"),
    # --- job specs
    ("spec-typo", replace_line("  learning_rate:", "  lerning_rate:"), GOOD_HOSTS, [], "job", 11, "did you mean"),
    ("spec-top-typo", replace_line("runtime: docker", "runtim: docker"), GOOD_HOSTS, [], "job", 2, "did you mean"),
    ("spec-bad-enum", replace_line("runtime: docker", "runtime: k8s"), GOOD_HOSTS, [], "job", 2, "'docker'"),
    ("spec-bad-int", replace_line("max_steps: 5", "max_steps: five"), GOOD_HOSTS, [], "job", 10, "integer"),
    ("spec-stage-2", GOOD_JOB + "zero:\n  stage: 2\n", GOOD_HOSTS, [], "job", 15, "zero.stage"),
    (
        "spec-missing-model",
        GOOD_JOB.replace("model:\n  name_or_path: tiny\n  init: random\n", ""),
        GOOD_HOSTS,
        [],
        "job",
        1,
        "model: required key is missing",
    ),
    ("spec-port-range", replace_line("master_port: 29500", "master_port: 80"), GOOD_HOSTS, [], "job", 13, "1024"),
    ("spec-bad-yaml", GOOD_JOB + "train: [\n", GOOD_HOSTS, [], "job", 15, "not valid YAML"),
    ("spec-duplicate-key", GOOD_JOB + "name: again\n", GOOD_HOSTS, [], "job", 14, "duplicate key"),
    ("spec-not-mapping", "- a\n- b\n", GOOD_HOSTS, [], "job", 1, "mapping"),
    ("spec-empty", "", GOOD_HOSTS, [], "job", 1, "empty"),
    ("spec-bad-name", replace_line("name: demo", "name: Demo Job!"), GOOD_HOSTS, [], "job", 1, "name"),
    (
        "spec-env-newline",
        GOOD_JOB.replace("launch:\n", 'launch:\n  env:\n    A: "x\\ny"\n'),
        GOOD_HOSTS,
        [],
        "job",
        14,
        "newline",
    ),
    (
        "spec-env-bad-name",
        GOOD_JOB.replace("launch:\n", "launch:\n  env:\n    1A: x\n"),
        GOOD_HOSTS,
        [],
        "job",
        14,
        "not a valid variable name",
    ),
    (
        "spec-relative-mount",
        GOOD_JOB.replace("launch:\n", "launch:\n  mounts: [data:/data]\n"),
        GOOD_HOSTS,
        [],
        "job",
        13,
        "absolute",
    ),
    (
        "spec-ckpt-yes",
        replace_line("  max_steps: 5", "  gradient_checkpointing: yes-please"),
        GOOD_HOSTS,
        [],
        "job",
        10,
        "true, false, auto or a number of layers",
    ),
    ("set-typo", GOOD_JOB, GOOD_HOSTS, ["--set", "train.lerning_rate=1"], "set", None, "did you mean learning_rate"),
    ("set-bad-value", GOOD_JOB, GOOD_HOSTS, ["--set", "train.max_steps=lots"], "set", None, "integer"),
    ("set-no-equals", GOOD_JOB, GOOD_HOSTS, ["--set", "train.max_steps"], "set", None, "KEY=VALUE"),
    ("set-into-value", GOOD_JOB, GOOD_HOSTS, ["--set", "name.x=1"], "set", None, "is a value"),
    ("spec-not-found", None, GOOD_HOSTS, [], "job", None, "job file not found"),
]


@pytest.mark.parametrize(
    ("job_text", "hosts_text", "extra", "names", "line", "text"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_exits_2_with_one_located_message(sandbox, job_text, hosts_text, extra, names, line, text):
    result, job, hosts, marks = run_dzctl(sandbox, job_text, hosts_text, *extra)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    message = errors[0]
    assert text in message
    if names == "job":
        assert message.startswith(f"error: {job}" + (f":{line}:" if line else ""))
    elif names == "hosts":
        assert str(hosts) in message
        if line:
            assert f"{hosts}:{line}:" in message or f"{hosts}:{line} " in message
    elif names == "set":
        assert message.startswith("error: --set ")
    assert not marks.exists(), f"something ran: {marks.read_text()}"


def test_at_least_25_cases():
    assert len(CASES) >= 25


def test_debug_shows_the_traceback(sandbox):
    result, *_ = run_dzctl(sandbox, GOOD_JOB, "node-a\n")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    tmp_path, bin_dir, _ = sandbox
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    debug = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--debug", "launch", "job.yaml", "--hosts", "hosts.txt"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert "Traceback" in debug.stderr and "HostfileError" in debug.stderr
