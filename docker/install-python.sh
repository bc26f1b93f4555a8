#!/bin/sh
# Python side of the image, one build step per call so Docker caches the slow steps separately:
#   install-python.sh torch     venv + torch (from the wheelhouse only, or from TORCH_INDEX_URL)
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
export PIP_FIND_LINKS="$EXTRA/wheelhouse"
if [ "${PIP_OFFLINE:-0}" = "1" ]; then
    export PIP_NO_INDEX=1
fi
# Every step is held to the pinned versions: a later step never swaps torch for PyPI's default
# (a multi-GB CUDA build) or moves DeepSpeed.
cat > /tmp/dzctl-constraints.txt <<PINS
torch==${TORCH_VERSION}
deepspeed==${DEEPSPEED_VERSION}
transformers==${TRANSFORMERS_VERSION}
PINS
export PIP_CONSTRAINT=/tmp/dzctl-constraints.txt

has_wheel() { ls "$EXTRA/wheelhouse"/"$1"-*.whl >/dev/null 2>&1; }

case "$1" in
torch)
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --upgrade pip setuptools wheel
    if has_wheel torch; then
        # A wheelhouse with torch in it is authoritative: no index may offer another build. Its
        # dependencies (filelock, sympy, ...) may still come from the index.
        "$VENV/bin/pip" install --no-index --no-deps "torch==${TORCH_VERSION}"
        "$VENV/bin/pip" install "torch==${TORCH_VERSION}"
    else
        "$VENV/bin/pip" install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple \
            "torch==${TORCH_VERSION}"
    fi
    ;;
deps)
    # DeepSpeed ships as an sdist; building it without isolation lets its setup see our torch
    # (isolation would fetch PyPI's default torch) and prebuild the ops named in DS_BUILD_OPS_LIST.
    for op in ${DS_BUILD_OPS_LIST:-}; do
        export "DS_BUILD_${op}=1"
    done
    "$VENV/bin/pip" install ninja packaging
    DS_ACCELERATOR="$DS_ACCELERATOR" "$VENV/bin/pip" install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"
    "$VENV/bin/pip" install "transformers==${TRANSFORMERS_VERSION}" safetensors
    if [ "$DS_ACCELERATOR" = "cpu" ]; then
        # DeepSpeed's CPU accelerator JIT-compiles its shared-memory op at first use (~1.5 min on
        # 2 cores); compile it once here into a folder the final image keeps.
        DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$VENV/torch-extensions" "$VENV/bin/python" -c \
            "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
    fi
    ;;
project-deps)
    "$VENV/bin/pip" install "/opt/dzctl-meta[train]"
    ;;
*)
    echo "install-python.sh: unknown step '$1'" >&2
    exit 2
    ;;
esac
