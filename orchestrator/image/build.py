"""Building dzctl's image: the only module that drives ``docker build`` (through the docker SDK).

A build is two passes over ``docker/Dockerfile``:
1. build the image (live progress: steps, layers, elapsed);
2. run the image's probe (``docker/probe.py``) to read the versions actually inside it, then build
   again with those versions as ``dzctl.*`` labels. Every step of pass 2 is a cache hit: it only
   adds the labels. Labels are fixed at build time and preflight trusts them, so they are measured
   from the image rather than copied from the build args that were asked for.

The build context is a tarball made here: the repository filtered by ``.dockerignore`` plus, under
``docker/context/``, the ``--wheelhouse`` files and the ``--ca-bundle`` (the checkout is never
modified). Pure parts (build args, context file list, label set, progress parsing) are separate
from the calls that talk to the daemon.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import re
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import InputError, RuntimeFailure
from .sources import PipSources, is_remote, local_torch_wheels, read_pip_config, torch_wheel_flavour

DOCKERFILE = "docker/Dockerfile"
PROBE_ARGV = ("python", "/usr/local/lib/dzctl/probe.py")
PROBE_MARK = "DZCTL_PROBE "
NOTE_MARK = "dzctl: "
LABEL_PREFIX = "dzctl."
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the classic builder colours RUN stderr
VERSION_LABELS = ("cuda", "torch", "deepspeed", "nccl", "transformers", "version")
# What the probe also reports (docker/probe.py): cuDNN, the kernels/adapters the trainer can use,
# and DeepSpeed's ops (prebuilt into the image, or compatible: could be JIT-compiled there).
EXTRA_LABELS = (
    "cudnn",
    "liger-kernel",
    "peft",
    "deepspeed-ops-prebuilt",
    "deepspeed-ops-compatible",
    "nvcc",
    "torch-source",  # the file pip installed torch from (an index URL, or a wheel in the wheelhouse)
)
TORCH_VERSION = "2.13.0"

# The build args of each flavour. The CUDA set equals the Dockerfile's ARG defaults (a test holds
# them together), so a plain `docker build -f docker/Dockerfile .` makes the CUDA flavour too.
# TORCH_INDEX_URL is PyTorch's own index, the one place each flavour's torch build is published;
# it is used where it answers, and pip's configured sources otherwise (docker/install-python.sh).
FLAVOURS: dict[str, dict[str, str]] = {
    "cuda": {
        "BASE_IMAGE": "nvidia/cuda:13.0.2-devel-ubuntu24.04",
        "DZCTL_FLAVOUR": "cuda",
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu130",
        "DS_ACCELERATOR": "cuda",
        "TORCH_CUDA_ARCH_LIST": "8.0;9.0",
        "DS_BUILD_OPS_LIST": "CPU_ADAM FUSED_ADAM UTILS AIO",
        "EXTRA_SYSTEM_PACKAGES": "libibverbs1 ibverbs-providers rdma-core",
        "EXTRA_PYTHON_PACKAGES": "liger-kernel==0.8.5 peft==0.21.2",
    },
    "cpu": {
        "BASE_IMAGE": "debian:bookworm-slim",
        "DZCTL_FLAVOUR": "cpu",
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu",
        "DS_ACCELERATOR": "cpu",
        # No GPU architectures and no prebuilt CUDA ops; the CPU accelerator's shm op is
        # compiled during the build instead (docker/install-python.sh).
        "TORCH_CUDA_ARCH_LIST": "",
        "DS_BUILD_OPS_LIST": "",
        "EXTRA_SYSTEM_PACKAGES": "",
        "EXTRA_PYTHON_PACKAGES": "",
    },
}


class BuildFailed(RuntimeFailure):
    """The daemon reported an error in a build step."""


@dataclass(frozen=True)
class BuildRequest:
    flavour: str = "cuda"
    tag: str | None = None
    base_image: str | None = None
    wheelhouse: Path | None = None
    ca_bundle: Path | None = None
    offline: bool = False
    target: str | None = None  # a Dockerfile stage; such a build is not probed or labelled
    extra_args: dict[str, str] = field(default_factory=dict)
    torch_index_url: str | None = None  # None: the flavour's (PyTorch's index)
    # pip's configuration on this machine (None: read it when building; tests pass their own)
    pip_sources: PipSources | None = None

    @property
    def image_tag(self) -> str:
        return self.tag or default_tag(self.flavour)


@dataclass(frozen=True)
class BuiltImage:
    id: str
    tag: str
    labels: dict[str, str]
    versions: dict[str, str]
    elapsed_s: float
    digest: str | None = None
    notes: tuple[str, ...] = ()
    also_tagged: tuple[str, ...] = ()  # image_tags' other names, e.g. dzctl:cpu

    def to_dict(self) -> dict:
        return {
            "image_id": self.id,
            "tag": self.tag,
            "tags": [self.tag, *self.also_tagged],
            "digest": self.digest,
            "versions": self.versions,
            "labels": self.labels,
            "elapsed_s": round(self.elapsed_s, 1),
            "notes": list(self.notes),
        }


def default_tag(flavour: str) -> str:
    return f"dzctl:{__version__}-{flavour}"


def flavour_tag(flavour: str) -> str:
    """The name the shipped jobs run (``image: dzctl:cpu``): the newest build of that flavour."""
    return f"dzctl:{flavour}"


def image_tags(request: BuildRequest) -> tuple[str, ...]:
    """Every name a build gives its image, the first one the daemon's build sets (pure).

    Without ``--tag``: the versioned name, which stays put, and the flavour's name,
    which the shipped jobs say, so ``dzctl build`` then ``dzctl launch jobs/…`` runs
    what was just built. A tag the user gives is the only one: it moves no other name.
    A ``--target`` stage is not what nodes run, so it never takes the flavour's name.
    """
    if request.tag or request.target:
        return (request.image_tag,)
    return (request.image_tag, flavour_tag(request.flavour))


def add_tags(client, image_id: str, names) -> None:
    """Point each ``repository:tag`` in ``names`` at ``image_id`` (moving it off an older image)."""
    for name in names:
        repository, _, tag = name.rpartition(":")
        client.api.tag(image_id, repository, tag, force=True)


def build_args(request: BuildRequest) -> dict[str, str]:
    """The ``--build-arg`` set for a request (pure)."""
    if request.flavour not in FLAVOURS:
        raise InputError(f"unknown flavour '{request.flavour}'", fix=f"use one of: {', '.join(FLAVOURS)}")
    args = {**FLAVOURS[request.flavour], "TORCH_VERSION": TORCH_VERSION}
    if request.base_image:
        args["BASE_IMAGE"] = request.base_image
    if request.torch_index_url is not None:
        args["TORCH_INDEX_URL"] = request.torch_index_url
    args["PIP_OFFLINE"] = "1" if request.offline else "0"
    args.update(pip_source_args(request.pip_sources or PipSources()))
    args.update(request.extra_args)
    return args


def pip_source_args(sources: PipSources) -> dict[str, str]:
    """pip's configured remote sources as build args (pure); local ones travel as wheels instead."""
    remote_index = sources.index_url if sources.index_url and is_remote(sources.index_url) else ""
    return {
        "DZCTL_PIP_INDEX_URL": remote_index,
        "DZCTL_PIP_EXTRA_INDEX_URL": " ".join(sources.remote(sources.extra_index_urls)),
        "DZCTL_PIP_FIND_LINKS": " ".join(sources.remote(sources.find_links)),
        "DZCTL_PIP_TRUSTED_HOST": " ".join(sources.trusted_hosts),
    }


