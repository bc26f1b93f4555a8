"""Say where torch came from and refuse a torch that is not the flavour's build.

Runs in the build right after torch is installed (``install-python.sh torch``), before any long
step builds on it: ``check_torch.py FLAVOUR REPORT``, REPORT being pip's ``--report`` JSON.
A CUDA torch in a CPU image is 4 GB of libraries labelled cpu; a CPU torch in a CUDA image runs
no GPU. Either stops the build here, exit 3, naming what was found and where it came from.
"""

import json
import sys
from pathlib import Path


def source_of(report_path: str) -> str:
    path = Path(report_path)
    if not path.is_file():
        return "already installed"
    for item in json.loads(path.read_text()).get("install", []):
        if item.get("metadata", {}).get("name", "").lower() == "torch":
            url = item.get("download_info", {}).get("url", "?")
            if "/tmp/dzctl-build/wheelhouse/" in url:
                return f"the build's wheelhouse ({url.rsplit('/', 1)[-1]})"
            return url.split("#", 1)[0]
    return "already installed"


def main() -> int:
    flavour, report = sys.argv[1], sys.argv[2]
    import torch

    cuda = torch.version.cuda
    where = source_of(report)
    print(f"dzctl: torch {torch.__version__} (CUDA {cuda or 'none'}) from {where}")
    # Kept in the venv for the probe, which labels the image with it (dzctl.torch-source).
    Path(sys.prefix, "dzctl-torch-source").write_text(where + "\n")
    if flavour == "cpu" and cuda is not None:
        print(f"dzctl: a cpu image got a CUDA torch ({torch.__version__}): refused", file=sys.stderr)
        return 3
    if flavour == "cuda" and cuda is None:
        print(f"dzctl: a cuda image got a torch without CUDA ({torch.__version__}): refused", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
