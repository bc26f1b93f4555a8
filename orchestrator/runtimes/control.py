"""The node runtimes behind one interface: what dzctl runs on a node to start, inspect, follow and stop one rank.

Pure: argv builders and parsers of their output, one class per runtime
(``node_runtime(name)``). ``docker`` asks the daemon about the container (by its
deterministic name; it carries the job labels); ``process`` asks
``orchestrator.runtimes.process``, which keeps the same facts in the job directory.
Where the argv runs (over SSH to each node, or inside a Slurm allocation) is the
backend's business, not the runtime's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

STOP_GRACE_S = 10  # SIGTERM first: torchrun forwards it and ranks may exit cleanly


@dataclass(frozen=True)
class NodeState:
    state: str  # running | exited | created | dead | missing | unreachable
    exit_code: int | None = None
    oom_killed: bool = False
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None


def _nodeexec(python: str, action: str, job_dir: str, rank: int, *extra: str) -> list[str]:
    return [python, "-m", "orchestrator.runtimes.process", action, "--job-dir", job_dir, "--rank", str(rank), *extra]


class DockerRuntime:
    """One container per node, named deterministically and labelled; the daemon keeps its state."""

    name = "docker"

    def start_argv(self, node: dict) -> list[str]:
        return list(node["argv"])  # `docker run --detach ...`, built by plan.py

    def inspect_argv(self, node: dict, python: str) -> list[str]:
        return ["docker", "inspect", "--type", "container", node["container_name"]]

    def parse_inspect(self, exit_code: int, stdout: str, stderr: str) -> NodeState:
        if exit_code != 0:
            if "No such" in stderr or "no such" in stderr:
                return NodeState("missing")
            return NodeState("unreachable", error=stderr.strip().splitlines()[-1] if stderr.strip() else None)
        (info,) = json.loads(stdout)
        st = info["State"]
        status = {"running": "running", "exited": "exited", "created": "created", "dead": "dead"}.get(
            st["Status"], st["Status"]
        )
        return NodeState(
            state=status,
            exit_code=st.get("ExitCode") if status in ("exited", "dead") else None,
            oom_killed=bool(st.get("OOMKilled")),
            started_at=_docker_time(st.get("StartedAt")),
            finished_at=_docker_time(st.get("FinishedAt")) if status in ("exited", "dead") else None,
            error=st.get("Error") or None,
        )

    def logs_argv(self, node: dict, python: str, *, tail: int | None, follow: bool) -> list[str]:
        argv = ["docker", "logs"]
        if tail is not None:
            argv += ["--tail", str(tail)]
        if follow:
            argv.append("--follow")
        return [*argv, node["container_name"]]

    def stop_argv(self, node: dict, python: str) -> list[str]:
        return ["docker", "stop", "--time", str(STOP_GRACE_S), node["container_name"]]

    def remove_argv(self, node: dict) -> list[str] | None:
        return ["docker", "rm", "--force", node["container_name"]]


class ProcessRuntime:
    """One detached launcher per node under ``orchestrator.runtimes.process``, its facts in the job directory."""

    name = "process"

    def start_argv(self, node: dict) -> list[str]:
        return list(node["argv"])  # `python -m orchestrator.runtimes.process start ...`, built by plan.py

    def inspect_argv(self, node: dict, python: str) -> list[str]:
        return _nodeexec(python, "status", node["job_dir"], node["node_rank"])

    def parse_inspect(self, exit_code: int, stdout: str, stderr: str) -> NodeState:
        if exit_code != 0:
            return NodeState("unreachable", error=(stderr.strip() or stdout.strip())[-300:] or None)
        info = json.loads(stdout)
        return NodeState(
            state=info.get("state", "missing"),
            exit_code=info.get("exit_code"),
            started_at=info.get("started"),
            finished_at=info.get("finished"),
            error=info.get("error"),
        )

    def logs_argv(self, node: dict, python: str, *, tail: int | None, follow: bool) -> list[str]:
        extra = [] if tail is None else ["--tail", str(tail)]
        if not follow:
            extra.append("--no-follow")
        return _nodeexec(python, "follow", node["job_dir"], node["node_rank"], *extra)

    def stop_argv(self, node: dict, python: str) -> list[str]:
        return _nodeexec(python, "stop", node["job_dir"], node["node_rank"], "--grace", str(STOP_GRACE_S))

    def remove_argv(self, node: dict) -> list[str] | None:
        return None  # the process runtime leaves only files


RUNTIMES = {"docker": DockerRuntime(), "process": ProcessRuntime()}


def node_runtime(name: str) -> DockerRuntime | ProcessRuntime:
    """The one object that knows how a node runs a rank under ``runtime: name``: start, inspect, logs, stop."""
    return RUNTIMES[name]


# The same operations as functions of the runtime's name (what observe.py and the collective check call).
def inspect_argv(runtime: str, node: dict, python: str) -> list[str]:
    return node_runtime(runtime).inspect_argv(node, python)


def parse_inspect(runtime: str, exit_code: int, stdout: str, stderr: str) -> NodeState:
    return node_runtime(runtime).parse_inspect(exit_code, stdout, stderr)


def _docker_time(value: str | None) -> float | None:
    # Docker writes RFC 3339 with nanoseconds ("2026-11-30T01:02:03.123456789Z"); zero time = never.
    if not value or value.startswith("0001-"):
        return None
    head, _, frac = value.rstrip("Z").partition(".")
    stamp = datetime.fromisoformat(head + "+00:00").timestamp()
    return stamp + (float("0." + frac[:6]) if frac else 0.0)


def logs_argv(runtime: str, node: dict, python: str, *, tail: int | None, follow: bool) -> list[str]:
    return node_runtime(runtime).logs_argv(node, python, tail=tail, follow=follow)


def stop_argv(runtime: str, node: dict, python: str) -> list[str]:
    return node_runtime(runtime).stop_argv(node, python)


def remove_argv(runtime: str, node: dict) -> list[str] | None:
    """Removes what is left of the rank (the container); the process runtime leaves only files."""
    return node_runtime(runtime).remove_argv(node)


def list_job_containers_argv(label: str, value: str) -> list[str]:
    """Containers of a job found by label: what `stop` and `--replace` act on, even without a record."""
    return ["docker", "ps", "--all", "--filter", f"label={label}={value}", "--format", "{{.Names}}"]


def progress_argv(output_dir: str, lines: int = 200) -> list[str]:
    return ["tail", "-n", str(lines), f"{output_dir}/progress.jsonl"]


def read_file_argv(path: str) -> list[str]:
    """The whole file (the progress history for plots and charts)."""
    return ["cat", path]


def list_files_argv(directory: str) -> list[str]:
    """Every file under a directory, one path a line (the tracker event files to fetch)."""
    return ["find", directory, "-type", "f"]