@dataclass(frozen=True)
class BuildInputs:
    """What goes into the build context besides the repository, and why (for the build's output)."""

    wheels: tuple[Path, ...] = ()  # the --wheelhouse files, then torch wheels from pip's local sources
    ca_bundle: Path | None = None
    notes: tuple[str, ...] = ()


def plan_inputs(request: BuildRequest) -> BuildInputs:
    """The wheelhouse and CA bundle for ``request`` from its options and pip's configuration."""
    sources = request.pip_sources or PipSources()
    wheels: list[Path] = []
    notes: list[str] = []
    if request.wheelhouse:
        _check_input_file(request.wheelhouse, "--wheelhouse", want_dir=True)
        wheels = sorted(entry for entry in request.wheelhouse.iterdir() if entry.is_file())
    flavour_torch = [w for w in wheels if torch_wheel_flavour(w.name, TORCH_VERSION) == request.flavour]
    if not flavour_torch:
        # The build cannot see this machine's folders: bring the flavour's torch from pip's local
        # sources (find-links folders, file:// indexes) into the wheelhouse.
        found = local_torch_wheels(sources, TORCH_VERSION, request.flavour)
        wheels += found
        for wheel in found:
            notes.append(f"torch: {wheel.name} from pip's configured {wheel.parent} (into the build's wheelhouse)")
        if not found:
            remote = sources.remote(sources.indexes + sources.find_links)
            where = ", ".join(remote) if remote else "pip's default index"
            notes.append(
                f"torch: no {request.flavour} torch {TORCH_VERSION} in pip's local sources; the build tries "
                f"PyTorch's index, then {where}"
            )
    ca_bundle = request.ca_bundle
    if ca_bundle:
        _check_input_file(ca_bundle, "--ca-bundle", want_dir=False)
    elif sources.cert and Path(sources.cert).is_file():
        ca_bundle = Path(sources.cert)
        notes.append(f"pip trusts {ca_bundle} during the build (pip's configured cert)")
    return BuildInputs(tuple(wheels), ca_bundle, tuple(notes))


