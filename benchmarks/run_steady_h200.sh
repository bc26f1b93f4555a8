#!/bin/sh
# Issue 29 on one H200: steady-state throughput of the three auto plans through `dzctl launch`, in
# alternating order (A B C A B C ...) so launch-to-launch spread shows beside any difference, and one
# profiled step of each plan before and after issue 29 (benchmarks/recompute_h200.py's raw ZeRO-3 loop,
# which measured within 0.3% of launch in results/overhead-h200x1-20261204).
#   A full-sft-R  full FT, 18 layers, SFT rows of benchmarks/sft_data.py, auto plan
#   B full-syn-R  full FT, 18 layers, synthetic:random, auto plan
#   C lora-R      LoRA r16 (7 projections), all 36 layers, synthetic:random, auto plan
# 12 steps each, median of steps 5-12 (--warmup 4): the slow first steps of a call's first launches stay out.
#   full-sft-g32-R, full-syn-g32-R, lora-g32-R  the same three with the global batch fixed at 32 rows
#     (train.global_batch_size=32: 131,072 tokens, near the 35 rows a step of the old micro-35 plan took),
#     so accumulation makes up for a small micro-batch and the optimizer step is paid once per 32 rows,
#     as in a real job, instead of once per micro-batch. 7 steps, median of steps 4-7 (each 32 rows).
#   NAME-nockpt-R (any launch task above, e.g. lora-g32-nockpt-1)  the same launch with
#     train.gradient_checkpointing=false (the planner then picks the micro-batch alone)
#   NAME-module-R, NAME-layer-R (e.g. lora-module-1, lora-g32-nockpt-layer-1)  the same launch with
#     zero.fetch_unit=module (DeepSpeed's hooks on every sub-module) or =layer (each decoder layer one unit)
#   prof-full-before  micro 35 (the old auto on SFT rows), all 18 layers checkpointed
#   prof-full-after   micro 4, 0 of 18 checkpointed (today's auto)
#   prof-lora-before  lora.dropout 0.05, all 36 checkpointed, micro 45 (the old auto; 40 or 32 if 45 fails)
#   prof-lora-after   dropout 0, micro 6, 6 of 36 checkpointed (the auto plan at accumulation 1)
#   prof-lora-after-layer  the same, each decoder layer one ZeRO-3 fetch unit
#   prof-lora-nockpt-module, prof-lora-nockpt-layer  micro 4, none checkpointed (the plan at global batch 32
#     once the fetch unit is a layer), per sub-module / per layer
#   grid-lora-layer  recompute_h200.py's LoRA grid (micro 2-8, 0/6/14/36 checkpointed) per layer: the
#     recompute model's LoRA constants for zero.fetch_unit layer
# TASKS names what runs, in order, e.g. TASKS="full-sft-1 full-syn-1 lora-1 full-sft-2 ...". A task is skipped
# when less than its own limit is left of CALL_S (the device command's limit, less a margin), so the call
# ends with its results. Results are tarred into $OUT after each task. Run from the root of a checkout
# with the wheels of benchmarks/run_recompute_h200.sh in $WHEELS; the benchmarks and the product they
# launch are this script's own checkout's (it may be a copy beside that root).
set -u
OUT=${OUT:-benchmarks/results/latest}
WHEELS=${WHEELS:-.whl}
CALL_S=${CALL_S:-520}
TASKS=${TASKS:-full-sft-1 full-syn-1 lora-1 full-sft-2 full-syn-2 lora-2}
HERE=$(cd "$(dirname "$0")/.." && pwd)
RES=/tmp/steady-res
mkdir -p "$OUT" "$RES"
began=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$HERE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
save() { tar czf "$OUT/results.tgz" -C "$RES" . ; }
fits() {  # LIMIT_S: whether a task of that limit still ends inside CALL_S
    [ $(($(date +%s) - began + $1)) -le "$CALL_S" ]
}
launch() {  # NAME LIMIT_S ARGS...: one configuration through useful_tokens_h200.py (plan + launch --follow)
    name=$1 limit=$2; shift 2
    if ! fits "$limit"; then echo "$name: skipped, $(($(date +%s) - began)) s into the call"; return; fi
    t0=$(date +%s)
    (cd "$HERE" && timeout "$limit" python3 benchmarks/useful_tokens_h200.py --steps 12 --warmup 4 "$@" \
        --budget-s 300 --out "$RES/$name" --work "/tmp/dzctl-$name") > "$RES/$name.log" 2>&1
    echo "$name: exit $?, $(($(date +%s) - t0)) s"; save
}
recompute() {  # NAME LIMIT_S ARGS...: benchmarks/recompute_h200.py, its JSON (and profile) tagged -NAME
    name=$1 limit=$2; shift 2
    if ! fits "$limit"; then echo "$name: skipped, $(($(date +%s) - began)) s into the call"; return; fi
    t0=$(date +%s)
    (cd "$HERE" && RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 timeout "$limit" \
        python3 benchmarks/recompute_h200.py "$@" --tag="-$name" --out "$RES") > "$RES/$name.log" 2>&1
    echo "$name: exit $?, $(($(date +%s) - t0)) s"; save
}
profile() {  # NAME LIMIT_S ARGS...: one point of recompute_h200.py, then one profiled step of it
    name=$1 limit=$2; shift 2
    recompute "$name" "$limit" "$@" --first-fit --profile
}
G32="--set train.global_batch_size=32 --steps 7 --warmup 3"
for task in $TASKS; do
    extra=""  # -nockpt- in the name: checkpointing off; -module-/-layer-: zero.fetch_unit
    case $task in *-nockpt-*) extra="--set train.gradient_checkpointing=false" ;; esac
    case $task in *-module-*) extra="$extra --set zero.fetch_unit=module" ;; esac
    case $task in *-layer-*) extra="$extra --set zero.fetch_unit=layer" ;; esac
    case $task in
        full-sft-g32-*) launch "$task" 160 auto --layers 18 $G32 $extra ;;
        full-syn-g32-*) launch "$task" 160 synthetic --layers 18 $G32 $extra ;;
        lora-g32-*) launch "$task" 230 synthetic --set train.method=lora $G32 $extra ;;
        full-sft-*) launch "$task" 130 auto --layers 18 $extra ;;
        full-syn-*) launch "$task" 130 synthetic --layers 18 $extra ;;
        lora-*) launch "$task" 150 synthetic --set train.method=lora $extra ;;
        # Before: 1 warm-up + 1 timed step (each 8-20 s); after: 1 + 3 (about 1-2 s each).
        prof-full-before) profile "$task" 130 --layers 18 --micro 35,32 --checkpointed all --steps 1 ;;
        prof-full-after) profile "$task" 90 --layers 18 --micro 4 --checkpointed 0 --steps 3 ;;
        prof-lora-before) profile "$task" 200 --lora --lora-dropout 0.05 --layers 36 --micro 45,40,32 \
            --checkpointed all --steps 1 ;;
        prof-lora-after) profile "$task" 100 --lora --layers 36 --micro 6 --checkpointed 6 --steps 3 ;;
        prof-lora-after-layer) profile "$task" 100 --lora --layers 36 --micro 6 --checkpointed 6 --steps 3 \
            --fetch-unit layer ;;
        prof-lora-nockpt-module) profile "$task" 100 --lora --layers 36 --micro 4 --checkpointed 0 --steps 3 ;;
        prof-lora-nockpt-layer) profile "$task" 100 --lora --layers 36 --micro 4 --checkpointed 0 --steps 3 \
            --fetch-unit layer ;;
        grid-lora-layer) recompute "$task" 260 --lora --layers 36 --micro 2,4,6,8 --checkpointed 0,6,14,all \
            --budget-s 200 --fetch-unit layer ;;
        *) echo "$task: unknown task" ;;
    esac
done
echo "call: $(($(date +%s) - began)) s"
exit 0
