"""``dzctl convert``'s output: the job as YAML, then a line per key of the user's YAML (or one JSON object)."""

from __future__ import annotations

import json
from typing import Any

import yaml

from ...spec.keymap import Conversion, KeyRow

SHOWN_VALUE = 48  # characters of a value in the table; longer ones are cut with "..."


def table_json(conversion: Conversion, job: dict[str, Any], refused: list[KeyRow]) -> dict[str, Any]:
    return {
        "file": conversion.source,
        "tool": conversion.tool,
        "job": job,
        "keys": [row.as_json() for row in conversion.rows],
        "refused": [row.key for row in refused],
    }


def render(conversion: Conversion, job: dict[str, Any], refused: list[KeyRow]) -> str:
    """The job as YAML, then the table of every key."""
    counts = {kind: sum(row.outcome == kind for row in conversion.rows) for kind in ("mapped", "ignored", "refused")}
    defaults = sum(row.outcome == "default" for row in conversion.rows)
    out = [
        f"# {conversion.source}: a {conversion.tool} YAML, as the dzctl job it becomes",
        yaml.safe_dump(job, sort_keys=False, allow_unicode=True).rstrip(),
        "",
        f"{conversion.source}: {counts['mapped']} keys mapped, {counts['ignored']} ignored, "
        f"{counts['refused']} refused; {defaults} dzctl keys filled in",
    ]
    answered = {id(row) for row in conversion.rows if row.outcome == "refused"} - {id(row) for row in refused}
    for row in conversion.rows:
        out.append(_table_line(row, answered=id(row) in answered))
    return "\n".join(out)


def _table_line(row: KeyRow, *, answered: bool) -> str:
    where = f"{row.line:>4}" if row.line else "   -"
    if row.outcome == "default":
        return f"{where}  default  {row.target}: {_shown(row.target_value)}  ({row.reason})"
    said = f"{row.key}: {_shown(row.shown_value())}"
    if row.outcome == "mapped":
        reason = f"  ({row.reason})" if row.reason else ""
        return f"{where}  mapped   {said}  ->  {row.target}: {_shown(row.target_value)}{reason}"
    if row.outcome == "refused" and answered:
        return f"{where}  refused  {said}  ({row.reason}; answered by --set {row.lifted_by})"
    return f"{where}  {row.outcome:<8} {said}  ({row.reason})"


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    return text if len(text) <= SHOWN_VALUE else text[: SHOWN_VALUE - 3] + "..."
