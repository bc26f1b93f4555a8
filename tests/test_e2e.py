"""End to end on real test hosts: launch, status, logs, stop, gang failure, resume.

Two hosts, each its own network namespace with its own sshd (and dockerd for the
docker runtime), one rank per host, real DeepSpeed ZeRO-3 on CPU over gloo,
rendezvous across the bridge. The process runtime runs the trainer from this
checkout's virtualenv (the hosts share this machine's filesystem, like nodes
on NFS); the docker runtime runs the CPU image.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENDED = ("failed", "succeeded")  # with no node still running, a job state no later poll changes
ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Controller:
    """Runs the real dzctl CLI against one cluster, with its own DZCTL_HOME."""

    def __init__(
        self, cluster, tmp_path: Path, runtime: str, image: str | None = None, docker_host: str | None = None
    ) -> None:
        self.cluster = cluster
        self.docker_host = docker_host
        self.runtime = runtime
        self.image = image
        self.home = tmp_path / "home"
        self.hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", slots=1)
        # Per-host paths: the test hosts share one filesystem.
        self.remote = f"/var/tmp/dzctl-e2e-{cluster.cid}"
        # One name per test: tests share hosts, and a job name runs once at a time.
        self.job = f"e2e-{runtime}-{tmp_path.name[-12:]}".lower().replace("_", "-")
        self.sets = [
            f"name={self.job}",
            f"launch.remote_dir={self.remote}/{{host}}",
            "launch.master_port=29611",
            "train.save_steps=4",
            f"runtime={runtime}",
        ]
        if runtime == "process":
            # The venv dzctl runs from: torch, DeepSpeed and this checkout, on every host.
            self.sets.append(f"launch.python={sys.executable}")
        if image:
            self.sets.append(f"image={image}")

    def dzctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        env = {**os.environ, "DZCTL_HOME": str(self.home), "PYTHONPATH": str(ROOT)}
        if self.docker_host:
            env["DOCKER_HOST"] = self.docker_host
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env, timeout=timeout
        )

    def launch(self, *extra: str, steps: int, timeout: float = 900) -> subprocess.CompletedProcess:
        sets = [item for s in [*self.sets, f"train.max_steps={steps}"] for item in ("--set", s)]
        return self.dzctl(
            "launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--hosts", str(self.hostfile),
            "--ssh-config", str(self.cluster.ssh_config), *sets, *extra, timeout=timeout,
        )  # fmt: skip

    def kill_node(self, host) -> None:
        """SIGKILL everything of the job on one host, as a lost node or `docker kill` would."""
        if self.runtime == "docker":
            self.cluster.run_in(host, ["docker", "kill", "--signal", "KILL", f"dzctl-{self.job_id()}-1"])
            return
        # The launcher and its workers, not the supervisor: it records the exit code (137).
        pattern = rf"^\S+ (-m torch\.distributed\.run|-u -m orchestrator\.train) .*{self.remote}/{host.name}/jobs/"
        subprocess.run(["pkill", "-9", "-f", pattern], check=True)

    def leftovers(self, host) -> str:
        """What of the job still runs on a host: container names, or process ids."""
        if self.runtime == "docker":
            argv = ["docker", "ps", "--all", "--quiet", "--filter", f"label=dzctl.job={self.job}"]
            return self.cluster.run_in(host, argv).stdout.strip()
        argv = ["pgrep", "-f", f"{self.remote}/{host.name}/jobs"]
        return subprocess.run(argv, capture_output=True, text=True).stdout.strip()

    def job_id(self) -> str:
        return self.status()["job_id"]

    def status(self) -> dict:
        result = self.dzctl("status", self.job, "--ssh-config", str(self.cluster.ssh_config), "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def output_dir(self, host_index: int) -> Path:
        return Path(f"{self.remote}/{self.cluster.hosts[host_index].name}/output/{self.job}")

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if predicate(status):
                return status
            if status["state"] in ENDED and not any(n["state"] in ("running", "created") for n in status["nodes"]):
                # Nothing changes once every node has ended: fail now with the reason, not after the timeout.
                pytest.fail(f"the job {status['state']} before {what}; last status: {status}")
            time.sleep(2)
        pytest.fail(f"timed out after {timeout:g} s waiting for {what}; last status: {status}")


def _progress_events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(params=["docker", "process"])
def controller(request, tmp_path):
    """A controller on two hosts: the run's shared pair (conftest), reset after the test."""
    if request.param == "docker":
        hosts = request.getfixturevalue("docker_pair")
        # The controller's `docker save` (for distribution) talks to the local daemon.
        local = request.getfixturevalue("local_docker_url")
        controller = Controller(hosts, tmp_path, "docker", image=request.getfixturevalue("cpu_image_tag"),
                                docker_host=local)  # fmt: skip
    else:
        controller = Controller(request.getfixturevalue("process_pair"), tmp_path, "process")
    yield controller
    controller.dzctl("stop", controller.job, "--ssh-config", str(controller.cluster.ssh_config))


