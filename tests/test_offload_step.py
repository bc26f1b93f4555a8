"""An offloaded optimizer's host step is in the predicted step, at the rate each node measures (issue 42)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.planning.speed.offload import HostOptimizer, host_optimizer_from_nodes, offloaded_optimizer_seconds
from orchestrator.preflight.checks import HOST_ADAM_PROBE, PYTHON_PROBE

ROOT = Path(__file__).resolve().parents[1]


def _plan_json(tmp_path: Path, *extra: str) -> dict:
    """The seed's regime: Qwen3-8B full fine-tuning on one node of 4 × A100-40GB, the optimizer offloaded."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("gpu-node-1 slots=4\n", encoding="utf-8")
    args = ["plan", str(ROOT / "jobs/qwen3-8b.yaml"), "--hosts", str(hosts), "--gpu-mem-gib", "40"]
    args += ["--host-mem-gib", "512", "--gpu-kind", "A100", "--json", *extra]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_offloaded_step_counts_the_hosts_adamw_over_every_rank_of_the_node(tmp_path):
    without = _plan_json(tmp_path)
    assert without["zero"]["offload_optimizer"] is True
    assert without["step_time"]["optimizer_s"] == 0.0
    assert without["step_time"]["offload_modelled"] is False

    planned = _plan_json(tmp_path, "--host-adam-rate", "1.0")
    speed = planned["step_time"]
    # 8.19 B trained parameters, all on this one node's host, stepped at 1e9 a second.
    trained = planned["trainable_params"]
    assert abs(speed["optimizer_s"] - trained / 1e9) < 0.01
    assert speed["offload_modelled"] is True
    assert speed["optimizer_step_s"] > without["step_time"]["optimizer_step_s"] + 8.0
    assert any("--host-adam-rate 1" in note for note in speed["notes"])
    # A node twice as slow doubles the host's part.
    slower = _plan_json(tmp_path, "--host-adam-rate", "0.5")["step_time"]
    assert abs(slower["optimizer_s"] - 2 * speed["optimizer_s"]) < 0.02


def test_the_slowest_node_sets_the_rate_and_the_copy_up_adds_to_it():
    host = host_optimizer_from_nodes(
        {
            "node0": {"host_adam_params_per_s": 2.0e9, "h2d_bytes_per_s": 25e9},
            "node1": {"host_adam_params_per_s": 0.5e9, "h2d_bytes_per_s": 50e9},
            "node2": {},  # measured nothing (no offload considered there): ignored
        }
    )
    assert host is not None and host.adam_params_per_s == 0.5e9 and host.h2d_bytes_per_s == 25e9
    assert "node1" in host.source
    # 1e9 parameters per GPU, 4 GPUs: 4e9 on the host at 0.5e9/s, and each GPU's 2 GB back up at 25 GB/s.
    assert abs(offloaded_optimizer_seconds(host, 1e9, 4, 2) - (8.0 + 0.08)) < 1e-9
    assert offloaded_optimizer_seconds(host, 1e9, 4, 2, ratio=0.5) == offloaded_optimizer_seconds(host, 0.5e9, 4, 2)
    assert host_optimizer_from_nodes({"node0": {}}) is None
    assert HostOptimizer(1e9, None, "x").describe() == "host AdamW 1.00 G params/s (x)"


def test_the_python_probe_measures_the_hosts_adamw_rate():
    """The probe's host-AdamW part, as preflight runs it on every node, here with this machine's torch."""
    assert HOST_ADAM_PROBE in PYTHON_PROBE
    script = "import json, os\nout = {}\n" + HOST_ADAM_PROBE + "\nprint(json.dumps(out))"
    env = {**os.environ, "DZ_HOST_ADAM": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    out = json.loads(result.stdout.splitlines()[-1])
    assert "host_adam_error" not in out, out
    assert out["host_adam_params_per_s"] > 1e7  # this 2-core machine: about 4e8
    assert "h2d_bytes_per_s" not in out  # no GPU here


def test_a_gpu_kind_never_measured_gets_the_datasheet_model_and_the_plan_says_so(tmp_path):
    per_token = {}
    for kind in ("L40S", "B200", "A100-40GB"):
        speed = _plan_json(tmp_path, "--gpu-kind", kind)["step_time"]
        assert speed["predicted"] is True and speed["gpu"] == kind
        assert "datasheet model" in speed["mfu_source"] and "never measured" in speed["mfu_source"]
        per_token[kind] = speed["compute_s"] / speed["tokens_per_micro_step"]
    # The same plan and the same stated MFU: compute time per token follows the datasheets' peaks alone.
    assert abs(per_token["L40S"] / per_token["B200"] - 2250 / 362) < 1e-3
    assert abs(per_token["A100-40GB"] / per_token["B200"] - 2250 / 312) < 1e-3
    h100 = _plan_json(tmp_path, "--gpu-kind", "H100")["step_time"]
    assert "datasheet model" not in h100["mfu_source"]
