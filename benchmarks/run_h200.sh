#!/bin/sh
# The device run of benchmarks/zero3_h200.py on a machine with 2 H200s and no network.
# Wheels of what the machine lacks sit in .whl/ (deepspeed 0.19.8, hjson, py-cpuinfo,
# pydantic 2.14.4 + pydantic-core (cp312) + annotated-types + typing-inspection,
# typing-extensions), carried with the working tree.
set -e
OUT=${OUT:-benchmarks/results/latest}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
# DeepSpeed's op builder crashes on torch's "10.0a"-style arch entries; build for Hopper only.
export TORCH_CUDA_ARCH_LIST=9.0
# NVLink multicast stays off on these shared hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
[ $# -eq 0 ] && set -- auto seed
python3 benchmarks/zero3_h200.py run "$@" --out "$OUT"
