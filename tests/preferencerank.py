"""One rank of dzctl's trainer with a recorder, for tests/test_preference_train.py (run by torchrun).

``python tests/preferencerank.py JOB --output-dir DIR [--set K=V ...]``, with ``DZCTL_TEST_RECORD``
naming a folder and ``DZCTL_TEST_STEPS`` the last step to record (default 10). The trainer runs as
``python -m orchestrator.train`` does; the preference stage's trainer (``stage.make_trainer``) gets a
recorder that writes, for each step up to the last recorded one:

- ``policy-N.pt`` (rank 0): the policy's weights before step N, gathered from the ZeRO-3 partitions;
- ``batch-N-rankR.pt``: the micro-batch rank R trains on at step N (the collated tensors);
- ``ref-logps-N-rankR.pt``: the reference log-probs the trainer computes for that batch (chosen, rejected);
- ``reference.pt`` (rank 0): the frozen reference copy's gathered weights, where there is one;
- ``setup.json`` (rank 0): where the reference comes from (``ref_model``, PEFT adapters);
- LoRA: ``copy-logps-N-rankR.pt``: the log-probs of an explicit frozen copy of the base (built as the
  base was, ZeRO-3-partitioned in TRL's DeepSpeed inference engine) on the same batch.

Under ``dzctl launch`` (one rank per test host) the ranks run ``python -m orchestrator.train`` as in
production; ``site_hook(folder)`` writes a ``sitecustomize.py`` for the ranks' PYTHONPATH
(``launch.env``) that installs the same recorder once ``orchestrator.train.preference.stage`` is
imported: nothing else of the trainer changes, and the torchrun agent (no LOCAL_RANK) is left alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECORD = Path(os.environ.get("DZCTL_TEST_RECORD", "."))
LAST = int(os.environ.get("DZCTL_TEST_STEPS", "10"))
STAGE = "orchestrator.train.preference.stage"

SITE = f"""\
import os, sys

if os.environ.get("LOCAL_RANK") is not None and os.environ.get("DZCTL_TEST_RECORD"):
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import preferencerank

    preferencerank.install_on_import()
"""


def site_hook(folder: Path) -> Path:
    """A folder holding the ``sitecustomize.py`` that records a rank started by ``dzctl launch``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITE, encoding="utf-8")
    return folder


def install_on_import() -> None:
    """``install()`` right after the trainer imports the preference stage (not before: torch is not set up yet)."""
    import importlib.abc
    import importlib.machinery

    class AfterStage(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != STAGE:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                RECORD.mkdir(parents=True, exist_ok=True)
                install()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterStage())


def gathered_state(model) -> dict:
    """Every parameter's full value (all ranks call it: ZeRO-3 gathers each partition)."""
    import deepspeed
    import torch

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().clone().to(torch.float32) for name, p in params.items()}


def frozen_base_copy(loaded, trainer):
    """The base model built again as run.train built it (same seed, ZeRO-3), frozen, in TRL's inference engine."""
    from transformers import set_seed
    from trl.models import prepare_deepspeed
    from trl.trainer.utils import add_fused_lm_head

    from orchestrator.train.run import build_model, model_config

    precision = "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else "fp32"
    set_seed(loaded.spec.train.seed)
    model = build_model(loaded, model_config(loaded), precision)
    add_fused_lm_head(model)
    model.requires_grad_(False)
    return prepare_deepspeed(model, trainer.accelerator)


def install() -> None:
    import torch
    from transformers import TrainerCallback

    from orchestrator.train.preference import stage

    rank = int(os.environ.get("RANK", 0))
    made = stage.make_trainer

    def make_trainer(*args, **kwargs):
        trainer = made(*args, **kwargs)
        loaded = args[0]
        step = {"n": 0}
        frozen = {}

        class Recorder(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                peft = getattr(trainer.model, "peft_config", None)
                setup = {"ref_model": trainer.ref_model is not None, "adapters": sorted(peft) if peft else None}
                if trainer.ref_model is not None:
                    copy = getattr(trainer.ref_model, "module", trainer.ref_model)  # inside TRL's DeepSpeed engine
                    reference = gathered_state(copy)
                    if rank == 0:
                        torch.save(reference, RECORD / "reference.pt")
                if rank == 0:
                    (RECORD / "setup.json").write_text(json.dumps(setup), encoding="utf-8")
                if peft:
                    frozen["engine"] = frozen_base_copy(loaded, trainer)

            def on_step_begin(self, args, state, control, **kw):
                step["n"] = state.global_step + 1
                if step["n"] <= LAST:
                    weights = gathered_state(trainer.model)
                    if rank == 0:
                        torch.save(weights, RECORD / f"policy-{step['n']}.pt")

        trainer.add_callback(Recorder())
        compute_loss = trainer.compute_loss

        def recording(model, inputs, *rest, **more):
            if model.training and step["n"] <= LAST:
                batch = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in inputs.items()}
                torch.save(batch, RECORD / f"batch-{step['n']}-rank{rank}.pt")
                if hasattr(trainer, "compute_ref_log_probs") and "completion_mask" in inputs:
                    reference = trainer.ref_model if trainer.ref_model is not None else model
                    chosen, rejected = trainer.compute_ref_log_probs(reference, inputs)
                    torch.save((chosen.cpu(), rejected.cpu()), RECORD / f"ref-logps-{step['n']}-rank{rank}.pt")
                    if "engine" in frozen:
                        chosen, rejected = trainer.compute_ref_log_probs(frozen["engine"], inputs)
                        torch.save((chosen.cpu(), rejected.cpu()), RECORD / f"copy-logps-{step['n']}-rank{rank}.pt")
            return compute_loss(model, inputs, *rest, **more)

        trainer.compute_loss = recording
        return trainer

    stage.make_trainer = make_trainer


if __name__ == "__main__":
    RECORD.mkdir(parents=True, exist_ok=True)
    install()
    from orchestrator.train.entry import main

    sys.exit(main(sys.argv[1:]))
