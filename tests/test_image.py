"""dzctl build: the Dockerfile's flavours, the build context, progress/failure reporting, and real builds.

Integration tests build with a real dockerd on this machine's root namespace, on a Debian base made
locally with debootstrap (no registry can be reached here); see tests/baseimage.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from orchestrator.image.build import (
    DOCKERFILE,
    FLAVOURS,
    TORCH_VERSION,
    BuildProgress,
    BuildRequest,
    build_args,
    context_files,
    is_ignored,
    labels_for,
    parse_probe,
    read_dockerignore,
    write_context,
)

ROOT = Path(__file__).resolve().parent.parent


def dockerfile_args() -> dict[str, str]:
    """``ARG NAME=default`` lines of the Dockerfile (later stages repeat some: first value wins)."""
    found: dict[str, str] = {}
    for line in (ROOT / DOCKERFILE).read_text().splitlines():
        match = re.match(r'^ARG (\w+)=(?:"([^"]*)"|(\S*))\s*$', line)
        if match:
            found.setdefault(match.group(1), match.group(2) if match.group(2) is not None else match.group(3))
    return found


def dockerfile_stages() -> list[tuple[str, str]]:
    return re.findall(r"^FROM (\S+) AS (\w+)$", (ROOT / DOCKERFILE).read_text(), flags=re.M)


# -- the Dockerfile's variants (pure) -------------------------------------------------------------


def test_cuda_flavour_is_the_dockerfile_default():
    args = build_args(BuildRequest(flavour="cuda"))
    defaults = dockerfile_args()
    for name, value in FLAVOURS["cuda"].items():
        assert defaults[name] == value, name
    assert defaults["TORCH_VERSION"] == TORCH_VERSION
    no_pip_sources = {"DZCTL_PIP_INDEX_URL": "", "DZCTL_PIP_EXTRA_INDEX_URL": "", "DZCTL_PIP_FIND_LINKS": ""}
    no_pip_sources["DZCTL_PIP_TRUSTED_HOST"] = ""
    assert args == {**FLAVOURS["cuda"], "TORCH_VERSION": TORCH_VERSION, "PIP_OFFLINE": "0", **no_pip_sources}
    for name, value in no_pip_sources.items():
        assert defaults[name] == value, name


def test_cuda_flavour_build_args():
    args = build_args(BuildRequest(flavour="cuda"))
    # A devel image: DeepSpeed compiles its ops against the CUDA toolkit.
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-devel-ubuntu\d\d\.\d\d", args["BASE_IMAGE"])
    # torch built for the same CUDA major.minor as the base.
    cuda = re.search(r"cuda:(\d+)\.(\d+)", args["BASE_IMAGE"]).groups()
    assert args["TORCH_INDEX_URL"] == f"https://download.pytorch.org/whl/cu{cuda[0]}{cuda[1]}"
    # A100 = 8.0, H100/H200 = 9.0; without a list DeepSpeed's op build crashes on '0a'.
    assert args["TORCH_CUDA_ARCH_LIST"].split(";") == ["8.0", "9.0"]
    assert set(args["DS_BUILD_OPS_LIST"].split()) >= {"CPU_ADAM", "FUSED_ADAM"}
    assert set(args["EXTRA_SYSTEM_PACKAGES"].split()) >= {"libibverbs1", "ibverbs-providers", "rdma-core"}
    assert args["DS_ACCELERATOR"] == "cuda" and args["DZCTL_FLAVOUR"] == "cuda"
    # Liger's fused loss and LoRA through PEFT ride in the CUDA image, pinned.
    assert {spec.split("==")[0] for spec in args["EXTRA_PYTHON_PACKAGES"].split()} == {"liger-kernel", "peft"}
    assert all("==" in spec for spec in args["EXTRA_PYTHON_PACKAGES"].split())
    # libaio for DeepSpeed's async I/O (NVMe offload), in every flavour's system stage.
    assert "libaio-dev" in dockerfile_args()["SYSTEM_PACKAGES"].split()


def test_cpu_flavour_build_args_and_overrides():
    args = build_args(BuildRequest(flavour="cpu", base_image="debian:bookworm", offline=True))
    assert args["BASE_IMAGE"] == "debian:bookworm"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args["DS_ACCELERATOR"] == "cpu"
    assert args["TORCH_CUDA_ARCH_LIST"] == "" and args["DS_BUILD_OPS_LIST"] == ""
    assert args["PIP_OFFLINE"] == "1"


def test_dockerfile_stages_and_every_build_arg_declared():
    assert [name for _, name in dockerfile_stages()] == ["system", "python", "final"]
    declared = dockerfile_args()
    for flavour in FLAVOURS:
        assert set(build_args(BuildRequest(flavour=flavour))) <= set(declared), flavour


def test_unknown_flavour_is_input_error():
    from orchestrator.errors import InputError

    with pytest.raises(InputError, match="unknown flavour 'rocm'"):
        build_args(BuildRequest(flavour="rocm"))


def test_labels_from_probe():
    versions = {
        "cuda": "13.0",
        "torch": "2.13.0+cu130",
        "deepspeed": "0.19.8",
        "nccl": "2.28.9",
        "transformers": "5.23.0",
        "version": "0.1.0",
    }
    labels = labels_for(versions, "2026-11-30T01:00:00Z")
    assert labels == {
        "dzctl.cuda": "13.0",
        "dzctl.torch": "2.13.0+cu130",
        "dzctl.deepspeed": "0.19.8",
        "dzctl.nccl": "2.28.9",
        "dzctl.transformers": "5.23.0",
        "dzctl.version": "0.1.0",
        "dzctl.build-time": "2026-11-30T01:00:00Z",
    }
    from orchestrator.errors import RuntimeFailure

    with pytest.raises(RuntimeFailure, match="did not report: nccl"):
        labels_for({**versions, "nccl": ""}, "t")


def test_parse_probe_skips_library_noise():
    out = '[INFO] Setting ds_accelerator to cpu\nDZCTL_PROBE {"torch": "2.13.0+cpu"}\n'
    assert parse_probe(out) == {"torch": "2.13.0+cpu"}


# -- build context (pure) -------------------------------------------------------------------------


def test_dockerignore_keeps_package_and_docker_only():
    patterns = read_dockerignore(ROOT)
    assert not is_ignored("orchestrator/image/build.py", patterns)
    assert not is_ignored("docker/Dockerfile", patterns)
    assert not is_ignored("pyproject.toml", patterns)
    assert is_ignored(".venv/bin/python", patterns)
    assert is_ignored("tests/test_image.py", patterns)
    assert is_ignored("orchestrator/__pycache__/x.cpython-311.pyc", patterns)


def test_context_carries_wheelhouse_and_ca_bundle(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
    ca = tmp_path / "proxy.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    expected = context_files(ROOT, read_dockerignore(ROOT))  # before: others may add files meanwhile
    buffer = io.BytesIO()
    write_context(ROOT, BuildRequest(flavour="cpu", wheelhouse=wheels, ca_bundle=ca), buffer)
    buffer.seek(0)
    with tarfile.open(fileobj=buffer) as tar:
        names = tar.getnames()
    assert "docker/context/wheelhouse/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl" in names
    assert "docker/context/ca-bundle.crt" in names
    assert DOCKERFILE in names and "orchestrator/image/build.py" in names
    assert not [n for n in names if n.startswith((".venv/", ".git/", "tests/"))]
    assert set(names) >= set(expected)


def test_missing_wheelhouse_is_input_error(tmp_path):
    from orchestrator.errors import InputError

    with pytest.raises(InputError, match=r"--wheelhouse .*not a directory"):
        write_context(ROOT, BuildRequest(wheelhouse=tmp_path / "nope"), io.BytesIO())


def test_progress_folds_the_daemon_stream():
    # The classic builder's stream, as dockerd 20.10 sends it (recorded from a real build here).
    seen = []
    progress = BuildProgress(on_update=lambda p: seen.append(p.describe()))
    for chunk in [
        {"stream": "Step 1/3 : FROM base AS system"},
        {"stream": "\n"},
        {"stream": " ---> 0b1a2c3d4e5f\n"},
        {"stream": "Step 2/3 : RUN sh /usr/local/lib/dzctl/install-python.sh torch"},
        {"stream": "\n"},
        {"stream": " ---> Using cache\n"},
        {"stream": "Step 3/3 : RUN false"},
        {"stream": "\n ---> Running in 1234\n"},
        {"stream": "\x1b[91mERROR: No matching distribution found for filelock\n\x1b[0m"},
        {
            "errorDetail": {"code": 1, "message": "The command '/bin/sh -c false' returned a non-zero code: 1"},
            "error": "The command '/bin/sh -c false' returned a non-zero code: 1",
        },
    ]:
        progress.feed(chunk)
    assert progress.step_count == 3 and progress.step_index == 3
    assert progress.cached_steps == 1
    assert "ERROR: No matching distribution found for filelock" in progress.tail  # colour codes gone
    assert progress.error.endswith("returned a non-zero code: 1")
    assert "step 2/3: RUN sh /usr/local/lib/dzctl/install-python.sh torch" in seen


# -- real builds ----------------------------------------------------------------------------------


def dzctl(args: list[str], docker_url: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "DOCKER_HOST": docker_url}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def docker_cli(args: list[str], docker_url: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", docker_url, *args], capture_output=True, text=True, timeout=timeout)


# Parallel test runs on one daemon (several checkouts) each name their own image: one shared tag let a
# run in another checkout re-tag it mid-run, and this run's e2e then ran that checkout's code.
CHECKOUT_TAG = "c" + hashlib.sha1(str(Path(__file__).resolve().parents[1]).encode()).hexdigest()[:10]
CPU_TAG = os.environ.get("DZCTL_TEST_CPU_TAG", f"dzctl-test/cpu:{CHECKOUT_TAG}")
CUDA_SYSTEM_TAG = "dzctl-test/cuda:system"


def cpu_build_args(base_image: str) -> list[str]:
    """`dzctl build` of the CPU flavour on the local base, as a user types it: no --wheelhouse, no
    --ca-bundle. The torch wheel and the CA come from pip's configuration on this machine (its
    find-links hold the CPU wheel; its cert trusts the TLS-intercepting proxy)."""
    return ["build", "--flavour", "cpu", "--base-image", base_image, "--tag", CPU_TAG, "--json"]


@pytest.mark.integration
@pytest.mark.slow
def test_cpu_image_imports_and_labels_are_true(cpu_image_build, local_docker_url):
    script = (
        "import json, torch, deepspeed, transformers, orchestrator;"
        "print(json.dumps({'torch': torch.__version__, 'deepspeed': deepspeed.__version__,"
        " 'transformers': transformers.__version__, 'version': orchestrator.__version__,"
        " 'cuda': torch.version.cuda or 'cpu'}))"
    )
    # By ID, not tag: other test sessions on this machine may re-tag dzctl-test/cpu meanwhile.
    image_id = cpu_image_build["image_id"]
    ran = docker_cli(["run", "--rm", "--network", "host", image_id, "python", "-c", script], local_docker_url)
    assert ran.returncode == 0, ran.stderr[-2000:]
    inside = json.loads(ran.stdout.strip().splitlines()[-1])
    fmt = "{{json .Config.Labels}} {{.Id}}"
    inspected = docker_cli(["image", "inspect", "--format", fmt, image_id], local_docker_url)
    labels_json, inspected_id = inspected.stdout.strip().rsplit(" ", 1)
    labels = json.loads(labels_json)
    assert inspected_id == image_id
    for key, value in inside.items():
        assert labels[f"dzctl.{key}"] == value, key
    assert labels["dzctl.cuda"] == "cpu" and "+cpu" in labels["dzctl.torch"]
    assert labels["dzctl.nccl"] == "none"  # a CPU torch has no NCCL, and says so
    assert labels["dzctl.cudnn"] == "none"
    # Where torch came from: the CPU wheel pip's configured sources hold, brought in by dzctl build.
    assert re.fullmatch(
        rf"the build's wheelhouse \(torch-{re.escape(TORCH_VERSION)}\+cpu-.*\.whl\)", labels["dzctl.torch-source"]
    )
    # No nvidia-* CUDA libraries in a CPU image (PyPI's CUDA torch brings ~4 GB of them).
    listed = docker_cli(["run", "--rm", image_id, "pip", "list", "--format", "freeze"], local_docker_url)
    assert listed.returncode == 0, listed.stderr
    assert not [line for line in listed.stdout.splitlines() if line.lower().startswith("nvidia-")]
    # Nor Liger and its Triton (about 1 GB, GPU-only; CPU jobs use the chunked loss).
    assert not [line for line in listed.stdout.splitlines() if line.lower().startswith(("liger", "triton"))]
    assert labels["dzctl.liger-kernel"] == "none"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", labels["dzctl.build-time"])
    assert cpu_image_build["labels"] == {k: v for k, v in labels.items() if k.startswith("dzctl.")}


@pytest.mark.integration
@pytest.mark.slow
def test_build_ends_with_the_image_in_the_layer_store(cpu_image_build, local_docker_url):
    # distribute then sends nodes the stored blobs: no docker save while they wait.
    from orchestrator.image.store import default_root

    layers = json.loads(
        docker_cli(
            ["image", "inspect", "--format", "{{json .RootFS.Layers}}", cpu_image_build["image_id"]], local_docker_url
        ).stdout
    )
    report = cpu_image_build["layer_store"]
    assert report["filled"], report
    assert report["layers_total"] == len(layers) and 0 <= report["layers_pushed"] <= len(layers)
    assert report["note"].startswith(f"layer store: {report['layers_pushed']} of {len(layers)} layers pushed")
    # The session's store (tests/conftest.py) records every layer the daemon pushed to it.
    assert set(layers) <= set((default_root() / "layers.txt").read_text().split())


@pytest.mark.integration
@pytest.mark.slow
def test_cpu_image_runs_the_trainer_module_and_deepspeed_cpu_op(cpu_image_build, local_docker_url):
    # The shm op was compiled at build time: loading it must not compile (no "Building extension").
    script = (
        "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=True);"
        "import importlib.util; assert importlib.util.find_spec('orchestrator.train'); print('ok')"
    )
    image_id = cpu_image_build["image_id"]
    ran = docker_cli(["run", "--rm", "--network", "host", image_id, "python", "-c", script], local_docker_url)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip().endswith("ok")
    assert "Building extension" not in ran.stdout + ran.stderr
    helped = docker_cli(["run", "--rm", image_id, "python", "-m", "orchestrator.train", "--help"], local_docker_url)
    assert helped.returncode == 0, helped.stderr[-2000:]


@pytest.mark.integration
@pytest.mark.slow
def test_rebuild_without_changes_keeps_the_image_id(cpu_image_build, local_docker_url, base_image):
    # Same inputs, same image: nodes that hold it need nothing new (build-time is not bumped).
    again = dzctl(cpu_build_args(base_image), local_docker_url)
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads(again.stdout)
    assert report["image_id"] == cpu_image_build["image_id"]
    assert report["labels"]["dzctl.build-time"] == cpu_image_build["labels"]["dzctl.build-time"]


@pytest.mark.integration
def test_cuda_flavour_first_stage_builds_here(local_docker_url, base_image):
    # No CUDA base can be pulled here: build the CUDA flavour's first stage on the local Debian
    # base. That runs its real system step (IB user libraries for NCCL, compiler, Python).
    done = dzctl(
        ["build", "--flavour", "cuda", "--base-image", base_image, "--target", "system", "--tag", CUDA_SYSTEM_TAG],
        local_docker_url,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pkgs = ["libibverbs1", "ibverbs-providers", "rdma-core", "g++", "python3-dev"]
    ran = docker_cli(
        ["run", "--rm", CUDA_SYSTEM_TAG, "dpkg-query", "-W", "-f", "${Package} ${Status}\n", *pkgs],
        local_docker_url,
    )
    assert ran.returncode == 0, ran.stderr
    for pkg in pkgs:
        assert f"{pkg} install ok installed" in ran.stdout


@pytest.mark.integration
def test_build_failure_names_the_step_without_traceback(local_docker_url):
    done = dzctl(
        ["build", "--flavour", "cpu", "--base-image", "dzctl-test/no-such-base:1", "--tag", "dzctl-test/broken"],
        local_docker_url,
        timeout=600,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "error: build failed at step 2/" in done.stderr
    assert "FROM ${BASE_IMAGE} AS system" in done.stderr
    assert "(BASE_IMAGE=dzctl-test/no-such-base:1)" in done.stderr
    assert "fix: the base image dzctl-test/no-such-base:1 is neither in the local daemon nor pullable" in done.stderr


# -- a flavour holds what it says -------------------------------------------------------------------

# A port nothing listens on: an index that cannot be reached, refused at once.
UNREACHABLE = "http://127.0.0.1:9/simple"


def bare_pip_env(docker_url: str, **extra: str) -> dict[str, str]:
    """This environment with pip's configuration files and sources removed (its CA kept)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "DOCKER_HOST": docker_url, **extra}


