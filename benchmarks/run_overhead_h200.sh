#!/bin/sh
# Issue 29 on one H200: the trainer's per-step overhead through `dzctl launch`, in one session. The raw
# ZeRO-3 loop (recompute_h200.py) at the LoRA auto plan (micro 6, 6 of 36 layers checkpointed) against the
# same plan through the product, then each candidate on its own against that control:
#   gc      - a candidate trainer run from a copy of another checkout in $BRANCH (default .whl/gpu3),
#             everything else as the control; measured with commit 0a65011's GcCallback (automatic GC off,
#             gc.collect(1) every 50 steps), reverted after (results/overhead-h200x1-20261204: within noise);
#   alloc   - the control with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which the trainer already
#             sets for GPU jobs (train/environment.py): a no-op, so it is an A/A control of run-to-run spread;
# and the full fine-tuning auto plan (18 layers, SFT rows; then synthetic:random) without and with gc.
# --budget-s 300: useful_tokens_h200.py skips a configuration once less than its 240 s launch limit is
# left of --budget-s (200 skipped every launch on the first try); the wall limits below are what bound each run.
# Every run has its own wall limit; results are tarred into $OUT after each so a late one loses only itself.
# Wheels as in benchmarks/run_recompute_h200.sh.
set -u
OUT=${OUT:-benchmarks/results/latest}
BRANCH=${BRANCH:-.whl/gpu3}
RES=/tmp/overhead-res
mkdir -p "$OUT" "$RES"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
save() { tar czf "$OUT/results.tgz" -C "$RES" . ; }
main() {  # NAME LIMIT_S ARGS...: useful_tokens_h200.py from this checkout
    name=$1 limit=$2; shift 2; began=$(date +%s)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/useful_tokens_h200.py "$@" --out "$RES/$name" \
        --work "/tmp/dzctl-$name" > "$RES/$name.log" 2>&1
    echo "$name: exit $?, $(($(date +%s) - began)) s"; save
}
branch() {  # NAME LIMIT_S ARGS...: the same script, from the branch's copy
    name=$1 limit=$2; shift 2; began=$(date +%s)
    (cd "$BRANCH" && PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/useful_tokens_h200.py "$@" \
        --out "$RES/$name" --work "/tmp/dzctl-$name") > "$RES/$name.log" 2>&1
    echo "$name: exit $?, $(($(date +%s) - began)) s"; save
}
LORA="synthetic --set train.method=lora --steps 7 --warmup 2 --budget-s 300"
began=$(date +%s)
RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 PYTHONPATH=/tmp/site:$PWD \
    timeout 110 python3 benchmarks/recompute_h200.py --lora --layers 36 --micro 6 --checkpointed 6 --steps 5 \
    --budget-s 90 --tag=-raw --out "$RES" > "$RES/raw.log" 2>&1
echo "raw: exit $?, $(($(date +%s) - began)) s"; save
main lora-control 110 $LORA
branch lora-gc 110 $LORA
main lora-alloc 110 $LORA --env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
main full-control 100 auto --layers 18 --steps 7 --warmup 2 --budget-s 300
branch full-gc 100 auto --layers 18 --steps 7 --warmup 2 --budget-s 300
[ "${SYNTHETIC:-0}" = 1 ] && main syn-control 100 synthetic --layers 18 --steps 7 --warmup 2 --budget-s 300
[ "${SYNTHETIC:-0}" = 1 ] && branch syn-gc 100 synthetic --layers 18 --steps 7 --warmup 2 --budget-s 300
exit 0