def labels_for(versions: dict[str, str], build_time: str) -> dict[str, str]:
    """The ``dzctl.*`` labels from a probe's versions (pure)."""
    missing = [key for key in VERSION_LABELS if not versions.get(key)]
    if missing:
        raise RuntimeFailure(f"the image probe did not report: {', '.join(missing)}")
    labelled = [*VERSION_LABELS, *(key for key in EXTRA_LABELS if versions.get(key))]
    labels = {f"{LABEL_PREFIX}{key}": str(versions[key]) for key in labelled}
    labels[f"{LABEL_PREFIX}build-time"] = build_time
    return labels


def parse_probe(output: str) -> dict[str, str]:
    """The versions from the probe's stdout; libraries may print around the marked line."""
    for line in reversed(output.splitlines()):
        if line.startswith(PROBE_MARK):
            return json.loads(line[len(PROBE_MARK) :])
    tail = "\n".join(output.splitlines()[-10:])
    raise RuntimeFailure(f"the image probe printed no versions:\n{tail}")


# --- build context -------------------------------------------------------------------------------


def read_dockerignore(root: Path) -> list[str]:
    path = root / ".dockerignore"
    if not path.exists():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _matches(rel: str, pattern: str) -> bool:
    pattern = pattern.rstrip("/")
    if pattern == "**":
        return True
    if fnmatch.fnmatchcase(rel, pattern):
        return True
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return any(fnmatch.fnmatchcase("/".join(rel.split("/")[i:]), tail) for i in range(len(rel.split("/"))))
    return False


def is_ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes; a match of a parent counts."""
    parts = rel.split("/")
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        if any(_matches("/".join(parts[: i + 1]), body) for i in range(len(parts))):
            ignored = not negate
    return ignored


def _prunable(rel_dir: str, patterns: list[str]) -> bool:
    if rel_dir == ".git" or rel_dir.endswith("/.git"):
        return True
    if not is_ignored(rel_dir, patterns):
        return False
    for pattern in patterns:
        if pattern.startswith("!"):
            literal = re.split(r"[*?\[]", pattern[1:], maxsplit=1)[0]
            if not literal or literal.startswith(f"{rel_dir}/"):
                return False  # a wildcard-led or inside-this-folder re-include
    return True


def context_files(root: Path, patterns: list[str]) -> list[str]:
    """Repository files (relative, sorted) that go into the build context (pure but for the walk)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        prefix = "" if rel_dir == "." else f"{rel_dir}/"
        # Prune ignored folders (.venv, .git: hundreds of thousands of files) unless a `!` pattern
        # could re-include something inside them.
        dirnames[:] = sorted(d for d in dirnames if not _prunable(f"{prefix}{d}", patterns))
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if not is_ignored(rel, patterns):
                found.append(rel)
    return sorted(found)


