#!/bin/sh
# Issue 42 on one GPU (H100 or H200): the plans auto makes against a grid of the others, offload included.
# Each launch is the product itself, benchmarks/useful_tokens_h200.py (dzctl plan, then dzctl launch --runtime
# process --follow on localhost slots=1), global batch fixed at 32 rows (train.global_batch_size=32), 7 steps,
# the median of steps 4-7. Each grid is benchmarks/recompute_h200.py's raw ZeRO-3 loop (one process, one model,
# full rows of random ids), the step-time inputs that planning/speed/recompute.py fits.
#   rates               benchmarks/offload_rates.py: DeepSpeed's CPU Adam and the pinned PCIe copies on this node
#                       (it JIT-builds cpu_adam into TORCH_EXTENSIONS_DIR, which every later launch reuses)
#   off-auto-R          full FT, 18 layers, SFT rows (benchmarks/sft_data.py), auto plan (on an H100 it offloads
#                       the optimizer: the states do not fit 80 GB)
#   off-ratio-R         the same, DeepSpeed's partial offload: offload_optimizer.ratio RATIO (default 0.5) of the
#                       optimizer on the CPU, the rest on the GPU, sub_group_size 5e8 (the ratio splits sub-groups)
#   off-zenflow-R       the same, ZenFlow with overlap_step (the CPU step beside the next GPU work)
#   off-zenflow-noliger-R  off-zenflow-R with train.fused_loss: none (no Liger kernels: ZenFlow keeps 2-D weights
#                       transposed between module forwards, and under Liger it failed in the first forward)
#   off-super-R         the same, offload_optimizer.super_offload (DeepSpeed's overlapped CPU step)
#   bf16-full18-R       full FT, 18 layers, SFT rows, auto plan with train.pure_bf16 (10 bytes a parameter: on an H100
#                       the states then fit beside the activations, so nothing is offloaded)
#   lora-R              LoRA r16 (7 projections), 36 layers, SFT rows, auto plan
#   lora-mMICRO-R       the same with micro-batch MICRO forced (checkpointing left to the planner)
#   lora-m2nock-R       micro 2, no checkpointing
#   full12-R            full FT, 12 layers, SFT rows, auto plan;  full12-mMICRO-R as for LoRA
#   grid-lora           recompute_h200.py --lora, 36 layers, by layer: micro 2,4,8,16 x 0/half/all checkpointed
#   grid-full12         recompute_h200.py, 12 layers: micro 2,4,8,16 x 0/half/all checkpointed
#   tune-lora           `dzctl tune --top TUNE_TOP` (default 4) on the LoRA job: the planner's own choice and its next three
#                       candidates, each a launch of 6 steps (the median of steps 3-6) in this one call
#   tune-off            the same on full FT, 18 layers (on an H100: the optimizer offloaded); TUNE_STEPS and
#                       TUNE_WARMUP (default 6 and 2) set each candidate's steps, so four offloaded candidates
#                       (about 10 s a step on an H100) fit one call
#   tune-full12         the same on full FT, 12 layers
#   probe-pref          issue 44: benchmarks/preference_activation_probe.py (one layer's saved activations on the
#                       preference path: HF modules, SDPA on padded pairs, TRL's fused LM head; 1 and 3 layers)
#   hang-fr             issue 45: benchmarks/hang_flight_recorder_gpu.py (one NCCL rank, its flight recorder dumped)
#   dpo-full-R          issue 44: DPO (sigmoid) on jobs/data/dpo-pairs.jsonl (LLaMA-Factory's dpo_en_demo layout),
#                       full FT, 18 layers, seq 2048, auto plan (the reference a frozen copy or stored log-probs)
#   dpo-lora-R          the same, LoRA r16 on all 36 layers (the reference: the base with the adapters off)
#   ceiling-L           benchmarks/plain_pytorch_ceiling.py: the L-layer model (18 or 12) by plain PyTorch, bf16
#                       weights and AdamW states, no DeepSpeed: micro 2,4,8 with none recomputed, full random rows
#   synth-fullL-R       full FT, L layers (18 or 12), auto plan, on synthetic:random rows (full rows at 4,096, as
#                       the ceiling's): the launch the ceiling is compared with, in the same call
#   synth-bf16-fullL-R  the same with train.pure_bf16 (bf16 master weights, gradients and AdamW states, as the
#                       ceiling keeps them): the like-for-like launch for the ceiling
#   bf16-full12-R       full12-R with train.pure_bf16
#   trace-dpo-full      dpo-full's launch for 3 steps, its rank's CUDA allocations recorded from its start
#                       (benchmarks/memory_trace/sitecustomize.py): what was live at its peak, by the code that
#                       allocated it (benchmarks/cuda_memory_peak.py), against the planner's terms; and the same
#                       for the highest moment inside a backward and outside one
#   sftpairs-full-R     SFT on the same rows (each conversation with its chosen answer), full FT, 18 layers
#   sftpairs-lora-R     the same, LoRA on 36 layers: the step time DPO's is compared with
# TASKS names what runs, in order. A task is skipped when less than its own limit is left of CALL_S. Results are
# tarred into $OUT after each task. Run from the root of a checkout with the wheels of run_recompute_h200.sh in
# $WHEELS.
set -u
OUT=${OUT:-benchmarks/results/latest}
WHEELS=${WHEELS:-.whl}
CALL_S=${CALL_S:-560}
RATIO=${RATIO:-0.5}
TUNE_S=${TUNE_S:-540}  # the limit of each tune-* task
TUNE_TOP=${TUNE_TOP:-4}  # the candidates each tune-* task measures
TUNE_STEPS=${TUNE_STEPS:-6} TUNE_WARMUP=${TUNE_WARMUP:-2}  # each candidate's steps, and those left out of its median
# OFF_SET: extra --set arguments of the off-* launches, e.g. "--set zero.offload=optimizer" where the states fit
# (an H200) and the offloaded step is to be measured all the same.
OFF_SET=${OFF_SET:-}
TASKS=${TASKS:-rates off-auto-1 off-ratio-1 off-zenflow-1}
HERE=$(cd "$(dirname "$0")/.." && pwd)
RES=/tmp/plans-res
mkdir -p "$OUT" "$RES"
began=$(date +%s)
# Installed once per machine: a reinstall gives DeepSpeed's op sources new times, and torch's JIT then builds
# cpu_adam again (about 40 s) in the first offloaded launch of every call, where the ops folder had it built.
stamp=$(cd "$WHEELS" && md5sum ./*.whl | md5sum)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    echo "$stamp" > /tmp/site/.wheels
fi
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$HERE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One extensions folder for the call: cpu_adam is built once (by `rates` or the first offload launch).
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch-ext}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; grep -m1 'model name' /proc/cpuinfo; free -g | head -2
save() { tar czf "$OUT/results.tgz" -C "$RES" . ; }
fits() { [ $(($(date +%s) - began + $1)) -le "$CALL_S" ]; }
tune() {  # NAME LIMIT_S ARGS...: dzctl tune's candidates, in --limit-s of the call (75 s of it left to stop a cut
    # tune's ranks and keep its candidates' progress events: the outer timeout killed that in one call)
    name=$1 limit=$2; shift 2
    if ! fits "$limit"; then echo "$name: skipped, $(($(date +%s) - began)) s into the call"; return; fi
    t0=$(date +%s)
    (cd "$HERE" && timeout "$limit" python3 benchmarks/useful_tokens_h200.py "$@" --tune "$TUNE_TOP" --steps "$TUNE_STEPS" \
        --warmup "$TUNE_WARMUP" --budget-s $((limit - 75)) --out "$RES/$name" --work "/tmp/dzctl-$name") > "$RES/$name.log" 2>&1
    echo "$name: exit $?, $(($(date +%s) - t0)) s"; save
}
launch() {  # NAME LIMIT_S ARGS...
    name=$1 limit=$2; shift 2
    if ! fits "$limit"; then echo "$name: skipped, $(($(date +%s) - began)) s into the call"; return; fi
    t0=$(date +%s)
    (cd "$HERE" && timeout "$limit" python3 benchmarks/useful_tokens_h200.py "$@" \
        --budget-s 400 --out "$RES/$name" --work "/tmp/dzctl-$name") > "$RES/$name.log" 2>&1
    code=$?
    if [ "$code" -eq 124 ]; then  # cut by the task's limit: its ranks still hold the GPU and the port; stop them
        (cd "$HERE" && DZCTL_HOME="/tmp/dzctl-$name/dzctl-home" timeout 60 python3 -m orchestrator stop "useful-$1") \
            >> "$RES/$name.log" 2>&1
    fi
    echo "$name: exit $code, $(($(date +%s) - t0)) s"; save
}
grid() {  # NAME LIMIT_S ARGS...
    name=$1 limit=$2; shift 2
    if ! fits "$limit"; then echo "$name: skipped, $(($(date +%s) - began)) s into the call"; return; fi
    t0=$(date +%s)
    (cd "$HERE" && RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 timeout "$limit" \
        python3 benchmarks/recompute_h200.py "$@" --tag="-$name" --out "$RES") > "$RES/$name.log" 2>&1
    echo "$name: exit $?, $(($(date +%s) - t0)) s"; save
}
G32="--set train.global_batch_size=32 --steps 7 --warmup 3"
PAIRS="$HERE/jobs/data/dpo-pairs.jsonl"
DPO="--seq 2048 --set train.stage=dpo --set data.path=$PAIRS --set data.format=sharegpt"
SFT_PAIRS="--seq 2048 --set data.path=$RES/sft-pairs.jsonl --set data.format=sharegpt"
# The preference rows as SFT rows: each conversation with its chosen answer as the last turn.
python3 -c 'import json, sys
with open(sys.argv[2], "w") as out:
    for line in open(sys.argv[1]):
        row = json.loads(line)
        out.write(json.dumps({"conversations": row["conversations"] + [row["chosen"]]}) + "\n")' "$PAIRS" "$RES/sft-pairs.jsonl"
OVR="--set=zero.overrides="
# The offloaded launches load the cpu_adam that `rates` (or the first of them) built, not each its own build.
EXT="--env TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR"
for task in $TASKS; do
    case $task in
        probe-pref)
            t0=$(date +%s)
            (cd "$HERE" && timeout 150 python3 benchmarks/preference_activation_probe.py --out "$RES") \
                > "$RES/probe-pref.log" 2>&1
            echo "probe-pref: exit $?, $(($(date +%s) - t0)) s"; save ;;
        hang-fr)
            t0=$(date +%s)
            (cd "$HERE" && OUT="$RES" timeout 150 python3 benchmarks/hang_flight_recorder_gpu.py) > "$RES/hang-fr.log" 2>&1
            echo "hang-fr: exit $?, $(($(date +%s) - t0)) s"; save ;;
        rates)
            t0=$(date +%s)
            (cd "$HERE" && timeout 300 python3 benchmarks/offload_rates.py --params 2e9 --rounds 2 --out "$RES") \
                > "$RES/rates.log" 2>&1
            echo "rates: exit $?, $(($(date +%s) - t0)) s"; save ;;
        off-auto-*) launch "$task" 280 auto --layers 18 $G32 $OFF_SET $EXT ;;
        off-ratio-*) launch "$task" 290 auto --layers 18 $G32 $OFF_SET $EXT \
            "${OVR}{zero_optimization: {sub_group_size: 500000000, offload_optimizer: {ratio: $RATIO}}}" ;;
        off-zenflow-noliger-*) launch "$task" 200 auto --layers 18 $G32 $OFF_SET $EXT --set train.fused_loss=none \
            "${OVR}{zero_optimization: {zenflow: {topk_ratio: 0.05, update_interval: 4, overlap_step: true}}}" ;;
        off-zenflow-*) launch "$task" 170 auto --layers 18 $G32 $OFF_SET $EXT \
            "${OVR}{zero_optimization: {zenflow: {topk_ratio: 0.05, update_interval: 4, overlap_step: true}}}" ;;
        off-super-*) launch "$task" 280 auto --layers 18 $G32 $OFF_SET $EXT \
            "${OVR}{zero_optimization: {offload_optimizer: {super_offload: true}}}" ;;
        tune-lora) tune "$task" "$TUNE_S" auto --set train.method=lora --set train.global_batch_size=32 ;;
        tune-off) tune "$task" "$TUNE_S" auto --layers 18 --set train.global_batch_size=32 $OFF_SET $EXT ;;
        tune-full12) tune "$task" "$TUNE_S" auto --layers 12 --set train.global_batch_size=32 ;;
        lora-m2nock-*) launch "$task" 200 auto --set train.method=lora $G32 --set train.micro_batch_size=2 \
            --set train.gradient_checkpointing=false ;;
        lora-m*) m=${task#lora-m}; m=${m%%-*}
            launch "$task" 200 auto --set train.method=lora $G32 --set train.micro_batch_size="$m" ;;
        lora-*) launch "$task" 200 auto --set train.method=lora $G32 ;;
        full12-m*) m=${task#full12-m}; m=${m%%-*}
            launch "$task" 200 auto --layers 12 $G32 --set train.micro_batch_size="$m" ;;
        full12-*) launch "$task" 150 auto --layers 12 $G32 ;;
        grid-lora) grid "$task" 240 --lora --layers 36 --micro 2,4,8,16 --checkpointed 0,half,all \
            --budget-s 200 --fetch-unit layer ;;
        grid-full12) grid "$task" 200 --layers 12 --micro 2,4,8,16 --checkpointed 0,half,all --budget-s 160 ;;
        dpo-full-*) launch "$task" 300 auto --layers 18 $G32 $DPO ;;
        ceiling-*) layers=${task#ceiling-}
            if ! fits 170; then echo "$task: skipped, $(($(date +%s) - began)) s into the call"; continue; fi
            t0=$(date +%s)
            (cd "$HERE" && timeout 170 python3 benchmarks/plain_pytorch_ceiling.py --layers "$layers" --micro 2,4,8 \
                --checkpointed 0 --budget-s 140 --out "$RES") > "$RES/$task.log" 2>&1
            echo "$task: exit $?, $(($(date +%s) - t0)) s"; save ;;
        synth-full*) layers=${task#synth-full}; layers=${layers%%-*}
            launch "$task" 200 auto --layers "$layers" $G32 --set data.path=synthetic:random ;;
        synth-bf16-full*) layers=${task#synth-bf16-full}; layers=${layers%%-*}
            launch "$task" 200 auto --layers "$layers" $G32 --set data.path=synthetic:random --set train.pure_bf16=true ;;
        bf16-full18-*) launch "$task" 200 auto --layers 18 $G32 --set train.pure_bf16=true ;;
        bf16-full12-*) launch "$task" 150 auto --layers 12 $G32 --set train.pure_bf16=true ;;
        trace-dpo-full) (export PYTHONPATH="$HERE/benchmarks/memory_trace:$PYTHONPATH" \
                DZCTL_BENCH_MEMORY_TRACE="$RES/$task"
            launch "$task" 300 auto --layers 18 --set train.global_batch_size=32 --steps 3 --warmup 1 $DPO) ;;
        dpo-lora-*) launch "$task" 300 auto --set train.method=lora $G32 $DPO ;;
        sftpairs-full-*) launch "$task" 240 auto --layers 18 $G32 $SFT_PAIRS ;;
        sftpairs-lora-*) launch "$task" 240 auto --set train.method=lora $G32 $SFT_PAIRS ;;
        *) echo "$task: unknown task" ;;
    esac
done
echo "call: $(($(date +%s) - began)) s"
exit 0
