"""The ``weights`` check: the model every rank loads with ``from_pretrained``, looked for on every node.

dzctl does not copy weights. A rank reads ``model.name_or_path`` where it runs, as transformers does:

- an absolute path is a folder on the node (shared storage, or a copy on each node's disk). It
  must hold a readable ``config.json`` and its weight files (``*.safetensors`` or
  ``pytorch_model*.bin``; with a ``*.index.json``, every shard it names). With ``runtime: docker``
  the path is the container's, looked for at its ``launch.mounts`` host path (as ``datacheck.py``
  does for data);
- anything else is a hub ID, read from the Hugging Face cache the ranks see: ``HF_HUB_CACHE``,
  else ``HF_HOME``/hub (from ``launch.env``, mapped through the mounts for docker; a container
  without ``HF_HOME`` has only its own empty cache). The revision is ``refs/main``'s snapshot, and
  its config and weights must be readable (a snapshot's links point into ``blobs/``). Where it is
  not cached, the ranks download it: that needs the hub (never tried under ``HF_HUB_OFFLINE=1``, so
  no network is assumed), a cache the ranks may write (not a ``:ro`` mount) and the space for the
  weights there (the model's parameters at 2 bytes each, bf16, as hub checkpoints mostly are).

``model.init: random`` reads no weights: with ``model.config.model_type`` nothing at all (the tiny
CPU job), else only the named model's ``config.json``.
"""

from __future__ import annotations

import json

from ...spec.job import JobSpec, parse_mount
from ...transport.connection import Connection
from .. import parsers as p
from ..datacheck import REACH_HUB, host_path
from ..model import Check, fail, ok, warn

# On the node, with the job's HF_* variables. argv: one JSON request. Prints one JSON line; never a traceback.
PROBE = (
    REACH_HUB
    + r"""
import glob, json, os, sys
req = json.loads(sys.argv[1])
out = {}
def readable(path):
    try:
        with open(path, "rb") as f:
            f.read(1)
        return True
    except OSError:
        return False
def look(folder, want_weights):
    out["folder"] = folder
    if not os.path.isdir(folder):
        out["problem"] = "missing"; return
    out["config"] = readable(os.path.join(folder, "config.json"))
    if not want_weights:
        return
    names = set()
    for index in glob.glob(os.path.join(folder, "*.index.json")):
        try:
            names.update(json.load(open(index)).get("weight_map", {}).values())
        except (OSError, ValueError):
            out.setdefault("unreadable", []).append(os.path.basename(index))
    for pattern in ("*.safetensors", "pytorch_model*.bin"):
        names.update(os.path.basename(f) for f in glob.glob(os.path.join(folder, pattern)))
    out["weights"], out["weight_bytes"] = sorted(names), 0
    for name in sorted(names):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            out.setdefault("absent", []).append(name)
        elif not readable(path):
            out.setdefault("unreadable", []).append(name)
        else:
            out["weight_bytes"] += os.path.getsize(path)
if req["kind"] == "folder":
    look(req["path"], req["weights"])
else:
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    cache = out["cache"] = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    out["offline"] = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    repo = os.path.join(cache, "models--" + req["id"].replace("/", "--"))
    try:
        out["revision"] = open(os.path.join(repo, "refs", "main")).read().strip()
    except OSError:
        out["revision"] = None
    if out["revision"]:
        look(os.path.join(repo, "snapshots", out["revision"]), req["weights"])
    else:
        d = cache
        while not os.path.exists(d):
            d = os.path.dirname(d)
        st = os.statvfs(d)
        out["free_bytes"], out["writable"] = st.f_bavail * st.f_frsize, os.access(d, os.W_OK)
        if not out["offline"]:
            reach_hub(out)
print("DZCTL_WEIGHTS " + json.dumps(out))
"""
)
MARK = "DZCTL_WEIGHTS "
HUB_VARS = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT")
BYTES_PER_PARAM = 2  # bf16 checkpoints, as most hub models ship


def request_for(spec: JobSpec) -> dict | None:
    """What to look for on the nodes (pure); None when the ranks read nothing from disk."""
    model = spec.model
    if model.init == "random" and (model.config or {}).get("model_type"):
        return None
    weights = model.init == "pretrained"
    if model.name_or_path.startswith("/"):
        return {"kind": "folder", "path": model.name_or_path, "weights": weights}
    return {"kind": "hub", "id": model.name_or_path, "weights": weights}


def probe_env(spec: JobSpec) -> tuple[dict[str, str], bool]:
    """The ranks' HF_* variables as the node sees them (container paths mapped through the mounts),
    and whether the ranks may write the hub cache (a ``:ro`` mount forbids it)."""
    env = {k: v for k, v in spec.launch.env.items() if k in HUB_VARS}
    if spec.runtime != "docker":
        return env, True
    writable = True
    for name in ("HF_HUB_CACHE", "HF_HOME"):
        path = env.get(name)
        if path and path.startswith("/"):
            env[name] = host_path(spec, path) or path
            if name == "HF_HUB_CACHE" or "HF_HUB_CACHE" not in env:
                writable = writable and _mount_mode(spec, path) == "rw"
    return env, writable


