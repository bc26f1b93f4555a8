"""``dzctl distribute IMAGE --hosts FILE``: every node ends with the same image ID."""

from __future__ import annotations

import json
import time

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ..image.distribute import DistributeResult, Progress, distribute_image, distribute_via_registry
from ..transport.pool import HostPool
from .options import hosts_options, json_option, nodes_from_options, ssh_options

MB = 1e6


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / MB / seconds:6.1f} MB/s" if seconds > 0 else "-"


class DistributeView:
    """Per-node bytes and throughput: live on a terminal, a line every 5 s otherwise (CI logs)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live: Live | None = None
        self.last_line = 0.0

    def __enter__(self) -> DistributeView:
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=4, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, progress: Progress) -> None:
        elapsed = progress.elapsed_s
        saved = f"saved {progress.raw_bytes / MB:,.0f} MB (image {progress.expected_raw / MB:,.0f} MB)"
        head = f"{saved}, on the wire {progress.wire_bytes / MB:,.0f} MB, {elapsed:.0f} s"
        if self.live:
            table = Table(title=head, title_justify="left", box=None)
            for column in ("node", "state", "sent", "rate"):
                table.add_column(column)
            for host, sent in progress.sent.items():
                table.add_row(host, progress.state.get(host, ""), f"{sent / MB:,.0f} MB", _rate(sent, elapsed))
            self.live.update(table)
        elif time.monotonic() - self.last_line >= 5:
            self.last_line = time.monotonic()
            nodes = ", ".join(f"{h} {s / MB:,.0f} MB {progress.state.get(h, '')}" for h, s in progress.sent.items())
            self.console.print(f"[{elapsed:6.1f} s] {head}; {nodes}", highlight=False)


def render(result: DistributeResult) -> str:
    lines = [f"image {result.image}  id {result.image_id}"]
    if result.codec and result.codec != "registry":
        ratio = f" ({result.wire_bytes / result.raw_bytes:.0%} of raw)" if result.raw_bytes else ""
        lines.append(
            f"saved once: {result.raw_bytes / MB:,.0f} MB, sent {result.wire_bytes / MB:,.0f} MB per node "
            f"as {result.codec}{ratio}"
        )
    for outcome in result.hosts.values():
        rate = f"  {_rate(outcome.bytes_sent, outcome.elapsed_s)}" if outcome.status == "loaded" else ""
        sent = f"  {outcome.bytes_sent / MB:,.1f} MB" if outcome.status != "present" else ""
        held = f"  (had {outcome.layers_held}/{outcome.layers_total} layers)" if outcome.layers_held else ""
        via = f"  via {outcome.ssh_client}" if outcome.ssh_client else ""
        lines.append(
            f"  {outcome.host:<20} {outcome.status:<8} {outcome.elapsed_s:6.1f} s{sent}{rate}{held}{via}  "
            f"{outcome.detail}"
        )
    lines.extend(f"note: {note}" for note in result.notes)
    lines.append(f"{'done' if result.ok else 'FAILED'} in {result.elapsed_s:.1f} s")
    return "\n".join(lines)


@click.command("distribute")
@click.argument("image")
@hosts_options
@ssh_options
@click.option(
    "--codec",
    type=click.Choice(["auto", "zstd", "gzip", "none"]),
    default="auto",
    show_default=True,
    help="Compression on the wire (auto: zstd where every node has it, else gzip).",
)
@click.option(
    "--ssh-client",
    type=click.Choice(["auto", "openssh", "paramiko"]),
    default="auto",
    show_default=True,
    envvar="DZCTL_SSH_CLIENT",
    help="What carries the image streams (auto: the system's ssh where it reaches the node, else paramiko; "
    "env DZCTL_SSH_CLIENT).",
)
@click.option("--push", "registry", metavar="REGISTRY", help="Push to REGISTRY and have every node pull instead.")
@json_option
def distribute_command(
    image,
    hostfile,
    include,
    exclude,
    num_nodes,
    num_gpus,
    ssh_config,
    trust_new_hosts,
    codec,
    ssh_client,
    registry,
    as_json,
):
    """Give every node IMAGE by ID: skip nodes that have it, stream `docker save` once to the rest,
    leaving out the layers each node already holds (after a code change: only the new layers, from
    the controller's layer store, see DZCTL_LAYER_STORE)."""
    nodes = nodes_from_options(hostfile, include, exclude, num_nodes, num_gpus)
    console = Console(stderr=True, soft_wrap=True)  # CI logs: one line per report, never wrapped
    with HostPool([n.host for n in nodes], ssh_config=ssh_config, trust_new_hosts=trust_new_hosts) as pool:
        if registry:
            result = distribute_via_registry(image, nodes, pool, registry)
        else:
            with DistributeView(console) as view:
                result = distribute_image(
                    image, nodes, pool, codec=codec, on_progress=view.update, ssh_client=ssh_client
                )
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        click.echo(render(result))
    result.raise_on_failure()


def register(group: click.Group) -> None:
    group.add_command(distribute_command)
