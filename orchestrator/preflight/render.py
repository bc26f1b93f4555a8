"""The preflight report for people: a checks × hosts table (hosts × checks past 6 hosts), then the fixes."""

from __future__ import annotations

import io

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .collective_result import describe_collective
from .model import HostReport, PreflightReport
from .runner import CHECK_ORDER

# Up to this many hosts, each is a column (about 16 characters each: fits a 120-column terminal).
MAX_HOST_COLUMNS = 6
MARKS = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]"}


def print_report(report: PreflightReport, console: Console) -> None:
    names = [n for n in CHECK_ORDER if any(h.check(n) for h in report.hosts)]
    table = Table(title=f"preflight: {len(report.hosts)} node(s) in {report.elapsed_s:.1f} s", title_justify="left")
    labels = [f"{h.node_rank}: {h.host}" for h in report.hosts]
    if len(report.hosts) <= MAX_HOST_COLUMNS:
        # Few hosts: one column per host keeps the table narrow enough for a terminal. By the host
        # count alone: `launch` runs more checks than `preflight`, and both must draw the same table.
        table.add_column("check", no_wrap=True)
        for label in labels:
            table.add_column(escape(label), justify="center", no_wrap=True)
        for name in names:
            table.add_row(name, *[_mark(h, name) for h in report.hosts])
    else:
        table.add_column("host", no_wrap=True)
        for name in names:
            table.add_column(name, justify="center", no_wrap=True)
        for label, host in zip(labels, report.hosts, strict=True):
            table.add_row(escape(label), *[_mark(host, name) for name in names])
    console.print(table)
    if report.master_addr:
        nics = ", ".join(f"{h}={i}" for h, i in report.interfaces.items())
        console.print(
            escape(f"master {report.master_addr}:{report.master_port}" + (f"; interfaces {nics}" if nics else ""))
        )
    if report.collective:
        console.print(escape(describe_collective(report.collective)))
    problems = [(h.host, chk) for h in report.hosts for chk in h.checks if chk.status != "ok"]
    for host, chk in problems:
        console.print(f"{MARKS[chk.status]} {escape(host)} {chk.name}: {escape(chk.detail)}")
        console.print(f"    fix: {escape(chk.fix)}")
    if report.ok:
        console.print("[green]all nodes ready[/]" + (" (with warnings)" if problems else ""))


def render_report(report: PreflightReport, width: int = 120) -> str:
    """The same, as plain text (for launch's error output and for logs)."""
    buffer = io.StringIO()
    print_report(report, Console(file=buffer, width=width, color_system=None, highlight=False, soft_wrap=True))
    return buffer.getvalue()


def _mark(host: HostReport, name: str) -> str:
    chk = host.check(name)
    return MARKS[chk.status] if chk else "-"