def _check_input_file(path: Path, option: str, want_dir: bool) -> None:
    if want_dir and not path.is_dir():
        raise InputError(f"{option} {path}: not a directory", fix=f"give {option} a folder of .whl files")
    if not want_dir and not path.is_file():
        raise InputError(f"{option} {path}: no such file", fix=f"give {option} a PEM certificate bundle")


def write_context(root: Path, request: BuildRequest, out, inputs: BuildInputs | None = None) -> None:
    """Write the build-context tarball for ``request`` into the binary file ``out``."""
    inputs = inputs or plan_inputs(request)
    with tarfile.open(fileobj=out, mode="w") as tar:
        for rel in context_files(root, read_dockerignore(root)):
            tar.add(root / rel, arcname=rel, recursive=False)
        for wheel in inputs.wheels:
            tar.add(wheel, arcname=f"docker/context/wheelhouse/{wheel.name}")
        if inputs.ca_bundle:
            tar.add(inputs.ca_bundle, arcname="docker/context/ca-bundle.crt")


def repo_root() -> Path:
    """The folder holding ``docker/Dockerfile``: this checkout (dzctl builds from its own source)."""
    root = Path(__file__).resolve().parents[2]  # orchestrator/image/build.py -> the checkout
    if not (root / DOCKERFILE).is_file():
        raise InputError(
            f"{root / DOCKERFILE} not found: dzctl build needs a source checkout of dzctl",
            fix="run dzctl build from a git clone of dzctl (pip installs carry no Dockerfile)",
        )
    return root


# --- progress -----------------------------------------------------------------------------------


@dataclass
class BuildProgress:
    """Folds the daemon's JSON stream into steps; keeps each step's last lines for error reports."""

    on_update: Callable[[BuildProgress], None] | None = None
    step: str = ""
    step_index: int = 0
    step_count: int = 0
    cached_steps: int = 0
    image_id: str | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    step_started: float = field(default_factory=time.monotonic)
    tail: deque = field(default_factory=lambda: deque(maxlen=25))
    # Lines the build's own scripts mark "dzctl: " (where torch came from, ops left to JIT, ...):
    # shown to the user and kept in the report, not lost in the step's scroll.
    notes: list[str] = field(default_factory=list)

    def feed(self, chunk: dict) -> None:
        if "aux" in chunk and isinstance(chunk["aux"], dict) and "ID" in chunk["aux"]:
            self.image_id = chunk["aux"]["ID"]
        if "error" in chunk:
            detail = chunk.get("errorDetail") or {}
            self.error = detail.get("message") or chunk["error"]
        for line in str(chunk.get("stream", "")).splitlines():
            self._line(line.rstrip())
        if self.on_update:
            self.on_update(self)

    def _line(self, line: str) -> None:
        line = ANSI_ESCAPE.sub("", line)
        if not line:
            return
        if line.startswith("Step ") and " : " in line:
            head, _, instruction = line.partition(" : ")
            number, _, total = head[5:].partition("/")
            if number.isdigit() and total.isdigit():
                self.step_index, self.step_count = int(number), int(total)
                self.step = instruction
                self.step_started = time.monotonic()
                self.tail.clear()
                return
        if line.strip() == "---> Using cache":
            self.cached_steps += 1
        if line.startswith(NOTE_MARK) and line not in self.notes:
            self.notes.append(line)
        self.tail.append(line)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def describe(self) -> str:
        if not self.step_count:
            return "sending context"
        return f"step {self.step_index}/{self.step_count}: {self.step}"


