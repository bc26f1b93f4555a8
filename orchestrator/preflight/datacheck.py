"""The ``data`` check: the sources the nodes read where they are, looked for on every node.

A source given relative to the job file is shipped with it (checked on this machine by
``planning/inputs.py``). An absolute path (shared storage) or a hub ID (``hf:ORG/NAME``)
is read on the nodes, so it is checked there, before anything starts:

- an absolute path must exist, be readable and have rows: a file of 0 bytes, one of only
  blank lines, an empty JSON array (``[]``) or an empty folder has none. With ``runtime:
  docker`` the path is the container's: it is looked for at the host path of the
  ``launch.mounts`` entry that holds it, and a path no mount holds is a failure (the
  container would not see it);
- a hub ID must be in the node's Hugging Face datasets cache (``HF_DATASETS_CACHE``, or
  ``HF_HOME``/datasets, from ``launch.env`` where set), or the hub must be reachable from
  the node (not tried under ``HF_DATASETS_OFFLINE=1``, where only the cache counts).
"""

from __future__ import annotations

import json

from ..planning.inputs import is_node_side
from ..spec.job import HUB_PREFIX, parse_mount
from ..transport.connection import Connection
from .model import Check, fail, ok

# A file's head, blanks removed, is printed when the file is this small: enough to tell `[]` or
# blank lines (no rows) from data, without reading a large file on the node.
SMALL_FILE = 64
PATHS_SCRIPT = (
    'for p in "$@"; do '
    'if [ -d "$p" ]; then if [ -r "$p" ] && [ -x "$p" ]; then '
    'printf "dir\\t%s\\t%s\\n" "$p" "$(ls -A -- "$p" | wc -l)"; '
    'else printf "unreadable\\t%s\\n" "$p"; fi; '
    'elif [ -f "$p" ]; then if [ -r "$p" ]; then s=$(wc -c < "$p"); h=; '
    f'if [ "$s" -le {SMALL_FILE} ]; then h=$(tr -d " \\t\\r\\n" < "$p"); fi; '
    'printf "file\\t%s\\t%s\\t%s\\n" "$p" "$s" "$h"; '
    'else printf "unreadable\\t%s\\n" "$p"; fi; '
    'else printf "missing\\t%s\\n" "$p"; fi; done'
)
NO_ROWS = ("", "[]")  # a small file's head, blanks and a BOM removed: no row in it
# Part of every node probe that may need the hub (this one, and preflight/loading/weights.py's):
# whether the node reaches it, into out["hub"] or out["hub_error"].
REACH_HUB = r"""
def reach_hub(out):
    import os, socket
    from urllib.parse import urlparse
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:
        socket.create_connection((host, 443), timeout=5).close()
        out["hub"] = host
    except OSError as exc:
        out["hub_error"] = f"{host}: {exc}"
"""
# The node's answer for hub IDs: where its cache has each, or whether the hub answers.
HUB_PROBE = (
    REACH_HUB
    + r"""
import json, os, re, sys
home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
out = {"cache": cache, "offline": offline, "found": {}}
for name in sys.argv[1:]:
    parts = name.split(":")[0].split("/")
    last = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", parts[-1])).lower()
    folder = os.path.join(cache, "___".join(parts[:-1] + [last]))
    out["found"][name] = folder if os.path.isdir(folder) and os.listdir(folder) else None
if not offline and not all(out["found"].values()):
    reach_hub(out)
print(json.dumps(out))
"""
)


def node_side_sources(spec) -> list[tuple[str, str]]:
    """(key, path) of each source the nodes read where it is.

    A source with ``shipped_from`` (a node's own job spec, as Slurm's in-allocation preflight reads it)
    is the job directory's copy of a local file: the launcher checked that file before shipping it, and
    in a container its path is the job directory's mount, which no ``launch.mounts`` entry holds."""
    many = spec.data.sources is not None
    found = (
        []
        if spec.data.synthetic
        else [(f"data.sources[{i}].path" if many else "data.path", s) for i, s in enumerate(spec.data.all_sources())]
    )
    held = spec.data.eval
    if held is not None:
        found += [
            (f"data.eval.sources[{i}].path" if held.sources is not None else "data.eval.path", s)
            for i, s in enumerate(spec.data.eval_sources())
        ]
    return [(key, s.path) for key, s in found if is_node_side(s.path) and s.shipped_from is None]


