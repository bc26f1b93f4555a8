#!/bin/sh
# The device run of benchmarks/lora_nvme_h200.py (issue 14) on the 2×H200 machine, no network.
# Same set-up as benchmarks/run_h200.sh: the wheels the machine lacks from .whl/ (deepspeed
# and its deps, dzctl's deps); peft is on the machine. About 8 minutes: LoRA at 72B
# (at most 220 s), then NVMe offload at 8B (at most 250 s); each run stops at its limit.
set -e
OUT=${OUT:-benchmarks/results/latest}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
# DeepSpeed's op builder crashes on torch's "10.0a"-style arch entries; build for Hopper only.
export TORCH_CUDA_ARCH_LIST=9.0
# NVLink multicast stays off on these shared hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
df -h /tmp "$OUT" > "$OUT/lora_nvme_disk.txt" 2>&1 || true
python3 benchmarks/lora_nvme_h200.py "$@" --out "$OUT"