def _mount_mode(spec: JobSpec, path: str) -> str | None:
    best = None
    for mount in spec.launch.mounts:
        _host, container, mode = parse_mount(mount)
        container = container.rstrip("/") or "/"
        if (path == container or path.startswith(container.rstrip("/") + "/")) and (
            best is None or len(container) > len(best[0])
        ):
            best = (container, mode)
    return best[1] if best else None


def check_weights(conn: Connection, ctx, weights_bytes: int | None = None) -> list[Check]:
    spec: JobSpec = ctx.spec
    request = request_for(spec)
    if request is None:
        return []
    env, writable = probe_env(spec)
    shown = request.get("path") or request["id"]
    if request["kind"] == "folder":
        mapped = host_path(spec, request["path"])
        if mapped is None:
            return [
                fail(
                    "weights",
                    f"model.name_or_path {shown} is in no launch.mounts entry: the container would not see it",
                    f"add a mount to launch.mounts that holds {shown} (HOST_PATH:CONTAINER_PATH:ro)",
                )
            ]
        request = {**request, "path": mapped}
    if spec.runtime == "docker" and request["kind"] == "hub" and not ({"HF_HOME", "HF_HUB_CACHE"} & set(env)):
        # The container's own cache is not on the node to look at; unless the image holds the model, it is empty.
        return [
            warn(
                "weights",
                f"model.name_or_path {shown} is a hub ID, and launch.env sets no HF_HOME: each container has "
                "only its own cache, and unless the image holds the model every launch downloads it again",
                "set launch.env.HF_HOME to a folder of launch.mounts that holds the Hugging Face cache",
            )
        ]
    result = conn.run([ctx.python, "-c", PROBE, json.dumps(request)], timeout=60, env=env or None)
    try:
        answer = p.parse_json_line(result.stdout, MARK)
    except p.ParseError:
        tail = (result.stderr or result.stdout).strip()[-200:]
        return [fail("weights", f"cannot look for the model on {conn.host}: {tail}", f"check {ctx.python}")]
    return [weights_verdict(answer, request, shown, conn.host, writable, weights_bytes)]


def weights_verdict(
    answer: dict, request: dict, shown: str, host: str, writable: bool = True, weights_bytes: int | None = None
) -> Check:
    """Pure: the node's answer about the model, as a check."""
    key = "model.name_or_path"
    if request["kind"] == "hub" and not answer.get("revision"):
        return _not_cached(answer, shown, host, writable, weights_bytes)
    folder = answer.get("folder", "")
    where = f"{shown} (the cached snapshot {folder})" if request["kind"] == "hub" else _shown(shown, folder)
    place = "the nodes' cache" if request["kind"] == "hub" else f"{folder} on {host}"
    fix = f"put the model (config.json and its weight files) at {place}, readable by the SSH user, or fix {key}"
    if answer.get("problem") == "missing":
        return fail("weights", f"{key} {where} does not exist on {host}", fix)
    if not answer.get("config"):
        return fail("weights", f"{key} {where} has no readable config.json on {host}", fix)
    if not request["weights"]:
        return ok("weights", f"{where}: config.json (model.init: random reads no weights)")
    if not answer.get("weights"):
        return fail("weights", f"{key} {where} has no weight files (*.safetensors, pytorch_model*.bin) on {host}", fix)
    for kind, what in (("absent", "missing"), ("unreadable", "not readable")):
        if answer.get(kind):
            return fail("weights", f"{key} {where}: {', '.join(answer[kind])} {what} on {host}", fix)
    count = len(answer["weights"])
    return ok("weights", f"{where}: config.json and {count} weight file(s), {p.gib(answer['weight_bytes'])}")


def _shown(shown: str, folder: str) -> str:
    return shown if shown == folder else f"{shown} (on the node: {folder})"


def _not_cached(answer: dict, shown: str, host: str, writable: bool, weights_bytes: int | None) -> Check:
    cache = answer.get("cache", "the cache")
    fix = (
        f"download it once into the cache the ranks read (HF_HUB_CACHE={cache} hf download "
        f"{shown}), or copy the model to a folder on the nodes and set model.name_or_path to it"
    )
    if answer.get("offline"):
        return fail("weights", f"{shown} is not in {host}'s hub cache {cache} (HF_HUB_OFFLINE is set)", fix)
    if "hub" not in answer:
        why = answer.get("hub_error", "the hub is unreachable")
        return fail("weights", f"{shown} is not in {host}'s hub cache {cache}, and {why}", fix)
    if not writable or not answer.get("writable"):
        return fail(
            "weights",
            f"{shown} is not in {host}'s hub cache {cache}, and the ranks cannot write there to download it",
            fix + "; or make the cache writable (a :rw mount)",
        )
    free = answer.get("free_bytes", 0)
    if weights_bytes is not None and free < weights_bytes:
        return fail(
            "weights",
            f"{shown} is not cached; downloading it to {cache} needs about {p.gib(weights_bytes)}, "
            f"{p.gib(free)} free on {host}",
            f"free space there, point HF_HOME at a larger disk, or {fix}",
        )
    return ok("weights", f"{shown}: not cached, the ranks download it from {answer['hub']} into {cache}")