@pytest.fixture
def headline_cpu_image(local_docker_url, base_image):
    """`dzctl build --flavour cpu` as the README's headline types it: no --tag, so the image is named
    `dzctl:<version>-cpu` and `dzctl:cpu`, the name jobs/tiny-cpu.yaml says (only --base-image is added:
    no image can be pulled here). The names' earlier images on this daemon get them back afterwards.

    A concurrent run in another checkout on the same daemon can move `dzctl:cpu` meanwhile; the other
    tests use a per-checkout tag for that reason (tests/test_image.py::CPU_TAG), this one cannot.
    """
    import docker
    import docker.errors

    from orchestrator.image.build import BuildRequest, add_tags, image_tags

    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=600)
    names = image_tags(BuildRequest(flavour="cpu"))
    earlier = {}
    for name in names:
        try:
            earlier[name] = client.images.get(name).id
        except docker.errors.ImageNotFound:
            earlier[name] = None
    argv = [sys.executable, "-m", "orchestrator", "build", "--flavour", "cpu", "--base-image", base_image, "--json"]
    env = {**os.environ, "DOCKER_HOST": local_docker_url}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        built = json.loads(done.stdout)["image_id"]
        assert {name: client.images.get(name).id for name in names} == {name: built for name in names}
        yield "dzctl:cpu"
    finally:
        for name, image_id in earlier.items():
            if image_id:
                add_tags(client, image_id, [name])
            else:
                with contextlib.suppress(docker.errors.ImageNotFound):
                    client.images.remove(name, noprune=True)


def test_launch_runs_to_success_with_progress_and_a_consolidated_model(controller, request):
    if controller.runtime == "docker":
        # The headline sequence (issue 27): `dzctl build --flavour cpu`, then `dzctl launch jobs/tiny-cpu.yaml`
        # with the job's own `image: dzctl:cpu`, not a test tag. Neither node has that build yet, so launch
        # ships it to both (only the layers they lack) and checks again before starting.
        controller.image = request.getfixturevalue("headline_cpu_image")
        controller.sets = [s for s in controller.sets if not s.startswith("image=")]
    result = controller.launch("--follow", "--json", steps=6)
    assert result.returncode == 0, result.stderr[-3000:]
    if controller.runtime == "docker":
        assert f"distributing {controller.image} to the nodes that lack it" in result.stderr
        ids = {controller.cluster.run_in(h, ["docker", "image", "inspect", "--format", "{{.Id}}", controller.image])
               .stdout.strip() for h in controller.cluster.hosts}  # fmt: skip
        assert len(ids) == 1, ids
    final = json.loads(result.stdout)
    assert final["state"] == "succeeded"
    # Every node's output reached the controller, prefixed with rank and host.
    for rank, host in enumerate(controller.cluster.hosts):
        assert f"[{rank} {host.name}] " in result.stderr
    status = controller.status()
    assert status["state"] == "succeeded"
    assert [(n["node_rank"], n["state"], n["exit_code"]) for n in status["nodes"]] == [
        (0, "exited", 0),
        (1, "exited", 0),
    ]
    assert status["progress"]["step"] == 6 and status["progress"]["max_steps"] == 6
    assert status["first_failure"] is None
    # The collective check ran before the start, and the record kept its figures (issue 18).
    assert status["preflight"]["collective"]["ok"] and status["preflight"]["collective"]["busbw_gbs"] > 0
    model = controller.output_dir(0) / "model"
    assert (model / "config.json").is_file()
    assert list(model.glob("*.safetensors")), f"no consolidated weights in {model}"


def test_a_killed_node_stops_the_other_within_30_s_and_status_names_it(controller):
    # No collective check: its figures are read by test_launch_runs_to_success_..., not here (about 8 s a launch).
    result = controller.launch("--detach", "--skip-collective", steps=100000)
    assert result.returncode == 0, result.stderr[-3000:]
    controller.wait_for(lambda s: (s["progress"] or {}).get("step", 0) >= 2, 600, "training to reach step 2")
    victim = controller.cluster.hosts[1]
    killed_at = time.time()
    controller.kill_node(victim)
    status = controller.wait_for(
        lambda s: s["state"] == "failed" and s["nodes"][0]["state"] == "exited", 120, "gang stop"
    )
    # When node 0 ended, by its own record (docker's FinishedAt, or the supervisor's).
    assert status["nodes"][0]["finished_at"] - killed_at < 30
    assert status["first_failure"]["node_rank"] == 1
    assert status["first_failure"]["exit_code"] == 137
    assert status["nodes"][0]["exit_code"] != 0


