"""What a command on a host gave back (``Result``), and a fan-out's outcome per host (``GroupResult``)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from ..errors import RemoteError

NO_EXIT_STATUS = -1  # what paramiko reports when no exit-status arrived


@dataclass(frozen=True)
class Result:
    """One command's outcome on one host."""

    host: str
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self) -> Result:
        """Return self, or raise ``RemoteError`` naming the host, command and stderr."""
        if self.exit_code != 0:
            tail = (self.stderr or self.stdout).strip()[-2000:]
            raise RemoteError(
                f"{self.host}: `{shlex.join(self.argv)}` {self.how_it_ended}" + (f": {tail}" if tail else "")
            )
        return self

    @property
    def how_it_ended(self) -> str:
        if self.exit_code == NO_EXIT_STATUS:
            # sshd sends exit-signal instead of exit-status for a command killed by a signal
            # (paramiko does not decode it), and nothing when the session is torn down.
            return "ended without an exit status (killed by a signal, or the session dropped)"
        if self.exit_code < 0:
            return f"was killed by signal {-self.exit_code}"  # subprocess's convention, local hosts
        return f"exited {self.exit_code}"


class GroupResult(dict):
    """``{host: value | Exception}`` for every host of a fan-out, in host order.

    Like Fabric's GroupResult: a failed host never hides the others' results.
    """

    @property
    def succeeded(self) -> dict[str, Any]:
        return {h: v for h, v in self.items() if not isinstance(v, BaseException)}

    @property
    def failed(self) -> dict[str, BaseException]:
        return {h: v for h, v in self.items() if isinstance(v, BaseException)}

    @property
    def ok(self) -> bool:
        return not self.failed and all(getattr(v, "ok", True) for v in self.values())

    def raise_on_failure(self) -> GroupResult:
        """Raise one ``RemoteError`` listing every failed host (after all have finished)."""
        problems = []
        for host, value in self.items():
            if isinstance(value, BaseException):
                problems.append(str(value) if str(value).startswith(host) else f"{host}: {value}")
            elif isinstance(value, Result) and not value.ok:
                try:
                    value.check()
                except RemoteError as exc:
                    problems.append(str(exc))
        if problems:
            fixes = {getattr(v, "fix", None) for v in self.failed.values()} - {None}
            raise RemoteError("\n".join(problems), fix="; ".join(sorted(fixes)) or None)
        return self
