"""The preflight table has one orientation for a given fleet, whichever command prints it.

`dzctl preflight` and `dzctl launch` print the same report, but launch checks more (the
job's data, its upload): the table's shape must follow the hosts, not how many checks ran.
"""

from __future__ import annotations

from orchestrator.preflight.model import HostReport, PreflightReport, ok
from orchestrator.preflight.render import render_report

PREFLIGHT_CHECKS = ("ssh", "hostname", "route", "master-port", "disk", "infiniband")
LAUNCH_CHECKS = (*PREFLIGHT_CHECKS, "upload", "data", "shm-memlock", "python-env")


def report(hosts: int, checks: tuple[str, ...]) -> PreflightReport:
    nodes = [HostReport(f"node{i}", i, [ok(name, "fine") for name in checks]) for i in range(hosts)]
    return PreflightReport(hosts=nodes, elapsed_s=1.0, master_addr=None, master_port=29500, interfaces={})


def header(text: str) -> list[str]:
    """The table's header cells (the line after the top border)."""
    line = text.splitlines()[2]
    return [cell.strip() for cell in line.strip("┃ ").split("┃")]


def test_preflight_and_launch_draw_the_same_orientation_for_the_same_hosts():
    for hosts in range(1, 13):
        as_preflight = header(render_report(report(hosts, PREFLIGHT_CHECKS), width=400))
        as_launch = header(render_report(report(hosts, LAUNCH_CHECKS), width=400))
        assert as_preflight[0] == as_launch[0], f"{hosts} host(s): {as_preflight[0]} × … vs {as_launch[0]} × …"


def test_few_hosts_are_columns_and_many_hosts_are_rows():
    assert header(render_report(report(2, LAUNCH_CHECKS), width=400))[:3] == ["check", "0: node0", "1: node1"]
    many = header(render_report(report(12, PREFLIGHT_CHECKS), width=400))
    assert many[0] == "host" and many[1:] == list(PREFLIGHT_CHECKS)
