"""``python -m orchestrator.train JOB.yaml``: see ``entry`` for the options."""

from .entry import exit_rank, main

exit_rank(main())  # not sys.exit: see exit_rank for why a rank skips interpreter finalization
