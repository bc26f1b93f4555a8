#!/bin/sh
# Issue 29, LoRA on the 36-layer Qwen3-8B shape on one H200: the step with every parameter persistent
# (stage3_param_persistence_threshold 1e9, above the largest weight: frozen base weights are gathered once
# and never released) against the default threshold (10 x hidden = 40,960), at the auto plan's micro 6 and
# at micro 4, 6 layers checkpointed. The persistent run goes first and is profiled: it is the new data; the
# default run is the control in the same session. Each run has its own wall limit so that one that hangs
# still leaves the other's JSON. Wheels as in benchmarks/run_recompute_h200.sh.
set -u
OUT=${OUT:-benchmarks/results/latest}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
began=$(date +%s)
timeout "${PERSISTENT_S:-190}" python3 benchmarks/recompute_h200.py --lora --layers 36 --micro 6,4 --checkpointed 6 \
    --steps 3 --budget-s 150 --persistence 1000000000 --profile --tag=-persistent --out "$OUT"
echo "persistent: exit $?, $(($(date +%s) - began)) s"
began=$(date +%s)
timeout "${DEFAULT_S:-170}" python3 benchmarks/recompute_h200.py --lora --layers 36 --micro 6,4 --checkpointed 6 \
    --steps 3 --budget-s 130 --tag=-default --out "$OUT"
echo "default: exit $?, $(($(date +%s) - began)) s"
