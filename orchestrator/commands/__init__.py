"""One module per dzctl command; ``cli.py`` registers those listed here.

The CLI registers only commands that work: a module is added to this list in
the same change that makes its command real.
"""

from __future__ import annotations

# Command name -> the module that defines it. Imported only when that command
# runs (or for --help): `dzctl status` need not load the docker SDK or the planner.
COMMANDS = {
    "build": "orchestrator.commands.build",
    "convert": "orchestrator.commands.convert",
    "distribute": "orchestrator.commands.distribute",
    "export": "orchestrator.commands.export",
    "launch": "orchestrator.commands.launch",
    "logs": "orchestrator.commands.jobs",
    "plan": "orchestrator.commands.plan",
    "preflight": "orchestrator.commands.preflight",
    "status": "orchestrator.commands.jobs",
    "stop": "orchestrator.commands.jobs",
    "tune": "orchestrator.commands.plan",
}