def build_with_env(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=1800, env=env
    )


def image_exists(tag: str, docker_url: str) -> bool:
    return docker_cli(["image", "inspect", tag], docker_url).returncode == 0


@pytest.mark.integration
def test_cpu_build_with_no_cpu_torch_anywhere_fails_at_the_torch_step(local_docker_url, base_image):
    # The user's case from issue 16: PyTorch's CPU index out of reach, PyPI reachable (its torch is
    # a CUDA build). The build must not label PyPI's CUDA torch cpu: it stops at the torch step,
    # before DeepSpeed and the rest, and names the fix.
    tag = "dzctl-test/cpu-no-torch:image"
    docker_cli(["rmi", "-f", tag], local_docker_url)
    args = ["build", "--flavour", "cpu", "--base-image", base_image, "--tag", tag]
    done = build_with_env([*args, "--torch-index-url", UNREACHABLE], bare_pip_env(local_docker_url))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "install-python.sh torch" in done.stderr  # the failing step: the first Python step
    assert f"pip found no cpu build of torch {TORCH_VERSION}" in done.stderr
    assert "Fix: give dzctl build --wheelhouse DIR" in done.stderr
    assert "cannot be reached" in done.stderr  # it says which source it could not use
    assert not image_exists(tag, local_docker_url)


