"""What DeepSpeed's ZeRO-3 optimizer keeps under ``train.pure_bf16``, read from the live optimizer (test helper).

``python tests/purebf16engine.py JOB [KEY=VALUE ...]`` builds the job's model and the DeepSpeed config dzctl
generates for it (one rank, gloo, DeepSpeed's CPU accelerator), trains 2 steps with torch's AdamW (what the HF
Trainer hands DeepSpeed without an ``optimizer`` section) and prints, as JSON, the dtypes of the master partitions,
the gradient partitions and Adam's moments, whether each master partition is a tensor of its own beside the 16-bit
weights (the memory planner counts it: ``OptimizerStates``), and the losses.

Its own process: DeepSpeed's process group and accelerator are process-wide, which a test process must not keep.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _engine(job: Path, sets: list[str]):
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrator.planning import dsconfig
    from orchestrator.spec.job import load_job

    loaded = load_job(job, sets)
    ds = dsconfig.job_ds_config(loaded, dsconfig.resolve_defaults(loaded.spec), world_size=1)
    # DeepSpeed's CPU backend would JIT-build a shared-memory op at its first group (train/run.py says why not).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    config = AutoConfig.for_model(**loaded.spec.model.config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=loaded.spec.train.learning_rate)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine, ds, config.vocab_size


def main(job: Path, sets: list[str]) -> None:
    engine, ds, vocab = _engine(job, sets)
    batch = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    zero = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
    masters, weights = zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat
    moments = [state[name] for state in zero.optimizer.state.values() for name in ("exp_avg", "exp_avg_sq")]
    print(
        json.dumps(
            {
                "bf16_section": ds["bf16"],
                "master_dtypes": sorted({str(t.dtype) for t in masters}),
                "weight_dtypes": sorted({str(t.dtype) for t in weights}),
                "gradient_dtype": str(zero.grad_partitions_flat_buffer.dtype),
                "moment_dtypes": sorted({str(t.dtype) for t in moments}),
                "moments": len(moments),
                "master_apart_from_weights": all(
                    m.data_ptr() != w.data_ptr() for m, w in zip(masters, weights, strict=True)
                ),
                "losses": losses,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
