#!/bin/sh
# Python side of the image, one build step per call so Docker caches the slow steps separately:
#   install-python.sh torch     venv + the flavour's torch (wheelhouse first, then TORCH_INDEX_URL
#                               where it answers, then pip's configured sources), checked
#   install-python.sh deps      DeepSpeed (ops prebuilt as asked) + transformers
#   install-python.sh project-deps  this project's dependencies (from its metadata), pins untouched
# Inputs come from build args (TORCH_VERSION, ...), see docker/Dockerfile.
set -eu
EXTRA=/tmp/dzctl-build
VENV=/opt/venv
# The venv's tools first: torch finds `ninja` (for DeepSpeed's op builds) on PATH, not by import.
export PATH="$VENV/bin:$PATH"

# pip trusts the CA bundle given to `dzctl build --ca-bundle` (a TLS-intercepting proxy) for this
# step only: the file sits in the build stage, the final image never sees it.
if [ -s "$EXTRA/ca-bundle.crt" ]; then
    export PIP_CERT="$EXTRA/ca-bundle.crt"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
# pip's configured sources on the machine that ran `dzctl build` (orchestrator/image/sources.py):
# remote ones as given, local ones already copied into the wheelhouse.
export PIP_FIND_LINKS="$EXTRA/wheelhouse${DZCTL_PIP_FIND_LINKS:+ $DZCTL_PIP_FIND_LINKS}"
[ -n "${DZCTL_PIP_INDEX_URL:-}" ] && export PIP_INDEX_URL="$DZCTL_PIP_INDEX_URL"
[ -n "${DZCTL_PIP_EXTRA_INDEX_URL:-}" ] && export PIP_EXTRA_INDEX_URL="$DZCTL_PIP_EXTRA_INDEX_URL"
[ -n "${DZCTL_PIP_TRUSTED_HOST:-}" ] && export PIP_TRUSTED_HOST="$DZCTL_PIP_TRUSTED_HOST"
if [ "${PIP_OFFLINE:-0}" = "1" ]; then
    export PIP_NO_INDEX=1
fi
FLAVOUR="${DZCTL_FLAVOUR:-cuda}"
# The torch build this flavour must hold. PEP 440: `==V` matches every build of V (+cpu, +cu130,
# PyPI's unlabelled CUDA wheel), and pip takes the highest, so the flavour is named explicitly.
case "$FLAVOUR" in
cpu) TORCH_WANT="torch==${TORCH_VERSION}+cpu" ;;
cuda) TORCH_WANT="torch==${TORCH_VERSION},!=${TORCH_VERSION}+cpu" ;;
*)
    echo "install-python.sh: unknown DZCTL_FLAVOUR '$FLAVOUR'" >&2
    exit 2
    ;;
esac
# Every step is held to the pinned versions: a later step never swaps torch for another build
# (a multi-GB CUDA one in a CPU image) or moves DeepSpeed.
pins() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        echo "torch==$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"
    else
        echo "$TORCH_WANT"
    fi
    echo "deepspeed==${DEEPSPEED_VERSION}"
    echo "transformers==${TRANSFORMERS_VERSION}"
}

has_wheel() { ls "$EXTRA/wheelhouse"/"$1"-*.whl >/dev/null 2>&1; }

# Whether PyPI-style index URL $1 answers for torch, within seconds (pip itself would retry an
# unreachable index for minutes); prints the reason when it does not.
index_answers() {
    "$VENV/bin/python" - "$1" <<'PY'
import os, ssl, sys, urllib.request
url = sys.argv[1].rstrip("/") + "/torch/"
context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
try:
    urllib.request.urlopen(url, timeout=15, context=context).close()
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(1)
PY
}

