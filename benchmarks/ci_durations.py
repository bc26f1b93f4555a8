"""Where CI's time goes: a pytest ``--durations=0`` log grouped by file, by phase and by fixture set-up.

    python3 benchmarks/ci_durations.py LOG [LOG_AFTER]

``LOG`` is the output of ``./dev test --durations=0`` (``.ci/run`` passes its arguments on). With two logs
the tables stand side by side (before, after). Set-up rows are the fixtures a test was the first to need
(a session or module fixture is paid by one test: the cluster, the image build, the Slurm cluster), so the
largest set-ups name the fixtures worth sharing. A last line gives the run's wall time when the log ends
with the ``rc=N wall=S`` line that ``benchmarks/ci_wall.sh`` appends.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

ROW = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)")
SUMMARY = re.compile(r"=+ (.*) in ([\d.]+)s")
WALL = re.compile(r"^rc=(\d+) wall=(\d+)")


def read(path: Path) -> dict:
    rows, summary, wall = [], None, None
    for line in path.read_text(errors="replace").splitlines():
        if m := ROW.match(line):
            rows.append((float(m[1]), m[2], m[3]))
        elif (m := SUMMARY.search(line)) and ("passed" in m[1] or "failed" in m[1]):
            summary = f"{m[1]} in {m[2]} s"
        elif m := WALL.match(line):
            wall = (int(m[1]), int(m[2]))
    return {"rows": rows, "summary": summary, "wall": wall}


def by_file(rows) -> dict[str, collections.Counter]:
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for seconds, phase, test in rows:
        table[test.split("::")[0]][phase] += seconds
    return table


def render(logs: list[dict], names: list[str]) -> str:
    out = []
    tables = [by_file(log["rows"]) for log in logs]
    files = sorted(set().union(*tables), key=lambda f: -sum(tables[0].get(f, collections.Counter()).values()))
    head = "".join(f" {n + ' setup':>14} {n + ' call':>13} {n + ' total':>14}" for n in names)
    out.append(f"{'file':<40}{head}")
    for name in files:
        cells = ""
        for table in tables:
            c = table.get(name, collections.Counter())
            cells += f" {c['setup']:>14.1f} {c['call'] + c['teardown']:>13.1f} {sum(c.values()):>14.1f}"
        out.append(f"{name:<40}{cells}")
    totals = "".join(
        f" {sum(r[0] for r in log['rows'] if r[1] == 'setup'):>14.1f}"
        f" {sum(r[0] for r in log['rows'] if r[1] != 'setup'):>13.1f}"
        f" {sum(r[0] for r in log['rows']):>14.1f}"
        for log in logs
    )
    out.append(f"{'all':<40}{totals}")
    for name, log in zip(names, logs, strict=True):
        out.append("")
        out.append(f"{name}: the 20 largest set-ups (the fixtures a test was first to need)")
        for seconds, _, test in sorted((r for r in log["rows"] if r[1] == "setup"), reverse=True)[:20]:
            out.append(f"  {seconds:8.1f} s  {test}")
        out.append(f"{name}: the 25 longest calls")
        for seconds, _, test in sorted((r for r in log["rows"] if r[1] == "call"), reverse=True)[:25]:
            out.append(f"  {seconds:8.1f} s  {test}")
        out.append(f"{name}: {log['summary']}")
        if log["wall"]:
            out.append(f"{name}: .ci/run exit {log['wall'][0]}, wall {log['wall'][1]} s (setup included)")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--names", nargs="+", default=None)
    args = parser.parse_args()
    names = args.names or (["before", "after"] if len(args.logs) == 2 else [p.stem for p in args.logs])
    print(render([read(p) for p in args.logs], names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
