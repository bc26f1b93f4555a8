"""Experiment trackers (``train.report_to``): where each writes on rank 0's node (pure, no torch).

The trainer sets these variables before the HF Trainer builds its callbacks;
``dzctl status`` names the same places and ``dzctl logs --fetch`` copies them
back. Everything lands under the job's output dir, so it lives and is
cleaned with the checkpoints. Credentials (``WANDB_API_KEY``,
``MLFLOW_TRACKING_PASSWORD``, ...) go through ``launch.env_file`` like every
secret; a tracking server is named with ``launch.env`` (``MLFLOW_TRACKING_URI``,
``WANDB_MODE=online``), which wins over the defaults here.
"""

from __future__ import annotations

TRACKERS = ("tensorboard", "wandb", "mlflow")


def tracker_dirs(report_to: list[str] | tuple[str, ...], output_dir: str, job_id: str) -> dict[str, str]:
    """Tracker -> the folder its files go to. TensorBoard gets one run folder per job (relaunches side by side)."""
    where = {
        "tensorboard": f"{output_dir}/tensorboard/{job_id}",
        "wandb": f"{output_dir}/wandb",
        "mlflow": f"{output_dir}/mlruns",
    }
    return {name: where[name] for name in report_to if name in where}


def tracker_env(report_to: list[str] | tuple[str, ...], output_dir: str, job_id: str) -> dict[str, str]:
    """Environment defaults that point each tracker at its folder (set only where not already set)."""
    dirs = tracker_dirs(report_to, output_dir, job_id)
    env = {}
    if "tensorboard" in dirs:
        env["TENSORBOARD_LOGGING_DIR"] = dirs["tensorboard"]
    if "wandb" in dirs:
        env["WANDB_DIR"] = output_dir  # wandb adds its own wandb/ folder
        # Offline unless the job says otherwise: nodes often have no route out, and an
        # online run without WANDB_API_KEY would stop at a login prompt.
        env["WANDB_MODE"] = "offline"
        env["WANDB_NAME"] = job_id
    if "mlflow" in dirs:
        env["MLFLOW_TRACKING_URI"] = f"file://{dirs['mlflow']}"
        env["MLFLOW_RUN_NAME"] = job_id
    return env