@pytest.mark.integration
def test_cuda_build_refuses_a_cpu_torch(local_docker_url, base_image):
    # The reverse: a wheelhouse holding only the CPU wheel (authoritative for torch until now) and
    # no index that has a CUDA build. The cuda flavour must not install the CPU wheel.
    from baseimage import torch_wheelhouse

    tag = "dzctl-test/cuda-cpu-torch:image"
    docker_cli(["rmi", "-f", tag], local_docker_url)
    args = ["build", "--flavour", "cuda", "--base-image", base_image, "--tag", tag]
    args += ["--wheelhouse", str(torch_wheelhouse()), "--torch-index-url", UNREACHABLE]
    done = build_with_env(args, bare_pip_env(local_docker_url, PIP_INDEX_URL=UNREACHABLE))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "the wheelhouse has no cuda torch" in done.stderr
    assert f"pip found no cuda build of torch {TORCH_VERSION}" in done.stderr
    assert not image_exists(tag, local_docker_url)


# -- a code change touches only the last layers ----------------------------------------------------


def test_dockerfile_keeps_its_order_os_torch_deps_project():
    steps = [line for line in (ROOT / DOCKERFILE).read_text().splitlines() if re.match(r"^(RUN|COPY) ", line)]

    def first(fragment: str) -> int:
        return next(i for i, step in enumerate(steps) if fragment in step)

    order = ["apt-install.sh ${SYSTEM_PACKAGES}", "install-python.sh torch", "install-python.sh deps"]
    order += ["install-python.sh project-deps", "COPY orchestrator /opt/dzctl-src/orchestrator"]
    assert [first(fragment) for fragment in order] == sorted(first(fragment) for fragment in order)
    # The whole package is copied only after every dependency step (a code change reaches no
    # earlier layer); its __init__ (the version, read by the metadata) alone is copied before.
    early = [step for step in steps[: first("COPY orchestrator /opt")] if "orchestrator" in step]
    assert early == ["COPY orchestrator/__init__.py /opt/dzctl-meta/orchestrator/__init__.py"]


