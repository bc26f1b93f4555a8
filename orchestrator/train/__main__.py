"""``python -m orchestrator.train JOB.yaml``: see ``entry`` for the options."""

import sys

from .entry import main

sys.exit(main())
