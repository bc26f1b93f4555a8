#!/bin/sh
# The collective check on the GPU machine (2×H200, one node, no docker, no network), through the product:
#   sh benchmarks/collective_h200.sh
# 1. `dzctl preflight ... --runtime process --json` on localhost: the check's figures are under
#    "collective" in $OUT/preflight.json (preflight itself may fail on other checks there: the
#    machine has no `ip` binary, so the route check fails; the collective still runs).
# 2. The same module by hand under torchrun at 256 MiB and 1 GiB with NCCL_DEBUG=INFO: the raw
#    NCCL lines the parsers are tested on (tests/fixtures/nccl/), and the figure at 1 GiB.
# Env for a local smoke test on CPU: SKIP_INSTALL=1 JOB=jobs/tiny-cpu.yaml NPROC=2.
set -u
OUT=${OUT:-benchmarks/results/collective-latest}
mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
PY=${PY:-python3}
JOB=${JOB:-jobs/qwen3-8b.yaml}
NPROC=${NPROC:-2}
export TORCH_CUDA_ARCH_LIST=9.0
# NVLink multicast stays off on these shared hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 DZCTL_HOME=/tmp/dzctl-home
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1 || true
start=$(date +%s.%N)
"$PY" -m orchestrator preflight "$JOB" --hosts hostfiles/localhost.txt --runtime process \
  --set launch.python="$PY" --set launch.remote_dir=/tmp/dzctl-nccl --json >"$OUT/preflight.json" 2>"$OUT/preflight.stderr"
echo "preflight rc=$? in $(echo "$(date +%s.%N) - $start" | bc 2>/dev/null || echo '?') s"
"$PY" - "$OUT/preflight.json" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
col = report.get("collective") or {}
print("collective:", json.dumps({k: col.get(k) for k in ("ran", "ok", "backend", "dtype", "world_size", "bytes", "iters",
      "busbw_gbs", "algbw_gbs", "form_s", "launch_to_group_s", "elapsed_s", "transports", "failure", "reason")}))
for host in report["hosts"]:
    for check in host["checks"]:
        if check["name"] == "collective" or check["status"] != "ok":
            print(f"  {host['host']} {check['name']} {check['status']}: {check['detail'][:400]}")
PYEOF
for size in 268435456 1073741824; do
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH,P2P,SHM "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    -m orchestrator.train.collective --bytes $size --iters 20 --per-round 4 --warmup 5 --timeout 120 >"$OUT/nccl-$size.log" 2>&1
  echo "by hand, $size bytes: rc=$? $(grep '"event": "result"' "$OUT/nccl-$size.log" | head -1)"
done
