"""One error root for everything dzctl reports to a user.

Only the CLI turns these into exit codes (see ``cli.py``): a ``DzError`` carries
the message and, where one is known, the fix. Subclasses say which exit code
applies: bad input (2) or a runtime failure (1).
"""

from __future__ import annotations


class DzError(Exception):
    """Root of every error dzctl means to show a user (no traceback)."""

    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message


class InputError(DzError):
    """Bad input: usage, job spec, hostfile, filters. Exit code 2."""

    exit_code = 2


class SpecError(InputError):
    """A job spec value is wrong; the message starts with ``file:line: key.path:``."""


class HostfileError(InputError):
    """A hostfile or host filter is wrong; the message starts with ``file:line:``."""


class RuntimeFailure(DzError):
    """Something on the hosts or in the job failed. Exit code 1."""


class RemoteError(RuntimeFailure):
    """A command on a host failed or the host could not be reached."""


def located(source: str, line: int | None, message: str) -> str:
    """Prefix a message with ``source:line:`` the way compilers do, so editors can jump to it."""
    return f"{source}:{line}: {message}" if line else f"{source}: {message}"