def host_path(spec, path: str) -> str | None:
    """Where a container path is on the node (through launch.mounts); None if no mount holds it."""
    if spec.runtime != "docker":
        return path
    best = None
    for mount in spec.launch.mounts:
        host, container, _ = parse_mount(mount)
        container = container.rstrip("/") or "/"
        if (path == container or path.startswith(container.rstrip("/") + "/")) and (
            best is None or len(container) > len(best[1])
        ):
            best = (host.rstrip("/") or "/", container)
    if best is None:
        return None
    rest = path[len(best[1]) :].lstrip("/")
    return f"{best[0]}/{rest}" if rest else best[0]


def check_data(conn: Connection, ctx, host_env: dict[str, str] | None = None) -> list[Check]:
    spec = ctx.spec
    found = node_side_sources(spec)
    files = [(key, path) for key, path in found if not path.startswith(HUB_PREFIX)]
    hub = [(key, path[len(HUB_PREFIX) :]) for key, path in found if path.startswith(HUB_PREFIX)]
    problems: list[tuple[str, str]] = []
    details: list[str] = []
    on_node = {}
    for key, path in files:
        mapped = host_path(spec, path)
        if mapped is None:
            problems.append(
                (
                    f"{key} {path} is in no launch.mounts entry: the container would not see it",
                    f"add a mount to launch.mounts that holds {path} (HOST_PATH:CONTAINER_PATH:ro)",
                )
            )
        else:
            on_node[mapped] = (key, path)
    if on_node:
        result = conn.run(["sh", "-c", PATHS_SCRIPT, "sh", *on_node], timeout=30)
        for line in result.stdout.splitlines():
            kind, _, rest = line.partition("\t")
            where, _, rest = rest.partition("\t")
            size, _, head = rest.partition("\t")
            key, path = on_node.get(where, ("data", where))
            shown = path if where == path else f"{path} (on the node: {where})"
            fix = f"put the data at {where} on {conn.host} (every node reads it there), or fix {key}"
            if kind == "missing":
                problems.append((f"{key} {shown} does not exist on {conn.host}", fix))
            elif kind == "unreadable":
                problems.append((f"{key} {shown} is not readable on {conn.host}", f"make it readable: {fix}"))
            elif size.strip() in ("", "0"):
                problems.append((f"{key} {shown} is empty on {conn.host}", fix))
            elif kind == "file" and int(size) <= SMALL_FILE and head.removeprefix("\ufeff") in NO_ROWS:
                what = "an empty JSON array" if "[" in head else "only blank lines"
                problems.append((f"{key} {shown} has no rows on {conn.host} ({what})", fix))
            else:
                details.append(f"{path}: {size.strip()} {'bytes' if kind == 'file' else 'entries'}")
    if hub:
        env = {k: v for k, v in spec.launch.env.items() if k.startswith("HF_")}
        if spec.runtime == "docker":
            env = {k: (host_path(spec, v) or v) if v.startswith("/") else v for k, v in env.items()}
        python = ctx.python
        result = conn.run([python, "-c", HUB_PROBE, *[name for _, name in hub]], timeout=30, env=env or None)
        try:
            answer = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            answer = None
        if answer is None:
            problems.append(
                (f"cannot look for hub datasets on {conn.host}: {result.stderr.strip()[-200:]}", f"check {python}")
            )
        else:
            for key, name in hub:
                cached = answer["found"].get(name)
                if cached:
                    details.append(f"hf:{name}: in the cache ({cached})")
                elif answer.get("hub"):
                    details.append(f"hf:{name}: not cached, the hub ({answer['hub']}) is reachable")
                else:
                    why = "offline mode" if answer["offline"] else answer.get("hub_error", "hub unreachable")
                    problems.append(
                        (
                            f"{key} hf:{name} is not in {conn.host}'s datasets cache {answer['cache']} ({why})",
                            "load it once on the nodes (datasets.load_dataset) into that cache, set HF_HOME in "
                            "launch.env to where it is, or make the hub reachable",
                        )
                    )
    if problems:
        return [fail("data", "; ".join(p for p, _ in problems), problems[0][1])]
    return [ok("data", "; ".join(details))] if details else []
