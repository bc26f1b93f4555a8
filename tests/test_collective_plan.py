"""The collective check starts exactly what the training start would, with its own module instead of the trainer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.planning.launchplan import make_plan
from orchestrator.preflight.collective import (
    CHECK_ENV,
    CollectiveRequest,
    collective_plan,
    planned_bucket_bytes,
    settings_for,
)
from orchestrator.preflight.model import PreflightReport
from orchestrator.spec.hostfile import Node
from orchestrator.spec.job import load_job

ROOT = Path(__file__).resolve().parents[1]
NODES = [Node("gpu-a", (0, 1, 2, 3)), Node("gpu-b", (0, 1, 2, 3))]
REPORT = PreflightReport(
    hosts=[],
    elapsed_s=1.0,
    master_addr="10.0.0.1",
    master_port=29500,
    interfaces={"gpu-a": "ens5", "gpu-b": "ens6"},
    infiniband={"gpu-b": ["uverbs0"]},
)
MODULE_ARGS = ("orchestrator.train.collective", "--bytes", str(256 * 2**20), "--iters", "20", "--per-round", "4",
               "--warmup", "5", "--timeout", "180")  # fmt: skip


@pytest.mark.parametrize("runtime", ["docker", "process"])
def test_the_check_plan_is_the_job_plan_with_the_check_module_and_nccl_debug(runtime):
    job = load_job(ROOT / "jobs/qwen3-8b.yaml", ["launch.env.HF_TOKEN=hf_secret_value"], runtime=runtime)
    settings = settings_for(job.spec, CollectiveRequest())
    check = collective_plan(job.spec, NODES, REPORT, "j-1-nccl", settings)
    # What the training start would run with the same preflight findings, minus the secret.
    no_secret = job.spec.model_copy(
        update={"launch": job.spec.launch.model_copy(update={"env": {"HF_HOME": "/data/hf", **CHECK_ENV}})}
    )
    expected = make_plan(
        no_secret, NODES, "j-1-nccl", master_addr="10.0.0.1", interfaces=REPORT.interfaces,
        infiniband_hosts=frozenset({"gpu-b"}),
    )  # fmt: skip
    for node, job_node in zip(check.nodes, expected.nodes, strict=True):
        assert node.command[-len(MODULE_ARGS) :] == MODULE_ARGS
        # Same launcher, ranks, master, image, flags, labels, NIC variables: only the module differs.
        cut = len(MODULE_ARGS)
        assert node.command[:-cut] == job_node.command[:-2]
        assert node.argv[:-cut] == job_node.argv[:-2]
        assert node.env == job_node.env
        assert node.env["NCCL_DEBUG"] == "INFO" and node.env["NCCL_SOCKET_IFNAME"] == REPORT.interfaces[node.host]
        # No secret, so no env file the check would need on the node.
        assert "hf_secret_value" not in " ".join(node.argv) and "--env-file" not in node.argv
    assert replace(check, nodes=()) == replace(expected, nodes=())
    if runtime == "docker":
        argv = check.nodes[1].argv
        assert argv[argv.index("--device") : argv.index("--device") + 2] == ("--device", "/dev/infiniband")
        assert "dzctl.job=qwen3-8b" in argv and "dzctl.job-id=j-1-nccl" in argv
        assert check.nodes[0].container_name == "dzctl-j-1-nccl-0"


def test_cpu_jobs_use_a_small_message():
    job = load_job(ROOT / "jobs/tiny-cpu.yaml")
    settings = settings_for(job.spec, CollectiveRequest(timeout_s=20))
    assert (settings.size_bytes, settings.iters, settings.warmup, settings.timeout_s) == (8 * 2**20, 3, 1, 20)


def test_on_gpus_the_zero3_collectives_take_the_planned_bucket_sizes_and_cpu_jobs_keep_the_small_one():
    job = load_job(ROOT / "jobs/qwen3-8b.yaml")
    ds_config = {"zero_optimization": {"reduce_bucket_size": 16_777_216, "stage3_prefetch_bucket_size": 15_099_494}}
    assert planned_bucket_bytes(ds_config, "gpu") == {"gather_bytes": 30_198_988, "reduce_bytes": 33_554_432}
    assert planned_bucket_bytes(ds_config, "cpu") == {} and planned_bucket_bytes({}, "gpu") == {}
    request = CollectiveRequest(**planned_bucket_bytes(ds_config, "gpu"))
    check = collective_plan(job.spec, NODES, REPORT, "j-1-nccl", settings_for(job.spec, request))
    tail = check.nodes[0].command[-4:]
    assert tail == ("--gather-bytes", "30198988", "--reduce-bytes", "33554432")
