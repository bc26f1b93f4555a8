"""A newcomer's first commands (issue 41, items 13, 15, 16, 17, 18): each says what went wrong, where, and the fix.

All cheap: the real CLI in-process (dry runs touch no host), the real SSH path against a name
under the reserved ``.invalid`` top-level domain (RFC 6761: it never resolves), and the real
``./dev demo`` as far as its dry run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.errors import SpecError
from orchestrator.spec.job import load_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "jobs/tiny-cpu.yaml"
QWEN72B = str(ROOT / "jobs/qwen72b.yaml")
QWEN72B_LORA = str(ROOT / "jobs/qwen72b-lora.yaml")
TWO_BY_FOUR = str(ROOT / "hostfiles/2x4.txt")
UNRESOLVABLE = "gpu-node-1.invalid"


def dzctl(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


# -- item 13: a --set value's error names the --set, not a line of the job file ----------------------------
def test_an_invalid_set_data_columns_is_blamed_on_the_set_not_on_a_line_of_the_job_file():
    with pytest.raises(SpecError) as refused:
        load_job(TINY, ["data.columns={bogus: x}"])
    message = str(refused.value)
    assert message.startswith("--set data.columns={bogus: x}: data.columns: 'bogus' is not a field of format alpaca"), (
        message
    )
    assert "tiny-cpu.yaml" not in message


def test_columns_written_in_the_job_file_are_blamed_on_their_own_line(tmp_path):
    data = TINY.parent / "data/tiny-alpaca-zh.jsonl"
    text = TINY.read_text().replace("path: data/tiny-alpaca-zh.jsonl", f"path: {data}")
    text = text.replace("  format: alpaca\n", "  format: alpaca\n  columns: {answer: out}\n")
    job = tmp_path / "job.yaml"
    job.write_text(text)
    line = next(n for n, row in enumerate(text.splitlines(), 1) if "columns:" in row)
    result = dzctl("plan", job, "--hosts", ROOT / "hostfiles/localhost.txt")
    assert result.exit_code == 2, result.output
    assert f"{job}:{line}: data.columns: 'answer' is not a field of format alpaca" in result.output


# -- item 15: a dry run that cannot check the host RAM an offload plan needs is not a success ---------------
def test_a_dry_run_of_an_offload_plan_without_host_ram_asks_for_it_as_for_gpu_memory():
    result = dzctl("launch", QWEN72B, "--hosts", TWO_BY_FOUR, "--dry-run", "--gpu-mem-gib", "40")
    assert result.exit_code == 2, result.output
    assert "704.08 GiB per node" in result.output and "--host-mem-gib" in result.output
    assert "\nfits\n" not in result.output and "Traceback" not in result.output
    as_json = dzctl("launch", QWEN72B, "--hosts", TWO_BY_FOUR, "--dry-run", "--gpu-mem-gib", "40", "--json")
    assert as_json.exit_code == 2 and "--host-mem-gib" in json.loads(as_json.stdout)["fix"]
    # A plan that keeps everything on the GPUs (LoRA) needs no host RAM figure to be checked: it still runs.
    lora = dzctl("launch", QWEN72B_LORA, "--hosts", TWO_BY_FOUR, "--dry-run", "--gpu-mem-gib", "40", "--json")
    assert lora.exit_code == 0, lora.output
    assert json.loads(lora.stdout)["memory"]["zero"] == {"offload_optimizer": False, "offload_param": False}


# -- item 16: a name that does not resolve is named as such, with where the name came from -----------------
def test_a_host_name_that_does_not_resolve_is_named_with_its_fix_not_sshd(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{UNRESOLVABLE} slots=2\n")
    result = dzctl("preflight", TINY, "--hosts", hostfile, "--skip-collective")
    assert result.exit_code == 1, result.output
    assert f"the host name {UNRESOLVABLE} (from the hostfile) does not resolve: Name or service not known" in (
        result.output
    )
    assert "DNS or /etc/hosts" in result.output and "sshd runs" not in result.output


def test_a_hostname_from_the_ssh_config_that_does_not_resolve_names_that_line(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu-node-1\n    HostName {UNRESOLVABLE}\n")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("gpu-node-1 slots=2\n")
    result = dzctl("preflight", TINY, "--hosts", hostfile, "--ssh-config", config, "--skip-collective")
    assert result.exit_code == 1, result.output
    assert f"the name {UNRESOLVABLE} (HostName in the SSH config {config}) does not resolve" in result.output
    assert f"correct HostName for gpu-node-1 in {config}" in result.output


# -- item 17: ./dev demo keeps its state in the checkout and takes a free port -----------------------------
def test_the_demo_writes_inside_this_checkout_and_takes_a_free_port(tmp_path):
    # A venv of links to this one (the interpreter and dzctl), already "installed": ./dev installs nothing.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").symlink_to(sys.executable)
    (venv / "bin/dzctl").symlink_to(Path(sys.executable).parent / "dzctl")
    (venv / ".dzctl-installed").touch()
    env = {k: v for k, v in os.environ.items() if k != "DZCTL_HOME"}
    env["DZCTL_VENV"] = str(venv)
    with socket.socket() as other_checkouts_run:  # another demo's rendezvous store, on torchrun's default port
        try:
            other_checkouts_run.bind(("", 29500))
            other_checkouts_run.listen()
        except OSError:
            pass  # something else holds 29500 already: the demo must still take another
        shown = subprocess.run(
            [str(ROOT / "dev"), "demo", "--dry-run", "--json"], env=env, capture_output=True, text=True, timeout=120
        )
    assert shown.returncode == 0, shown.stderr
    plan = json.loads(shown.stdout)
    state = ROOT / ".dzctl"
    node = plan["nodes"][0]
    assert node["output_dir"] == str(state / "run/output/tiny-cpu"), node
    assert node["job_dir"].startswith(str(state / "run/jobs/")), node
    assert plan["master_port"] != 29500
    assert f"job record in {state / 'home'}" in shown.stderr
    with socket.socket() as probe:  # the port it chose is one nothing listens on
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", plan["master_port"]))


# -- item 18: the Slurm dry run says which defaults a cluster cannot use --------------------------------------
def test_the_slurm_dry_run_warns_of_a_node_local_job_dir_and_the_submitting_python():
    result = CliRunner().invoke(main, ["launch", str(TINY), "--slurm", "--nodes", "2", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "warning: launch.remote_dir is not set: the batch script uses the default /var/tmp/dzctl" in result.stderr
    assert f"warning: slurm.python is not set: the batch script runs this machine's Python, {sys.executable}" in (
        result.stderr
    )
    assert "#SBATCH" in result.stdout and "warning" not in result.stdout
    shared = ["--set", "launch.remote_dir=/shared/dz", "--set", "slurm.python=/shared/venv/bin/python"]
    chosen = CliRunner().invoke(main, ["launch", str(TINY), "--slurm", "--nodes", "2", "--dry-run", *shared])
    assert chosen.exit_code == 0, chosen.output
    assert "warning" not in chosen.stderr
