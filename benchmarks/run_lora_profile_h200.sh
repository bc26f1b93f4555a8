#!/bin/sh
# Issue 29, LoRA on the 36-layer Qwen3-8B shape on one H200: a torch profiler summary of one step at the
# auto plan's micro 6 with 6 layers checkpointed, and the same step time with every parameter persistent
# (stage3_param_persistence_threshold above the largest weight: frozen weights are never released).
set -e
OUT=${OUT:-benchmarks/results/latest}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561
# The profile is of the first point (micro 6); micro 4 is the persistent run's comparison.
python3 benchmarks/recompute_h200.py --lora --layers 36 --micro "${MICRO:-6,4}" --checkpointed 6 --steps 3 --profile \
    --tag=-default --out "$OUT"
[ "${PERSISTENCE:-1}" = 1 ] || exit 0  # the second build takes another minute of device time
python3 benchmarks/recompute_h200.py --lora --layers 36 --micro 4 --checkpointed 6 --steps 3 \
    --persistence 1000000000 --tag=-persistent --out "$OUT"
