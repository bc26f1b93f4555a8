"""``dzctl convert FILE [--set ...] [--json]``: the dzctl job a LLaMA-Factory or axolotl YAML becomes, key by key.

Prints the job (after ``--set``, as ``launch`` would run it) and a row for every key of the user's
YAML: mapped to which dzctl key, ignored and why, or refused and why; and the defaults dzctl
filled in. Then the job is loaded as ``launch`` loads it, so a refused key or an invalid value
is the same error (exit 2) here, after the table that explains it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import click

from ...errors import SpecError
from ...spec import foreign
from ...spec.job import apply_override, load_job
from ...spec.yamlsource import load_yaml_with_lines
from ..options import json_option
from .table import render, table_json


@click.command("convert")
@click.argument("job_file", metavar="FILE", type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Set a dzctl key after the conversion (dotted path, YAML-typed value). Repeatable.",
)
@json_option
def convert_command(job_file: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Print the dzctl job a LLaMA-Factory or axolotl YAML becomes, and what became of every key."""
    path = Path(job_file)
    raw, lines = load_yaml_with_lines(path)
    tool = foreign.detect(raw)
    if tool is None:
        raise SpecError(
            f"{path}: not a LLaMA-Factory or axolotl training YAML (their keys, such as model_name_or_path and "
            "cutoff_len, or base_model and datasets, are not there)",
            fix="a dzctl job needs no conversion: check it with `dzctl launch FILE --hosts H --dry-run`",
        )
    conversion = foreign.convert(raw, lines, path)
    job = copy.deepcopy(conversion.data)
    for item in overrides:
        apply_override(job, item)
    refused = conversion.refused(overrides)
    if as_json:
        click.echo(json.dumps(table_json(conversion, job, refused), default=str))
    else:
        click.echo(render(conversion, job, refused))
    # Loaded as launch loads it: a refusal or a value dzctl refuses is exit 2 after the table.
    load_job(path, overrides)


def register(group: click.Group) -> None:
    group.add_command(convert_command)