def layer_ids(client, image_id: str) -> list[str]:
    return client.api.inspect_image(image_id)["RootFS"]["Layers"]


@pytest.mark.integration
@pytest.mark.slow
def test_a_code_change_leaves_every_earlier_layer_unchanged(cpu_image_build, local_docker_url, base_image, tmp_path):
    import shutil

    import docker

    from orchestrator.image.build import build_image

    # A copy of the build context with one line changed in a module of orchestrator/.
    copy = tmp_path / "src"
    for rel in context_files(ROOT, read_dockerignore(ROOT)):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, copy / rel)
    changed = copy / "orchestrator" / "cli.py"
    changed.write_text(changed.read_text() + f"\n# a one-line change ({tmp_path.name})\n")
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=1800)
    request = BuildRequest(flavour="cpu", base_image=base_image, tag=f"{CPU_TAG}-changed")
    rebuilt = build_image(request, client, root=copy)
    before, after = layer_ids(client, cpu_image_build["image_id"]), layer_ids(client, rebuilt.id)
    assert rebuilt.id != cpu_image_build["image_id"] and len(before) == len(after)
    same = next(i for i, (old, new) in enumerate(zip(before, after, strict=True)) if old != new)
    # What changed starts at the layer holding the package's code: its parent image (the build
    # keeps intermediate images) is the one whose layers are exactly the unchanged prefix.
    parent = client.api.inspect_image(rebuilt.id)
    while len(parent["RootFS"]["Layers"]) > same:
        parent = client.api.inspect_image(parent["Parent"])
    assert parent["RootFS"]["Layers"] == before[:same]
    history = [entry["CreatedBy"] for entry in client.api.history(rebuilt.id)]
    first_new = next(h for h in reversed(history) if "/opt/dzctl-src/orchestrator" in h)
    assert "COPY dir:" in first_new
    # Every layer under the code is the old one; what is left to ship is a sliver of the image.
    changed_bytes = client.api.inspect_image(rebuilt.id)["Size"] - parent["Size"]
    assert changed_bytes < 0.02 * client.api.inspect_image(rebuilt.id)["Size"], changed_bytes
    assert len(after) - same <= 5


