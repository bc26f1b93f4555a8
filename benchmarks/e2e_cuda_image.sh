#!/usr/bin/env bash
# The launch-to-success e2e (tests/test_e2e.py, docker runtime, two test hosts, accelerator: cpu)
# on the CUDA flavour instead of the CPU one: torch's CUDA build runs the CPU path without a GPU.
# Too slow for every CI run (a ~5 GB image distributed to two hosts); CI keeps the CPU image.
#   sudo benchmarks/e2e_cuda_image.sh [IMAGE]     (default dzctl-test/cuda:latest, from build_cuda.py)
# Writes benchmarks/results/e2e-cuda-image-<date>.txt: the image's labels and pytest's output.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${1:-dzctl-test/cuda:latest}"
# This checks the image's Python stack, not distribution: no layer store to fill with 5 GB of gzip
# on the side (DZCTL_LAYER_STORE=DIR to have one anyway).
export DZCTL_LAYER_STORE="${DZCTL_LAYER_STORE:-off}"
OUT="benchmarks/results/e2e-cuda-image-$(date -u +%Y%m%d).txt"
{
    echo "image $IMAGE"
    docker image inspect --format '{{.Id}} {{json .Config.Labels}}' "$IMAGE"
    echo "started $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
} > "$OUT"
DZCTL_TEST_E2E_IMAGE="$IMAGE" DZCTL_REQUIRE_INTEGRATION=1 .venv/bin/python -m pytest -p no:cacheprovider -v \
    tests/test_e2e.py -k "test_launch_runs_to_success_with_progress_and_a_consolidated_model and docker" 2>&1 |
    tee -a "$OUT"
sed -i "s#$PWD#<checkout>#g" "$OUT"  # the record names no machine's paths
echo "ended $(date -u '+%Y-%m-%d %H:%M:%S UTC')" >> "$OUT"
