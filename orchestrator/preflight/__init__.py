"""Preflight: check every node before launch, in seconds, and say how to fix what is wrong.

``run_preflight(job, nodes, pool)`` returns a ``PreflightReport``: per host a list
of ``Check(name, status ok|warn|fail, detail, fix)``, plus ``master_addr`` and
``interfaces[host]`` (the NIC toward the master) for the launch plan, and
``gpu_mem_gib[host]`` / ``host_mem_gib[host]`` for the memory planner.
``render_report(report)`` gives the table as text; ``print_report`` prints it with colour.
"""

from .model import Check, HostReport, PreflightReport
from .render import print_report, render_report
from .runner import run_preflight

__all__ = ["Check", "HostReport", "PreflightReport", "print_report", "render_report", "run_preflight"]
