#!/bin/sh
# The device run of benchmarks/recompute_h200.py on one H200 with no network: the wheels of
# benchmarks/run_h200.sh in .whl/ (plus liger-kernel 0.8.5 and peft), carried with the working tree.
set -e
OUT=${OUT:-benchmarks/results/latest}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One process, no launcher: the single rank's rendezvous.
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561
python3 benchmarks/recompute_h200.py --layers 18 --micro 2,4,8,16,32 --budget-s 250 --out "$OUT" "$@"
python3 benchmarks/recompute_h200.py --lora --layers 36 --micro 2,4,8,16 --budget-s 150 --out "$OUT" "$@"
