#!/bin/sh
# Issue 29 on one H200, through the product (dzctl launch --runtime process): the auto plan of full
# fine-tuning (18 Qwen3-8B layers, SFT rows and synthetic:random) and of LoRA (all 36 layers,
# synthetic:random). Wheels as in benchmarks/run_recompute_h200.sh.
set -e
OUT=${OUT:-benchmarks/results/latest}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 benchmarks/useful_tokens_h200.py auto synthetic --layers 18 --steps 6 --warmup 2 --budget-s 330 \
    --out "$OUT/full" --work /tmp/dzctl-useful-full
python3 benchmarks/useful_tokens_h200.py synthetic --set train.method=lora --steps 6 --warmup 2 --budget-s 250 \
    --out "$OUT/lora" --work /tmp/dzctl-useful-lora
