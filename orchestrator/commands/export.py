"""``dzctl export JOB --checkpoint N|latest|best --out DIR [--adapter]``: a checkpoint out as Hugging Face weights."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from ..backends.slurm.backend import is_slurm
from ..export.choose import parse_which
from ..export.run import Progress, export_checkpoint
from ..observe.store import JobStore
from ..transport.pool import HostPool
from .options import json_option, ssh_options

MB = 10**6
LINE_EVERY_S = 5.0  # off a terminal: a progress line this often (CI logs), as distribute does


class ByteLines:
    """Bytes so far against bytes planned, on stderr: redrawn on a terminal, a line every few seconds elsewhere."""

    def __init__(self, what: str, stream=None) -> None:
        self.what = what
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.shown_at = 0.0
        self.finished = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        last = done >= total
        if self.finished or (not last and now - self.shown_at < (0.5 if self.tty else LINE_EVERY_S)):
            return
        self.shown_at = now
        seconds = now - self.started
        rate = f", {done / MB / seconds:.1f} MB/s" if seconds > 0 else ""
        share = f" ({100 * done / total:.0f}%)" if total else ""
        text = f"{self.what}: {done / MB:,.1f} of {total / MB:,.1f} MB{share}{rate}"
        if self.tty:
            self.stream.write("\r" + text + ("\n" if last else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.finished = last


@click.command("export")
@click.argument("job_ref", metavar="JOB")
@click.option("--checkpoint", "which", required=True, metavar="N|latest|best", help="The checkpoint to export.")
@click.option(
    "--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path), help="A new folder for it."
)
@click.option("--adapter", is_flag=True, help="LoRA: the PEFT adapter alone (default: merged full weights).")
@ssh_options
@json_option
def export_command(job_ref, which, out, adapter, ssh_config, trust_new_hosts, as_json):
    """Write a checkpoint of JOB (name or id) as Hugging Face safetensors, checked with from_pretrained."""
    wanted = parse_which(which)
    with JobStore() as store:
        record = store.get(job_ref)
    say = (lambda text: None) if as_json else (lambda text: click.echo(text, err=True))
    progress = Progress(
        phase=lambda text: click.echo(text, err=True),
        gathered=ByteLines("gathered"),
        written=ByteLines("written"),
        # The consolidation's own output (DeepSpeed's, transformers'): only with --debug.
        note=(lambda text: click.echo(text, err=True)) if _debug() else (lambda text: None),
    )
    if is_slurm(record):
        # A Slurm job's output dir is shared storage the submit host sees: read in place.
        exported = export_checkpoint(record, None, wanted, out, adapter=adapter, progress=progress)
    else:
        pool = HostPool(record.hosts, ssh_config=ssh_config or record.ssh_config, trust_new_hosts=trust_new_hosts)
        with pool:
            exported = export_checkpoint(record, pool, wanted, out, adapter=adapter, progress=progress)
    if as_json:
        click.echo(json.dumps(exported.to_dict()))
        return
    plan = exported.plan
    kind = "PEFT adapter" if plan.adapter else "merged LoRA weights" if plan.method == "lora" else "weights"
    click.echo(
        f"exported {plan.checkpoint} of {plan.job_id} ({kind}, {plan.dtype}) to {exported.out}: "
        f"{exported.result.get('tensors')} tensors checked against the shards after loading with "
        f"{'PeftModel.from_pretrained' if plan.adapter else 'from_pretrained'}"
    )
    say(f"took {exported.seconds.get('total_s', 0):.1f} s; source: {exported.source}")


def _debug() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.find_root().params.get("debug"))


def register(group: click.Group) -> None:
    group.add_command(export_command)
