#!/usr/bin/env bash
# Makes the README's loss plot from a real run: the tiny CPU job (real ZeRO-3, 2 ranks, gloo) on
# this machine with the process runtime, 120 steps, then `dzctl status JOB --plot`. The run's own
# progress record is kept beside the image (raw output), copied back with `dzctl logs --fetch`.
#   docs/make-readme-plot.sh        (from the repository root, after ./dev demo has set up .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DZCTL_VENV:-.venv}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export DZCTL_HOME="$work/home"
port="$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$VENV/bin/dzctl" launch jobs/tiny-cpu.yaml --hosts hostfiles/localhost.txt --runtime process --follow \
    --set train.max_steps=120 --set train.save_steps=60 --set "launch.remote_dir=$work/remote" \
    --set "launch.master_port=$port" --set "launch.python=$PWD/$VENV/bin/python" > "$work/follow.txt" 2>&1
job_id="$(sed -n 's/^started \([^ ]*\) on .*/\1/p' "$work/follow.txt")"
"$VENV/bin/dzctl" status "$job_id" --plot docs/images/tiny-cpu-loss.png
"$VENV/bin/dzctl" logs "$job_id" --fetch "$work/fetched"
cp "$work/fetched/progress.jsonl" docs/images/tiny-cpu-loss.progress.jsonl
cp "$work/follow.txt" docs/images/tiny-cpu-loss.follow.txt
echo "wrote docs/images/tiny-cpu-loss.png from $job_id"
