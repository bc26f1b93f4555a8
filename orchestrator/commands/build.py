"""``dzctl build``: build the image every node runs, with live progress; print its ID and versions."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from ..image.build import FLAVOURS, BuildProgress, BuildRequest, build_image, docker_client, iter_versions, push_image
from ..image.store import fill_store
from .options import json_option


class BuildView:
    """Live view on a terminal (step, elapsed, last lines); one line per step otherwise (CI logs)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live: Live | None = None
        self.last_step: tuple[int, str] | None = None
        self.notes_shown = 0

    def __enter__(self) -> BuildView:
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=8, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, progress: BuildProgress) -> None:
        # The build scripts' own notes (where torch came from, ops left to JIT) are printed as they come.
        for note in progress.notes[self.notes_shown :]:
            self.console.print(note, highlight=False, markup=False)
        self.notes_shown = len(progress.notes)
        step = (progress.step_index, progress.step)
        if self.live:
            lines = [Text(line, style="dim", overflow="ellipsis", no_wrap=True) for line in list(progress.tail)[-4:]]
            head = f"{progress.describe()}  [{progress.elapsed_s:5.0f} s, {progress.cached_steps} cached]"
            self.live.update(Group(Spinner("dots", text=head), *lines))
        elif step != self.last_step and progress.step_count:
            self.console.print(f"[{progress.elapsed_s:6.1f} s] {progress.describe()}", highlight=False)
        self.last_step = step


@click.command("build")
@click.option("--flavour", type=click.Choice(sorted(FLAVOURS)), default="cuda", show_default=True)
@click.option("--base-image", metavar="IMG", help="Base image (default: the flavour's; CUDA: an NVIDIA devel image).")
@click.option(
    "--tag",
    metavar="TAG",
    help="Image tag (default dzctl:<version>-<flavour>, and dzctl:<flavour> as the jobs name it).",
)
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Folder of wheels pip uses first; torch comes from here only (air-gapped clusters).",
)
@click.option(
    "--ca-bundle",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="CA bundle pip trusts during the build (a TLS-intercepting proxy); not kept in the image.",
)
@click.option("--offline", is_flag=True, help="No package index: everything from --wheelhouse.")
@click.option(
    "--torch-index-url",
    metavar="URL",
    help="Index holding the flavour's torch build (default: PyTorch's own; pip's configured sources where it "
    "cannot be reached). pip's other sources are read from its configuration (pip config list).",
)
@click.option("--target", metavar="STAGE", help="Build only up to this Dockerfile stage (system, python).")
@click.option("--push", "registry", metavar="REGISTRY", help="Push the image to REGISTRY afterwards.")
@json_option
def build_command(flavour, base_image, tag, wheelhouse, ca_bundle, offline, torch_index_url, target, registry, as_json):
    """Build the image every node runs and label it with the versions inside it.

    Then push it into the controller's layer store (DZCTL_LAYER_STORE: a folder, or off), from
    which `dzctl distribute` sends every node only the layers it lacks.
    """
    request = BuildRequest(
        flavour=flavour,
        tag=tag,
        base_image=base_image,
        wheelhouse=wheelhouse,
        ca_bundle=ca_bundle,
        offline=offline,
        target=target,
        torch_index_url=torch_index_url,
    )
    console = Console(stderr=True, soft_wrap=True)  # CI logs: one line per step, never wrapped
    client = docker_client()
    with BuildView(console) as view:
        image = build_image(
            request,
            client,
            BuildProgress(on_update=view.update),
            on_note=lambda line: console.print(line, highlight=False),
        )
    if registry:
        image = push_image(client, image, registry, on_line=lambda line: console.print(line, highlight=False))
    # A stage (--target) is not what nodes run; the finished image is stored for distribute.
    stored = None if target else fill_store(client, image.id)
    if stored is not None:
        console.print(stored.note, highlight=False, markup=False)
    if as_json:
        click.echo(json.dumps({**image.to_dict(), "layer_store": stored.to_dict() if stored else None}))
        return
    click.echo(f"image  {image.tag}" + (f" (also {', '.join(image.also_tagged)})" if image.also_tagged else ""))
    click.echo(f"id     {image.id}")
    if image.digest:
        click.echo(f"digest {image.digest}")
    for key, value in iter_versions(image.labels) if image.labels else ():
        click.echo(f"  {key:<25}{value}")
    click.echo(f"built in {image.elapsed_s:.0f} s")


def register(group: click.Group) -> None:
    group.add_command(build_command)
