"""Preflight's ``weights`` check on real test hosts: a model folder and a cached hub model, on every node.

The models are real: a tiny Qwen3 made with transformers' ``save_pretrained``, once as a
folder and once in the Hugging Face hub cache's layout (``models--ORG--NAME/refs/main``,
``snapshots/<revision>/`` linking into ``blobs/``), which transformers then loads offline:
the layout is the one the ranks read, not a guess at it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.preflight import render_report, run_preflight
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job
from orchestrator.transport.local import LocalConnection
from orchestrator.transport.pool import HostPool

REPO = Path(__file__).resolve().parents[1]
CPU_JOB = REPO / "jobs" / "tiny-cpu.yaml"
HUB_ID = "acme/tiny-qwen3"
REVISION = "0123456789abcdef0123456789abcdef01234567"

MAKE_MODELS = r"""
import hashlib, os, shutil, sys
from pathlib import Path
folder, home, hub_id, revision = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")  # before the import: huggingface_hub reads them once
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("qwen3", vocab_size=384, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
AutoModelForCausalLM.from_config(config).save_pretrained(folder)
# The hub cache's layout, as huggingface_hub writes it: blobs by content hash, a snapshot of links, refs/main.
repo = home / "hub" / ("models--" + hub_id.replace("/", "--"))
snapshot = repo / "snapshots" / revision
snapshot.mkdir(parents=True)
(repo / "blobs").mkdir()
(repo / "refs").mkdir()
(repo / "refs" / "main").write_text(revision)
for file in folder.iterdir():
    blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
    shutil.copyfile(file, blob)
    (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
model = AutoModelForCausalLM.from_pretrained(hub_id)  # what a rank does: the cache must serve it offline
print("loaded", sum(p.numel() for p in model.parameters()))
"""


def _job(port: int, *sets: str):
    base = [f"launch.python={sys.executable}", f"launch.master_port={port}", "model.init=pretrained"]
    return load_job(CPU_JOB, [*base, *sets], "process")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    folder, home = root / "tiny-qwen3", root / "hf"
    made = subprocess.run(
        [sys.executable, "-c", MAKE_MODELS, str(folder), str(home), HUB_ID, REVISION],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0 and "loaded" in made.stdout, made.stderr[-3000:]
    no_weights = root / "config-only"
    no_weights.mkdir()
    shutil.copy(folder / "config.json", no_weights / "config.json")
    return folder, home, no_weights


@pytest.mark.integration
def test_weights_are_looked_for_on_every_node_before_anything_starts(cluster, tmp_path, tiny_models):
    folder, home, no_weights = tiny_models
    hosts = cluster(2)
    nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
    offline = [f"launch.env.HF_HOME={home}", "launch.env.HF_HUB_OFFLINE=1"]
    missing = tmp_path / "nowhere" / "model"
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        found = run_preflight(_job(29661, f"model.name_or_path={folder}"), nodes, pool)
        config_only = run_preflight(_job(29662, f"model.name_or_path={no_weights}"), nodes, pool)
        absent = run_preflight(_job(29663, f"model.name_or_path={missing}"), nodes, pool)
        cached = run_preflight(_job(29664, f"model.name_or_path={HUB_ID}", *offline), nodes, pool)
        not_cached = run_preflight(_job(29665, "model.name_or_path=acme/absent", *offline), nodes, pool)
        tiny = run_preflight(load_job(CPU_JOB, [f"launch.python={sys.executable}"], "process"), nodes, pool)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    for host in found.hosts:
        check = host.check("weights")
        assert check.status == "ok", render_report(found)
        assert check.detail == f"{folder}: config.json and 1 weight file(s), {size / 2**30:.1f} GiB"
    for host in config_only.hosts:
        check = host.check("weights")
        assert check.status == "fail" and check.detail == (
            f"model.name_or_path {no_weights} has no weight files (*.safetensors, pytorch_model*.bin) on {host.host}"
        )
        assert check.fix.startswith(f"put the model (config.json and its weight files) at {no_weights} on {host.host}")
    for host in absent.hosts:
        check = host.check("weights")
        assert check.status == "fail" and check.detail == f"model.name_or_path {missing} does not exist on {host.host}"
    snapshot = home / "hub" / "models--acme--tiny-qwen3" / "snapshots" / REVISION
    for host in cached.hosts:
        check = host.check("weights")
        assert check.status == "ok", check
        assert check.detail.startswith(f"{HUB_ID} (the cached snapshot {snapshot}): config.json and 1 weight file(s)")
    for host in not_cached.hosts:
        check = host.check("weights")
        assert check.status == "fail", check
        assert check.detail == f"acme/absent is not in {host.host}'s hub cache {home}/hub (HF_HUB_OFFLINE is set)"
        assert f"HF_HUB_CACHE={home}/hub hf download acme/absent" in check.fix
    assert all(host.check("weights") is None for host in tiny.hosts)  # random init from model.config: no files


def test_docker_reads_the_cache_through_the_mounts_and_a_read_only_cache_cannot_take_a_download(tmp_path):
    from orchestrator.preflight.loading.weights import check_weights, probe_env, request_for, weights_verdict

    job = load_job(CPU_JOB, ["model.init=pretrained", "model.name_or_path=Qwen/Qwen3-8B"], "docker")
    shipped = job.spec.model_copy(
        update={
            "launch": job.spec.launch.model_copy(
                update={"mounts": ["/srv/data:/data:ro"], "env": {"HF_HOME": "/data/hf"}}
            )
        }
    )
    assert probe_env(shipped) == ({"HF_HOME": "/srv/data/hf"}, False)
    assert request_for(shipped) == {"kind": "hub", "id": "Qwen/Qwen3-8B", "weights": True}
    answer = {"cache": "/srv/data/hf/hub", "offline": False, "revision": None, "hub": "huggingface.co",
              "free_bytes": 2**40, "writable": True}  # fmt: skip
    read_only = weights_verdict(answer, request_for(shipped), "Qwen/Qwen3-8B", "gpu-1", writable=False)
    assert read_only.status == "fail" and "cannot write there to download it" in read_only.detail
    assert "a :rw mount" in read_only.fix
    small = weights_verdict({**answer, "free_bytes": 2**30}, request_for(shipped), "Qwen/Qwen3-8B", "gpu-1",
                            weights_bytes=16 * 2**30)  # fmt: skip
    assert small.status == "fail" and "needs about 16.0 GiB, 1.0 GiB free on gpu-1" in small.detail
    fine = weights_verdict(answer, request_for(shipped), "Qwen/Qwen3-8B", "gpu-1", weights_bytes=16 * 2**30)
    assert fine.status == "ok" and "the ranks download it from huggingface.co" in fine.detail
    # No HF_HOME for a container: its own cache, which the node cannot show; every launch downloads again.
    bare = shipped.model_copy(update={"launch": shipped.launch.model_copy(update={"env": {}})})
    (no_home,) = check_weights(LocalConnection(), _Context(bare))
    assert no_home.status == "warn" and "sets no HF_HOME" in no_home.detail and "launch.env.HF_HOME" in no_home.fix


def test_what_is_looked_for_and_a_missing_shard():
    from orchestrator.preflight.loading.weights import request_for, weights_verdict

    spec = load_job(CPU_JOB, ["model.name_or_path=/models/qwen"], "process").spec
    assert request_for(spec) is None  # random init with model.config.model_type: nothing is read
    named = spec.model_copy(update={"model": spec.model.model_copy(update={"config": None})})
    assert request_for(named) == {"kind": "folder", "path": "/models/qwen", "weights": False}  # config.json only
    answer = {"folder": "/models/qwen", "config": True, "weights": ["a.safetensors", "b.safetensors"],
              "absent": ["b.safetensors"], "weight_bytes": 10}  # fmt: skip
    check = weights_verdict(answer, {"kind": "folder", "weights": True}, "/models/qwen", "n1")
    assert check.status == "fail" and check.detail == "model.name_or_path /models/qwen: b.safetensors missing on n1"


class _Context:
    def __init__(self, spec):
        self.spec, self.python = spec, "python3"


@pytest.mark.integration
def test_launch_refuses_missing_weights_before_it_ships_the_image(cluster, tmp_path):
    from orchestrator.backends import launcher
    from orchestrator.errors import RuntimeFailure

    hosts = cluster(1, docker=True)
    nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
    models = tmp_path / "models"
    models.mkdir()
    sets = [
        "image=dzctl-test/never-built:1",  # on no node and in no daemon: launch would have to ship it
        "model.init=pretrained",
        "model.name_or_path=/models/Qwen3-8B",  # the catalogue gives its shape; no node has it
        f"launch.mounts=[{models}:/models:ro]",
        f"launch.remote_dir=/var/tmp/dzctl-weights-{hosts.cid}",
        "launch.master_port=29666",
    ]
    job = load_job(CPU_JOB, sets, "docker")
    reports = []

    class Progress(launcher.Silent):
        def preflight(self, report, *, final: bool) -> None:
            reports.append(report)

    pool = HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config)
    with pool, pytest.raises(RuntimeFailure, match="preflight failed on 1 of 1 node"):
        launcher.prepare(job, nodes, pool, launcher.LaunchOptions(skip_collective=True), Progress())
    (report,) = reports  # one preflight: no distribution, no second round
    host = report.hosts[0]
    assert host.check("image").status == "fail"
    weights = host.check("weights")
    assert weights.status == "fail" and weights.detail == (
        f"model.name_or_path /models/Qwen3-8B (on the node: {models}/Qwen3-8B) does not exist on {host.host}"
    )