def test_stop_leaves_nothing_running_and_a_relaunch_resumes(controller):
    result = controller.launch("--detach", "--skip-collective", steps=100000)  # the check's figures: not read here
    assert result.returncode == 0, result.stderr[-3000:]
    progress = controller.output_dir(0) / "progress.jsonl"
    deadline = time.monotonic() + 600
    while not (progress.exists() and any(e["event"] == "checkpoint" for e in _progress_events(progress))):
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        time.sleep(0.2)  # a local file's read
    saved = max(e["step"] for e in _progress_events(progress) if e["event"] == "checkpoint")
    stopped = controller.dzctl("stop", controller.job, "--ssh-config", str(controller.cluster.ssh_config))
    assert stopped.returncode == 0, stopped.stderr
    status = controller.status()
    assert status["state"] == "stopped"
    assert all(n["state"] != "running" for n in status["nodes"])
    for host in controller.cluster.hosts:
        assert controller.leftovers(host) == "", f"the stopped job left something on {host.name}"
    # The run may have saved again between that read and the stop: the relaunch must go past
    # the newest checkpoint on disk (one past its max_steps is refused, as a longer run's).
    on_disk = [
        int(p.name.removeprefix("checkpoint-"))
        for index in range(len(controller.cluster.hosts))
        for p in controller.output_dir(index).glob("checkpoint-*")
        if p.name.removeprefix("checkpoint-").isdigit()
    ]
    relaunch = controller.launch("--follow", "--skip-collective", steps=max([saved, *on_disk]) + 2)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    starts = [e for e in _progress_events(progress) if e["event"] == "start"]
    assert starts[-1]["step"] >= saved, f"the relaunch started at {starts[-1]['step']}, not from checkpoint {saved}"


def test_a_controller_killed_mid_launch_leaves_nothing_that_stop_cannot_clean(process_pair, tmp_path):
    """SIGKILL dzctl once the first node runs: status reconciles, stop cleans, a relaunch is not refused."""
    controller = Controller(process_pair, tmp_path, "process")
    sets = [item for s in [*controller.sets, "train.max_steps=100000"] for item in ("--set", s)]
    env = {**os.environ, "DZCTL_HOME": str(controller.home), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "orchestrator", "launch", str(ROOT / "jobs/tiny-cpu.yaml"),
            "--hosts", str(controller.hostfile), "--ssh-config", str(controller.cluster.ssh_config),
            "--detach", *sets]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_node = Path(f"{controller.remote}/{controller.cluster.hosts[0].name}/jobs")
    deadline = time.monotonic() + 300
    # This job's own rank-0 record (the hosts keep earlier tests' job dirs; the collective
    # check's directory, <job id>-nccl, comes and goes before it).
    while not [p for p in first_node.glob(f"{controller.job}-*/rank-0.json") if not p.parent.name.endswith("-nccl")]:
        assert proc.poll() is None, "launch ended before a node started"
        assert time.monotonic() < deadline, "no node started within 300 s"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    status = controller.status()
    assert status["state"] in ("pending", "running"), status
    stopped = controller.dzctl("stop", controller.job, "--ssh-config", str(controller.cluster.ssh_config))
    assert stopped.returncode == 0, stopped.stderr
    for host in controller.cluster.hosts:
        assert controller.leftovers(host) == "", f"the killed launch left something on {host.name}"
    assert controller.status()["state"] == "stopped"
    relaunch = controller.launch("--follow", "--skip-collective", steps=2)  # not refused: the check adds nothing
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]


def test_a_node_that_cannot_start_leaves_no_half_started_job(process_pair, tmp_path):
    """Node 1's launcher refuses to start: node 0, already running, is stopped; the job is failed."""
    controller = Controller(process_pair, tmp_path, "process")
    wrapper = tmp_path / "python-wrapper"
    # The node-side Python, except that starting a rank fails on node1 (preflight's probes still pass).
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$(hostname)" = node1 ] && [ "$3" = start ]; then echo "node1: cannot start" >&2; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    controller.sets = [s for s in controller.sets if not s.startswith("launch.python=")]
    controller.sets.append(f"launch.python={wrapper}")
    # Without the collective check, whose own start on node1 would fail first (and leave no record).
    result = controller.launch("--detach", "--skip-collective", steps=100000)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "did not start on every node" in result.stderr and "node1: cannot start" in result.stderr
    for host in controller.cluster.hosts:
        assert controller.leftovers(host) == "", f"a half-started job remains on {host.name}"
    status = controller.status()
    assert status["state"] == "failed"
