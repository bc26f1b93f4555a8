"""``python -m orchestrator.train`` with extra Hugging Face ``TrainingArguments``: benchmarks only.

``zero3_h200.py run ... --trainer-arg KEY=JSON`` starts this file under torchrun
instead of the plain entry point, to A/B a Trainer setting (for example
``average_tokens_across_devices``) through the real trainer without making it a
job-spec field first. The overrides come as one JSON object in
``DZCTL_BENCH_TRAINER_ARGS`` and are applied on top of what
``orchestrator.train.run.training_arguments`` passes; ``accelerator_config``
dicts are merged (the CPU path needs its ``use_configured_state``).

    torchrun --nproc_per_node 2 benchmarks/trainer_args.py JOB.yaml [entry options]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENV = "DZCTL_BENCH_TRAINER_ARGS"


def merged(kwargs: dict, overrides: dict) -> dict:
    out = {**kwargs, **overrides}
    given, extra = kwargs.get("accelerator_config"), overrides.get("accelerator_config")
    if isinstance(given, dict) and isinstance(extra, dict):
        out["accelerator_config"] = {**given, **extra}
    return out


def main() -> int:
    from orchestrator.spec.job import load_job
    from orchestrator.train.environment import early_defaults

    overrides = json.loads(os.environ.get(ENV) or "{}")
    if not isinstance(overrides, dict):
        raise SystemExit(f"{ENV} must be a JSON object, got {overrides!r}")
    # As entry.main does, before torch/DeepSpeed are imported (DeepSpeed reads DS_ACCELERATOR at import).
    early_defaults(load_job(Path(sys.argv[1])).spec.accelerator)
    from orchestrator.train import entry, run

    plain = run.TrainingArguments

    def with_overrides(**kwargs):
        args = plain(**merged(kwargs, overrides))
        if int(os.environ.get("RANK", "0")) == 0:  # the values in force, read back from the arguments
            applied = {key: getattr(args, key) for key in overrides}
            print(f"dzctl-bench: TrainingArguments overrides {applied}", flush=True)
        return args

    run.TrainingArguments = with_overrides  # the name training_arguments() calls
    return entry.main(sys.argv[1:])


if __name__ == "__main__":
    from orchestrator.train.entry import exit_rank

    exit_rank(main())  # not sys.exit: a gloo rank can abort at interpreter finalization (see exit_rank)
