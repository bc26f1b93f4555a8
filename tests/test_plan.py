"""The launch plan, compared as whole values (TorchX's docker scheduler test style)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.planning.launchplan import LaunchPlan, NodePlan, make_plan
from orchestrator.spec.hostfile import Node, load_nodes
from orchestrator.spec.job import load_job

ROOT = Path(__file__).resolve().parents[1]
JOB_ID = "qwen72b-20261130-000000-abcd"


def _docker_argv(rank: int, master: str, env: dict[str, str], env_file: bool = False) -> tuple[str, ...]:
    return (
        "docker", "run", "--detach", "--name", f"dzctl-{JOB_ID}-{rank}",
        "--label", "dzctl.job=qwen72b", "--label", f"dzctl.job-id={JOB_ID}", "--label", f"dzctl.node-rank={rank}",
        "--network", "host", "--ipc", "host",
        "--ulimit", "memlock=-1", "--ulimit", "stack=67108864", "--init",
        "--gpus", '"device=0,1,2,3"',
        *(("--env-file", f"/var/tmp/dzctl/jobs/{JOB_ID}/env") if env_file else ()),
        *(item for key, value in sorted(env.items()) for item in ("--env", f"{key}={value}")),
        "--volume", f"/var/tmp/dzctl/jobs/{JOB_ID}:/job:ro",
        "--volume", "/var/tmp/dzctl/output/qwen72b:/var/tmp/dzctl/output/qwen72b:rw",
        "--volume", "/data:/data:ro",
        "--workdir", "/job", "dzctl:cuda",
        *_torchrun(rank, master),
    )  # fmt: skip


def _torchrun(rank: int, master: str) -> tuple[str, ...]:
    return (
        "torchrun", "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "4",
        "--master_addr", master, "--master_port", "29500", "-m", "orchestrator.train", "/job/job.yaml",
    )  # fmt: skip


def _env(rank: int) -> dict[str, str]:
    return {
        "DZCTL_JOB": "qwen72b",
        "DZCTL_JOB_ID": JOB_ID,
        "DZCTL_NODE_RANK": str(rank),
        "DZCTL_NUM_NODES": "2",
        "HF_HOME": "/data/hf",
        "PYTHONUNBUFFERED": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def test_qwen72b_on_two_nodes_of_four_gpus():
    job = load_job(ROOT / "jobs/qwen72b.yaml")
    nodes = load_nodes(ROOT / "hostfiles/2x4.txt")
    plan = make_plan(job.spec, nodes, JOB_ID)
    expected = LaunchPlan(
        job="qwen72b",
        job_id=JOB_ID,
        runtime="docker",
        image="dzctl:cuda",
        accelerator="gpu",
        world_size=8,
        master_addr="gpu-node-1",
        master_port=29500,
        nodes=tuple(
            NodePlan(
                host=host,
                node_rank=rank,
                slots=4,
                gpus=(0, 1, 2, 3),
                job_dir=f"/var/tmp/dzctl/jobs/{JOB_ID}",
                output_dir="/var/tmp/dzctl/output/qwen72b",
                container_name=f"dzctl-{JOB_ID}-{rank}",
                env=_env(rank),
                command=_torchrun(rank, "gpu-node-1"),
                argv=_docker_argv(rank, "gpu-node-1", _env(rank)),
            )
            for rank, host in enumerate(["gpu-node-1", "gpu-node-2"])
        ),
        secret_env=(),
    )
    assert plan == expected


def test_preflight_findings_and_secrets_reach_every_node():
    job = load_job(ROOT / "jobs/qwen72b.yaml", ["launch.env.HF_TOKEN=hf_secret_value"])
    nodes = load_nodes(ROOT / "hostfiles/2x4.txt")
    plan = make_plan(
        job.spec,
        nodes,
        JOB_ID,
        master_addr="10.0.0.1",
        interfaces={"gpu-node-1": "ens1", "gpu-node-2": "ens2"},
    )
    for rank, nic in enumerate(["ens1", "ens2"]):
        node = plan.nodes[rank]
        assert node.env == {
            **_env(rank),
            "GLOO_SOCKET_IFNAME": nic,
            "NCCL_SOCKET_IFNAME": nic,
            "HF_TOKEN": "***",
        }
        nic_env = {"GLOO_SOCKET_IFNAME": nic, "NCCL_SOCKET_IFNAME": nic}
        # The secret travels in the 0600 env file; its name and value never sit in argv.
        assert node.argv == _docker_argv(rank, "10.0.0.1", {**_env(rank), **nic_env}, env_file=True)
    assert plan.secret_env == ("HF_TOKEN",)
    assert "hf_secret_value" not in json.dumps(plan.to_dict())


def test_gpu_subset_and_process_runtime():
    job = load_job(ROOT / "jobs/qwen3-8b.yaml", runtime="process")
    plan = make_plan(job.spec, [Node("gpu-node-2", (1, 3))], "j-1")
    (node,) = plan.nodes
    assert node.gpus == (1, 3)
    assert node.env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert node.container_name is None
    assert plan.image is None
    assert node.argv == (
        "python3", "-m", "orchestrator.runtimes.process", "start", "--job-dir", "/var/tmp/dzctl/jobs/j-1",
        "--rank", "0",
        "--env", "CUDA_VISIBLE_DEVICES=1,3", "--env", "DZCTL_JOB=qwen3-8b", "--env", "DZCTL_JOB_ID=j-1",
        "--env", "DZCTL_NODE_RANK=0", "--env", "DZCTL_NUM_NODES=1", "--env", "HF_HOME=/data/hf",
        "--env", "PYTHONUNBUFFERED=1", "--env", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "--",
        "python3", "-m", "torch.distributed.run", "--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "2",
        "--master_addr", "gpu-node-2", "--master_port", "29500", "-m", "orchestrator.train",
        "/var/tmp/dzctl/jobs/j-1/job.yaml",
    )  # fmt: skip


def test_cpu_job_gets_no_gpus_and_the_cpu_accelerator():
    job = load_job(ROOT / "jobs/tiny-cpu.yaml")
    plan = make_plan(job.spec, [Node("h0", (0, 1)), Node("h1", (0, 1))], "t-1")
    assert [n.gpus for n in plan.nodes] == [(), ()]
    assert all("--gpus" not in n.argv for n in plan.nodes)
    assert all(n.env["DS_ACCELERATOR"] == "cpu" for n in plan.nodes)
    assert plan.world_size == 4


def test_deepspeed_launcher_and_host_placeholder():
    job = load_job(
        ROOT / "jobs/qwen72b.yaml",
        ["launch.launcher=deepspeed", "launch.remote_dir=/shared/dz/{host}", "launch.master_addr=10.1.1.1"],
    )
    plan = make_plan(job.spec, load_nodes(ROOT / "hostfiles/2x4.txt"), JOB_ID)
    node = plan.nodes[1]
    assert node.job_dir == f"/shared/dz/gpu-node-2/jobs/{JOB_ID}"
    assert node.output_dir == "/shared/dz/gpu-node-2/output/qwen72b"
    assert node.command == (
        "deepspeed", "--no_ssh", "--num_nodes", "2", "--node_rank", "1", "--num_gpus", "4",
        "--master_addr", "10.1.1.1", "--master_port", "29500", "--module", "orchestrator.train", "/job/job.yaml",
    )  # fmt: skip


def test_dry_run_json_for_the_mission_example():
    result = CliRunner().invoke(
        main,
        [
            "launch", str(ROOT / "jobs/qwen72b.yaml"), "--hosts", str(ROOT / "hostfiles/2x4.txt"),
            "--dry-run", "--json",
            # The dry run plans memory as the launch does: on remote nodes it is told what they have.
            "--gpu-mem-gib", "140", "--host-mem-gib", "2048",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"job", "job_id", "world_size", "master_addr", "master_port", "nodes"} <= set(data)
    assert data["world_size"] == 8
    assert [(n["host"], n["node_rank"], n["slots"]) for n in data["nodes"]] == [
        ("gpu-node-1", 0, 4),
        ("gpu-node-2", 1, 4),
    ]
    for node in data["nodes"]:
        argv = node["argv"]
        assert argv[argv.index("--master_addr") + 1] == data["master_addr"]
        assert argv[argv.index("--master_port") + 1] == str(data["master_port"])
        assert {"host", "node_rank", "slots", "gpus", "argv", "env"} <= set(node)


def test_infiniband_nodes_get_the_verbs_devices_and_nothing_more():
    job = load_job(ROOT / "jobs/qwen72b.yaml")
    plan = make_plan(
        job.spec, load_nodes(ROOT / "hostfiles/2x4.txt"), JOB_ID, infiniband_hosts=frozenset({"gpu-node-2"})
    )
    with_ib, without = plan.nodes[1].argv, plan.nodes[0].argv
    at = with_ib.index("--device")
    assert with_ib[at : at + 2] == ("--device", "/dev/infiniband")
    assert with_ib[:at] + with_ib[at + 2 :] == _docker_argv(1, "gpu-node-1", _env(1))
    assert without == _docker_argv(0, "gpu-node-1", _env(0))
    assert "--privileged" not in with_ib