@pytest.mark.integration
@pytest.mark.slow
def test_a_readme_edit_leaves_the_dependency_layers_unchanged(cpu_image_build, local_docker_url, base_image, tmp_path):
    import shutil

    import docker

    from orchestrator.image.build import build_image

    # pyproject.toml names README.md as its readme; the dependency step must not depend on its text.
    copy = tmp_path / "src"
    for rel in context_files(ROOT, read_dockerignore(ROOT)):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, copy / rel)
    readme = copy / "README.md"
    readme.write_text(readme.read_text() + f"\nA one-line README edit ({tmp_path.name}).\n")
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=1800)
    request = BuildRequest(flavour="cpu", base_image=base_image, tag=f"{CPU_TAG}-readme")
    rebuilt = build_image(request, client, root=copy)
    before, after = layer_ids(client, cpu_image_build["image_id"]), layer_ids(client, rebuilt.id)
    assert rebuilt.id != cpu_image_build["image_id"] and len(before) == len(after)
    same = next(i for i, (old, new) in enumerate(zip(before, after, strict=True)) if old != new)
    # What changed starts at the final stage's copy of the package source (which holds the README):
    # the venv with every dependency, under it, is the old one.
    parent = client.api.inspect_image(rebuilt.id)
    while len(parent["RootFS"]["Layers"]) > same:
        parent = client.api.inspect_image(parent["Parent"])
    assert parent["RootFS"]["Layers"] == before[:same]
    new_steps = [entry["CreatedBy"] for entry in client.api.history(rebuilt.id)]
    new_steps = new_steps[: len(new_steps) - len(client.api.history(parent["Id"]))]
    assert "/opt/dzctl-src/" in new_steps[-1] and not any("/opt/venv" in step for step in new_steps), new_steps
    changed_bytes = client.api.inspect_image(rebuilt.id)["Size"] - parent["Size"]
    assert changed_bytes < 0.02 * client.api.inspect_image(rebuilt.id)["Size"], changed_bytes
    client.images.remove(rebuilt.id, noprune=True, force=True)


def test_preflight_reads_the_cuda_images_gpu_labels():
    from orchestrator.preflight.checks import gpu_stack_check

    labels = {"dzctl.cuda": "13.0", "dzctl.torch": "2.13.0+cu130", "dzctl.nccl": "2.29.7", "dzctl.cudnn": "9.15.1"}
    prebuilt = {**labels, "dzctl.deepspeed-ops-prebuilt": "cpu_adam,fused_adam", "dzctl.nvcc": "13.0"}
    assert gpu_stack_check(prebuilt).status == "ok"
    jit_only = {**labels, "dzctl.deepspeed-ops-prebuilt": "none", "dzctl.nvcc": "none"}
    assert gpu_stack_check(jit_only).status == "warn" and "no nvcc" in gpu_stack_check(jit_only).detail
    assert gpu_stack_check({**labels, "dzctl.nccl": "none"}).status == "fail"
    assert gpu_stack_check({"dzctl.cuda": "cpu", "dzctl.nccl": "none"}) is None  # cuda_driver_check's case
    assert gpu_stack_check({"dzctl.cuda": "13.0"}) is None  # an image from before these labels
