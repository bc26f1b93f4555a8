"""Print, as one JSON object, the versions inside this image that dzctl labels it with.

Runs inside the image (``python /usr/local/lib/dzctl/probe.py``): it is the source of truth for the
``dzctl.*`` labels, and the last build step runs it so an image whose imports fail is never tagged.
"""

import json

import deepspeed
import torch
import transformers

import orchestrator


def nccl_version() -> str:
    if not torch.distributed.is_nccl_available():
        return "none"
    major, minor, patch = torch.cuda.nccl.version()
    return f"{major}.{minor}.{patch}"


print(
    "DZCTL_PROBE "
    + json.dumps(
        {
            "cuda": torch.version.cuda or "cpu",
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "nccl": nccl_version(),
            "transformers": transformers.__version__,
            "version": orchestrator.__version__,
        }
    )
)
