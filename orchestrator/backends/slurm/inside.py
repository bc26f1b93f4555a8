"""What the batch script runs inside the allocation before training: ``dzctl preflight`` through srun.

    python -m orchestrator.backends.slurm.inside preflight --job-dir D --slots N

The same checks as over SSH (``preflight.run_preflight``), on the nodes Slurm
allotted, each command run on its node as a one-task step
(``srun --overlap --nodelist=H``) instead of over an SSH channel. The report
goes to the batch log (``slurm-<id>.out``) and ``preflight.json`` in the job
dir; a failed check exits 1, and the batch script then ends the job before any
launcher starts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ...spec.hostfile import Node
from ...transport.local import LocalConnection
from ...transport.pool import HostPool
from ...transport.results import Result

MASTER_FILE = "master_addr"
INTERFACES_FILE = "interfaces"
SRUN_STEP = ("srun", "--overlap", "--nodes=1", "--ntasks=1", "--quiet", "--kill-on-bad-exit=0")


class SrunConnection(LocalConnection):
    """A node of the allocation: commands run there as one-task steps; files are on the shared path."""

    def run(self, argv, **kwargs) -> Result:
        result = super().run([*SRUN_STEP, f"--nodelist={self.host}", *argv], **kwargs)
        return Result(result.host, tuple(argv), result.exit_code, result.stdout, result.stderr, result.elapsed_s)


class SrunPool(HostPool):
    """A HostPool whose hosts are the allocation's nodes, reached through srun (no SSH)."""

    def __init__(self, hosts) -> None:
        super().__init__(hosts, ssh_config=None)

    def _open(self, host: str) -> SrunConnection:
        return SrunConnection(host)


def allocated_hosts() -> list[str]:
    import os

    listed = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def preflight(job_dir: Path, slots: int) -> int:
    from rich.console import Console

    from ...preflight import run_preflight
    from ...preflight.render import print_report
    from ...spec.job import load_job

    job = load_job(str(job_dir / "job.yaml"), (), None)
    nodes = [Node(host, tuple(range(slots))) for host in allocated_hosts()]
    with SrunPool([n.host for n in nodes]) as pool:
        report = run_preflight(job, nodes, pool)
    print_report(report, Console(file=sys.stdout, highlight=False, soft_wrap=True, width=120))
    (job_dir / "preflight.json").write_text(json.dumps(report.to_dict()))
    if report.master_addr:
        # The address preflight chose for node 0 (reachable from every node, not a loopback alias):
        # the batch script hands it to the launchers, as the SSH fleet's plan does.
        (job_dir / MASTER_FILE).write_text(report.master_addr + "\n")
    # Each node's NIC toward the master (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME): without it gloo and NCCL
    # may take an address the hostname resolves to (127.0.1.1 in a container) and never connect.
    (job_dir / INTERFACES_FILE).write_text("".join(f"{host} {nic}\n" for host, nic in report.interfaces.items()))
    if not report.ok:
        failed = sorted({host for host, _ in report.failures()})
        print(f"dzctl: preflight failed on {len(failed)} of {len(nodes)} node(s): {', '.join(failed)}; "
              "nothing was started", flush=True)  # fmt: skip
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.backends.slurm.inside")
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("preflight")
    check.add_argument("--job-dir", required=True, type=Path)
    check.add_argument("--slots", required=True, type=int)
    args = parser.parse_args(argv)
    return preflight(args.job_dir, args.slots)


if __name__ == "__main__":
    sys.exit(main())