def run_build(
    client, context_file, request: BuildRequest, labels: dict[str, str] | None, progress: BuildProgress, tag: bool
):
    """One ``docker build`` through the SDK; returns the image ID or raises ``BuildFailed``."""
    context_file.seek(0)
    progress.image_id = None
    stream = client.api.build(
        fileobj=context_file,
        custom_context=True,
        dockerfile=DOCKERFILE,
        tag=request.image_tag if tag else None,
        buildargs=build_args(request),
        target=request.target,
        labels=labels,
        # Host networking: these machines reach PyPI only from the host namespace, and no bridge
        # is set up for builds (containers always run --network host anyway).
        network_mode="host",
        rm=True,
        forcerm=True,
        pull=False,
        decode=True,
    )
    for chunk in stream:
        progress.feed(chunk)
    if progress.error:
        raise failure(progress, build_args(request))
    if not progress.image_id:
        raise BuildFailed(f"the daemon finished the build at {progress.describe()} without naming an image")
    return progress.image_id


def failure(progress: BuildProgress, args: dict[str, str]) -> BuildFailed:
    """The error for a failed build: the step (build args filled in), its last lines, a fix (pure)."""
    step = progress.step
    used = {name: value for name, value in args.items() if f"${{{name}}}" in step or f"${name}" in step}
    where = progress.describe() + (f"  ({', '.join(f'{k}={v}' for k, v in used.items())})" if used else "")
    lines = "".join(f"\n  | {line}" for line in progress.tail if line.strip())
    if progress.step.upper().startswith("FROM") and "BASE_IMAGE" in used:
        fix = f"the base image {used['BASE_IMAGE']} is neither in the local daemon nor pullable: docker load/pull it, "
        fix += "or pass --base-image with one that is"
    else:
        fix = "fix the failing step above; rerun with the same options (finished steps are cached)"
    return BuildFailed(f"build failed at {where}{lines}\n{progress.error}", fix=fix)


def probe_versions(client, image_id: str) -> dict[str, str]:
    """Run the image's probe and return the versions it reports."""
    import docker.errors

    try:
        out = client.containers.run(image_id, list(PROBE_ARGV), network_mode="host", remove=True, stderr=True)
    except docker.errors.ContainerError as exc:
        detail = exc.stderr.decode(errors="replace") if exc.stderr else str(exc)
        raise RuntimeFailure(f"the image probe failed in {image_id[:19]}:\n{detail[-2000:]}") from None
    return parse_probe(out.decode(errors="replace"))


def docker_client(timeout: int = 3600):
    """A docker SDK client for ``DOCKER_HOST`` (or the default socket), or a clear error."""
    import docker
    import docker.errors

    try:
        client = docker.from_env(version="auto", timeout=timeout)
        client.ping()
        return client
    except docker.errors.DockerException as exc:
        raise RuntimeFailure(
            f"cannot reach the Docker daemon ({os.environ.get('DOCKER_HOST', 'unix:///var/run/docker.sock')}): {exc}",
            fix="start dockerd, or point DOCKER_HOST at a running one",
        ) from None


@contextlib.contextmanager
def build_context(request: BuildRequest, root: Path | None = None, inputs: BuildInputs | None = None) -> Iterator:
    """A temporary context tarball (it may hold a multi-GB wheelhouse: on disk, not in memory)."""
    with tempfile.TemporaryFile(prefix="dzctl-context-") as context_file:
        write_context(root or repo_root(), request, context_file, inputs)
        yield context_file


def with_machine_sources(request: BuildRequest) -> BuildRequest:
    """``request`` with this machine's pip configuration, unless it carries its own."""
    if request.pip_sources is not None:
        return request
    return dataclasses.replace(request, pip_sources=read_pip_config())


