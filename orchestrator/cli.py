"""The dzctl command line: a thin click layer and the one place errors become exit codes.

Exit codes: 0 ok, 1 runtime failure, 2 bad input (usage, spec, hostfile).
Users see a message and a fix, never a traceback, unless ``--debug``.
"""

from __future__ import annotations

import importlib
import json
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
        # Before click consumes them: a usage error comes before --json's own callback could run.
        raw = [*getattr(ctx, "_protected_args", []), *ctx.args]
        wants_json = "--json" in (raw[: raw.index("--")] if "--" in raw else raw)
        stdout = _WatchedStream(sys.stdout)
        sys.stdout = stdout
        try:
            return super().invoke(ctx)
        except DzError as exc:
            if _debug_requested():
                raise
            _report(exc)
            _json_error(wants_json, stdout, exc.message, exc.fix, exc.exit_code)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("dzctl: interrupted", err=True)
            _json_error(wants_json, stdout, "interrupted", None, 130)
            sys.exit(130)
        except click.ClickException as exc:
            _json_error(wants_json, stdout, exc.format_message(), "see `dzctl COMMAND --help`", exc.exit_code)
            raise
        except (click.exceptions.Exit, SystemExit):
            raise
        except Exception as exc:  # a bug in dzctl: still no traceback for users
            if _debug_requested():
                raise
            message = f"internal error: {type(exc).__name__}: {exc}"
            fix = "run again with --debug for the traceback, and report it"
            click.echo(f"error: {message}", err=True)
            click.echo(f"fix: {fix}", err=True)
            _json_error(wants_json, stdout, message, fix, 1)
            sys.exit(1)
        finally:
            if sys.stdout is stdout:
                sys.stdout = stdout.stream


class _WatchedStream:
    """sys.stdout, noting whether the command printed anything (its JSON result) before it failed."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.written = False

    def write(self, text: str) -> int:
        self.written = self.written or bool(text.strip())
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _json_error(wants_json: bool, stdout: _WatchedStream, message: str, fix: str | None, exit_code: int) -> None:
    """With --json, a failure is one JSON object on stdout too, so a script always reads one object:
    ``{"error", "fix", "exit_code"}``; unless the command already printed its own (e.g. preflight's
    report with ok: false), which stays the one object."""
    if wants_json and not stdout.written:
        stdout.stream.write(json.dumps({"error": message, "fix": fix, "exit_code": exit_code}) + "\n")
        stdout.stream.flush()


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
