"""The dzctl command line: a thin click layer and the one place errors become exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 bad input (usage, spec, hostfile).
Users see a message and a fix, never a traceback, unless ``--debug``.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from . import __version__
from .commands import COMMANDS
from .errors import DzError


class DzGroup(click.Group):
    """Commands load on first use (see commands.COMMANDS); errors become exit codes here."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        if name not in self.commands:
            importlib.import_module(COMMANDS[name]).register(self)
        return self.commands.get(name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DzError as exc:
            if _debug_requested():
                raise
            _report(exc)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("dzctl: interrupted", err=True)
            sys.exit(130)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as exc:  # a bug in dzctl: still no traceback for users
            if _debug_requested():
                raise
            click.echo(f"error: internal error: {type(exc).__name__}: {exc}", err=True)
            click.echo("fix: run again with --debug for the traceback, and report it", err=True)
            sys.exit(1)


def _debug_requested() -> bool:
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx else None
    return bool(root and root.params.get("debug"))


def _report(exc: DzError) -> None:
    for line in exc.message.splitlines():
        click.echo(f"error: {line}", err=True)
    if exc.fix:
        click.echo(f"fix: {exc.fix}", err=True)


@click.group(cls=DzGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.version_option(__version__, prog_name="dzctl")
def main(debug: bool) -> None:
    """Launch DeepSpeed ZeRO-3 fine-tuning across GPU nodes, one container per node."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