def build_image(
    request: BuildRequest,
    client=None,
    progress: BuildProgress | None = None,
    root: Path | None = None,
    on_note: Callable[[str], None] | None = None,
) -> BuiltImage:
    """Build, probe and label the image; return its ID, labels and versions."""
    client = client or docker_client()
    progress = progress or BuildProgress()
    request = with_machine_sources(request)
    inputs = plan_inputs(request)
    for note in inputs.notes:
        if on_note:
            on_note(note)

    def notes() -> tuple[str, ...]:
        return (*inputs.notes, *progress.notes)

    with build_context(request, root, inputs) as context_file:
        if request.target:
            image_id = run_build(client, context_file, request, None, progress, tag=True)
            return BuiltImage(image_id, request.image_tag, {}, {}, progress.elapsed_s, notes=notes())
        # Pass 1 stays untagged: the tag keeps naming the previous image until pass 2 replaces it.
        unlabelled = run_build(client, context_file, request, None, progress, tag=False)
        versions = probe_versions(client, unlabelled)
        previous = _same_build(client, request.image_tag, unlabelled, versions)
        also = image_tags(request)[1:]
        if previous is not None:
            # Nothing changed: keep the existing image (and its ID, which nodes may already hold)
            # rather than minting a new ID that differs only in its build-time label.
            labels = dict(previous.labels)
            add_tags(client, previous.id, also)
            return BuiltImage(
                previous.id, request.image_tag, labels, versions, progress.elapsed_s, notes=notes(), also_tagged=also
            )
        labels = labels_for(versions, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        progress.step, progress.step_index, progress.step_count = "labelling", 0, 0
        image_id = run_build(client, context_file, request, labels, progress, tag=True)
        add_tags(client, image_id, also)
    return BuiltImage(
        image_id, request.image_tag, labels, versions, progress.elapsed_s, notes=notes(), also_tagged=also
    )


def _same_build(client, tag: str, unlabelled_id: str, versions: dict[str, str]):
    """The image ``tag`` names if it is this very build plus labels for these versions, else None."""
    import docker.errors

    try:
        current = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    labels = current.labels or {}
    wanted = labels_for(versions, "")
    if any(labels.get(key) != value for key, value in wanted.items() if key != f"{LABEL_PREFIX}build-time"):
        return None
    # Label steps are config-only children of the unlabelled image: walk up a few parents.
    image_id = current.id
    for _ in range(len(VERSION_LABELS) + len(EXTRA_LABELS) + 2):
        if image_id == unlabelled_id:
            return current
        image_id = client.api.inspect_image(image_id).get("Parent") or ""
        if not image_id:
            return None
    return None


def push_reference(client, name: str, registry: str, on_line: Callable[[str], None] | None = None):
    """Tag ``name`` as ``REGISTRY/<repo>:<tag>`` and push it; return (that reference, its digest)."""
    repository, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    remote = f"{registry.rstrip('/')}/{repository.split('/')[-1]}"
    client.api.tag(name, remote, tag)
    digest = None
    for chunk in client.api.push(remote, tag, stream=True, decode=True):
        if "error" in chunk:
            raise RuntimeFailure(f"push to {remote}:{tag} failed: {chunk['error']}")
        digest = (chunk.get("aux") or {}).get("Digest", digest)
        if on_line and chunk.get("status"):
            on_line(f"{chunk.get('id', '')} {chunk['status']} {chunk.get('progress', '')}".strip())
    return f"{remote}:{tag}", digest


def push_image(client, image: BuiltImage, registry: str, on_line: Callable[[str], None] | None = None) -> BuiltImage:
    """Push a built image to ``registry``; return it under its registry name, with the digest."""
    remote, digest = push_reference(client, image.tag, registry, on_line)
    return dataclasses.replace(image, tag=remote, digest=digest)


def image_labels(client, image: str) -> dict[str, str]:
    return dict(client.images.get(image).labels or {})


def iter_versions(labels: dict[str, str]) -> Iterable[tuple[str, str]]:
    for key in (*VERSION_LABELS, *EXTRA_LABELS, "build-time"):
        if key in EXTRA_LABELS and f"{LABEL_PREFIX}{key}" not in labels:
            continue
        yield key, labels.get(f"{LABEL_PREFIX}{key}", "?")
