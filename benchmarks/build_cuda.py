"""Build the CUDA flavour on a local base, as a user types it, and record what came out.

    sudo .venv/bin/python benchmarks/build_cuda.py [--base-image TAG] [--tag TAG]

`dzctl build --flavour cuda --base-image <local Debian base> --tag TAG --json` (too slow for every
CI run: torch's CUDA build and its nvidia-* wheels are ~4 GB). Then, from the built image itself:
its labels (docker image inspect), its size, and a run of the probe's imports without a GPU.
Writes benchmarks/results/build-cuda-<date>/: build.json (dzctl's report), build.log (its stderr),
summary.json (labels read back, size, wall time). Default base: the tests' debootstrap base
(tests/baseimage.py), from the Debian mirror apt is configured with here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from localdocker import local_docker  # noqa: E402


def redact_hosts(text: str) -> str:
    """URLs keep their path but lose their host: the repository names no registry host."""
    return re.sub(r"\b(https?)://[^/\s\"']+", r"\1://<host>", text)


def redact_file(path: Path) -> None:
    path.write_text(redact_hosts(path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-image", help="local base (default: the tests' Debian bookworm base)")
    parser.add_argument("--tag", default="dzctl-test/cuda:latest")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"build-cuda-{time.strftime('%Y%m%d')}"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with local_docker() as url:
        base = args.base_image
        if not base:
            import docker
            from baseimage import ensure_base_image

            base = ensure_base_image(docker.DockerClient(base_url=url, version="auto", timeout=900))
        argv = [sys.executable, "-m", "orchestrator", "build", "--flavour", "cuda", "--base-image", base]
        argv += ["--tag", args.tag, "--json"]
        print("$ dzctl " + " ".join(argv[3:]), flush=True)
        started = time.monotonic()
        with open(out / "build.log", "w") as log:
            done = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "DOCKER_HOST": url}
            )
        wall_s = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"dzctl build failed ({done.returncode}) after {wall_s:.0f} s: see {out / 'build.log'}")
        (out / "build.json").write_text(redact_hosts(done.stdout))
        redact_file(out / "build.log")
        report = json.loads(done.stdout)
        inspect = ["docker", "-H", url, "image", "inspect", "--format", "{{json .Config.Labels}}|{{.Size}}|{{.Id}}"]
        labels_json, size, image_id = (
            subprocess.run([*inspect, report["image_id"]], capture_output=True, text=True, check=True)
            .stdout.strip()
            .split("|")
        )
        labels = {k: v for k, v in json.loads(labels_json).items() if k.startswith("dzctl.")}
        # torch's CUDA build imports and reports its CUDA/NCCL without a GPU (DS_ACCELERATOR=cpu
        # keeps DeepSpeed from looking for one).
        check = (
            "import torch, deepspeed, transformers, liger_kernel, peft;"
            "print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.is_available())"
        )
        ran = subprocess.run(
            ["docker", "-H", url, "run", "--rm", "-e", "DS_ACCELERATOR=cpu", image_id, "python", "-c", check],
            capture_output=True,
            text=True,
        )
        summary = {
            "command": "dzctl " + " ".join(argv[3:]),
            "base_image": base,
            "image_id": image_id,
            "size_bytes": int(size),
            "size_gib": round(int(size) / 2**30, 2),
            "build_wall_s": round(wall_s, 1),
            "labels_read_back": labels,
            "notes": report.get("notes", []),
            "imports_without_gpu": (ran.stdout.strip().splitlines() or [""])[-1]
            if ran.returncode == 0
            else ran.stderr[-800:],
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} cores; 1/5/15-minute load averages at the end {os.getloadavg()}",
        }
    (out / "summary.json").write_text(redact_hosts(json.dumps(summary, indent=1)) + "\n")
    print(redact_hosts(json.dumps(summary, indent=1)))


if __name__ == "__main__":
    main()
