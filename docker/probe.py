"""Print, as one JSON object, the versions inside this image that dzctl labels it with.

Runs inside the image (``python /usr/local/lib/dzctl/probe.py``): it is the source of truth for the
``dzctl.*`` labels, and the last build step runs it so an image whose imports fail is never tagged.
Works without a GPU: a CUDA torch reports its CUDA, NCCL and cuDNN versions from its libraries.
"""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse

import deepspeed
import torch
import transformers

import orchestrator


def nccl_version() -> str:
    if not torch.distributed.is_nccl_available():
        return "none"
    major, minor, patch = torch.cuda.nccl.version()
    return f"{major}.{minor}.{patch}"


def cudnn_version() -> str:
    if torch.version.cuda is None:
        return "none"
    try:
        found = torch.backends.cudnn.version()
    except Exception as exc:  # a CUDA torch whose cuDNN library does not load says so
        return f"unloadable ({type(exc).__name__})"
    if not found:
        return "none"
    return f"{found // 10000}.{found // 100 % 100}.{found % 100}" if found >= 10000 else str(found)


def package(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def deepspeed_ops() -> tuple[str, str]:
    """(ops prebuilt into this install, ops this image could JIT-compile), as ``ds_report`` judges them."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible

    def names(ops) -> str:
        return ",".join(sorted(ops)) or "none"

    prebuilt = [op for op, yes in installed_ops.items() if yes]
    compatible = [
        op
        for op, builder in ALL_OPS.items()
        if op != "deepspeed_not_implemented" and probe_is_compatible(builder, False)
    ]
    return names(prebuilt), names(compatible)


def nvcc_version() -> str:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        return "none"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else "unknown"


def torch_source() -> str:
    recorded = os.path.join(sys.prefix, "dzctl-torch-source")
    # pip's report gives file URLs quoted (a wheel's "+cpu" reads "%2Bcpu").
    return urllib.parse.unquote(open(recorded).read().strip()) if os.path.exists(recorded) else "unknown"


prebuilt, compatible = deepspeed_ops()
print(
    "DZCTL_PROBE "
    + json.dumps(
        {
            "cuda": torch.version.cuda or "cpu",
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "nccl": nccl_version(),
            "cudnn": cudnn_version(),
            "transformers": transformers.__version__,
            "liger-kernel": package("liger-kernel"),
            "peft": package("peft"),
            "deepspeed-ops-prebuilt": prebuilt,
            "deepspeed-ops-compatible": compatible,
            "nvcc": nvcc_version(),
            "torch-source": torch_source(),
            "version": orchestrator.__version__,
        }
    )
)
