"""One module per dzctl command; ``cli.py`` registers those listed here.

The CLI registers only commands that work: a module is added to this list in
the same change that makes its command real.
"""

from __future__ import annotations

COMMAND_MODULES = [
    "orchestrator.commands.build",
    "orchestrator.commands.distribute",
    "orchestrator.commands.launch",
    "orchestrator.commands.jobs",
    "orchestrator.commands.plan",
    "orchestrator.commands.preflight",
]