torch_unavailable() {
    cat >&2 <<MSG
dzctl: pip found no $FLAVOUR build of torch $TORCH_VERSION for this base's Python (or could not fetch it: its error is above)
  in the sources it was given (the wheelhouse${PIP_INDEX_URL:+, $PIP_INDEX_URL}${PIP_EXTRA_INDEX_URL:+, $PIP_EXTRA_INDEX_URL}${TORCH_INDEX_IN_USE:+, $TORCH_INDEX_IN_USE}, pip's default index).
  A $FLAVOUR image is never built with another torch. Fix: give dzctl build --wheelhouse DIR holding
  the wheel (torch-$TORCH_VERSION$( [ "$FLAVOUR" = cpu ] && echo +cpu)-cpXY-...whl), or point pip's find-links/index-url
  (pip config, PIP_FIND_LINKS, PIP_INDEX_URL) at a source that has it, or --torch-index-url URL.
MSG
    exit 3
}

case "$1" in
torch)
    python3 -m venv "$VENV"
    # A newer pip where one can be had; the base's own (>= 22.2, for --report) otherwise. Optional, so
    # one try per source: against an index that does not answer, pip's 5 retries with backoff per
    # package cost about half a minute (minutes where packets are dropped) before this fallback.
    "$VENV/bin/pip" install --retries 0 --upgrade pip setuptools wheel ||
        echo "dzctl: pip, setuptools and wheel not upgraded (no source had them): the base's pip is used"
    pins > /tmp/dzctl-constraints.txt
    export PIP_CONSTRAINT=/tmp/dzctl-constraints.txt
    installed=0
    if has_wheel torch; then
        # A wheelhouse with this flavour's torch in it is authoritative: no index may offer
        # another build. Its dependencies (filelock, sympy, ...) may still come from an index.
        if "$VENV/bin/pip" install --no-index --no-deps --report /tmp/torch-report.json "$TORCH_WANT"; then
            "$VENV/bin/pip" install "$TORCH_WANT"
            installed=1
        else
            echo "dzctl: the wheelhouse has no $FLAVOUR torch $TORCH_VERSION for this Python; trying the indexes"
        fi
    fi
    if [ "$installed" = 0 ]; then
        TORCH_INDEX_IN_USE=""
        if [ "${PIP_OFFLINE:-0}" = "1" ]; then
            echo "dzctl: offline build: torch only from the wheelhouse"
        elif [ -n "${TORCH_INDEX_URL:-}" ] && reason=$(index_answers "$TORCH_INDEX_URL"); then
            TORCH_INDEX_IN_USE="$TORCH_INDEX_URL"
            echo "dzctl: PyTorch's index $TORCH_INDEX_URL answers: torch from there where it has the build"
        else
            echo "dzctl: PyTorch's index ${TORCH_INDEX_URL:-(none)} cannot be reached (${reason:-not set}):" \
                "torch from pip's configured sources"
        fi
        "$VENV/bin/pip" install ${TORCH_INDEX_IN_USE:+--extra-index-url "$TORCH_INDEX_IN_USE"} \
            --report /tmp/torch-report.json "$TORCH_WANT" || torch_unavailable
    fi
    # Which file pip took (so the build output says where torch came from), and whether the torch
    # now installed is the flavour's build, before any long step builds on it.
    "$VENV/bin/python" /usr/local/lib/dzctl/check_torch.py "$FLAVOUR" /tmp/torch-report.json
    rm -f /tmp/torch-report.json
    ;;
deps)
    pins > /tmp/dzctl-constraints.txt
    export PIP_CONSTRAINT=/tmp/dzctl-constraints.txt
    # DeepSpeed ships as an sdist; building it without isolation lets its setup see our torch
    # (isolation would fetch another torch) and prebuild the ops named in DS_BUILD_OPS_LIST. That
    # needs nvcc (a CUDA devel base); without it the ops are left to JIT, which needs nvcc where
    # the op is first used, so the build says so.
    if [ "$DS_ACCELERATOR" = "cuda" ] && [ -n "${DS_BUILD_OPS_LIST:-}" ] && ! command -v nvcc >/dev/null \
        && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
        echo "dzctl: no nvcc in this base (not a CUDA devel image): DeepSpeed ops ${DS_BUILD_OPS_LIST} are NOT" \
            "prebuilt; they JIT-compile at first use, which needs a CUDA toolkit (nvcc) in the image"
        DS_BUILD_OPS_LIST=""
    fi
    for op in ${DS_BUILD_OPS_LIST:-}; do
        export "DS_BUILD_${op}=1"
    done
    "$VENV/bin/pip" install ninja packaging
    DS_ACCELERATOR="$DS_ACCELERATOR" "$VENV/bin/pip" install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"
    # shellcheck disable=SC2086 # a list of requirements
    "$VENV/bin/pip" install "transformers==${TRANSFORMERS_VERSION}" safetensors ${EXTRA_PYTHON_PACKAGES:-}
    if [ "$DS_ACCELERATOR" = "cpu" ]; then
        # DeepSpeed's CPU accelerator JIT-compiles its shared-memory op at first use (~1.5 min on
        # 2 cores); compile it once here into a folder the final image keeps.
        DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$VENV/torch-extensions" "$VENV/bin/python" -c \
            "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
    fi
    ;;
project-deps)
    pins > /tmp/dzctl-constraints.txt
    export PIP_CONSTRAINT=/tmp/dzctl-constraints.txt
    # The gpu extra (Liger's fused loss) runs on GPUs only: CPU jobs use the chunked loss and never
    # import it, and with the Triton it pulls in it would be about 1 GB of a CPU image every node is sent.
    case "$FLAVOUR" in
    cuda) EXTRAS=train,gpu ;;
    cpu) EXTRAS=train ;;
    esac
    "$VENV/bin/pip" install "/opt/dzctl-meta[$EXTRAS]"
    ;;
*)
    echo "install-python.sh: unknown step '$1'" >&2
    exit 2
    ;;
esac
