"""``dzctl launch --slurm`` on a real Slurm cluster (issue 17).

slurmctld on this machine (the submit host), a slurmd in each of two test hosts
(tests/slurmhosts.py), real DeepSpeed ZeRO-3 on CPU over gloo, one rank per
node, the tiny job. The job directory is a path every node shares (the hosts
share this machine's filesystem, like nodes on NFS). One cluster per runtime
for the whole module; each test its own job name.

The pyxis form is checked as text (``bash -n`` and a golden file): pyxis/enroot
are not installed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENDED = ("failed", "succeeded")  # with no node still running, a job state no later poll changes
ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "fixtures" / "slurm" / "pyxis-2x4.sbatch"


# -- the batch script, pure ------------------------------------------------------------------------
def _gpu_job(*sets: str):
    from orchestrator.spec.job import load_job

    base = (
        "name=llm-sft",
        "image=registry.example/dzctl:cuda",
        "accelerator=gpu",
        "launch.remote_dir=/shared/dzctl",
        "slurm.container=pyxis",
        "slurm.nodes=2",
        "slurm.gpus_per_node=4",
        "slurm.partition=gpu",
        "slurm.time=02:00:00",
        "slurm.account=ml",
    )
    return load_job(str(ROOT / "jobs/tiny-cpu.yaml"), (*base, *sets), None)


def test_the_pyxis_script_for_2x4_gpus_matches_its_golden_file_and_parses(tmp_path):
    from orchestrator.backends import launcher

    job = _gpu_job()
    request = launcher.slurm_request(job, python="/opt/dzctl/bin/python")
    plan, script = launcher.slurm_plan(job, request, job_id="llm-sft-20261201-000000-abcd")
    if os.environ.get("DZCTL_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(script)
    assert script == GOLDEN.read_text()
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert plan.world_size == 8 and [n.slots for n in plan.nodes] == [4, 4]
    assert "#SBATCH --gpus-per-node=4" in script
    assert "--container-image=registry.example/dzctl:cuda" in script


def test_the_process_script_runs_each_nodes_launcher_with_the_first_host_as_master(tmp_path):
    """Run the script's node part as srun would, with Slurm's variables: the launcher line it picks."""
    from orchestrator.backends import launcher

    job = _gpu_job("slurm.container=none", "runtime=process", "accelerator=cpu")
    _, script = launcher.slurm_plan(job, launcher.slurm_request(job), job_id="llm-sft-x")
    # Replace exec with echo: show what would run on node 1 of an allocation whose first host is gpu-a.
    path = tmp_path / "job.sbatch"
    path.write_text(script.replace(") exec ", ") echo "))
    env = {**os.environ, "SLURM_NODEID": "1"}
    shown = subprocess.run(["bash", str(path), "--node", "gpu-a"], capture_output=True, text=True, env=env)
    assert shown.returncode == 0, shown.stderr
    words = shown.stdout.split()
    assert words[words.index("--master_addr") + 1] == "gpu-a"
    assert words[words.index("--node_rank") + 1] == "1"
    assert words[words.index("--nnodes") + 1] == "2"
    assert words[3] == "run"  # the wrapper in the foreground: the Slurm step owns the process


def test_a_host_placeholder_in_the_job_dir_is_refused(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--slurm", "--dry-run",
         "--set", "launch.remote_dir=/var/tmp/{host}"],
        capture_output=True, text=True, env={**os.environ, "DZCTL_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "launch.remote_dir" in result.stderr and "{host}" in result.stderr
    # A GPU job is planned before Slurm picks the nodes: without slurm.gpu_mem_gib it is refused, unsubmitted.
    gpu = subprocess.run(
        [sys.executable, "-m", "orchestrator", "launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--slurm",
         "--set", "accelerator=gpu", "--set", f"launch.remote_dir={tmp_path}/shared"],
        capture_output=True, text=True, env={**os.environ, "DZCTL_HOME": str(tmp_path)},
    )  # fmt: skip
    assert gpu.returncode == 2 and "slurm.gpu_mem_gib" in gpu.stderr, gpu.stderr
    assert not (tmp_path / "shared" / "jobs").exists()


def test_dry_run_json_keeps_the_plan_contract_and_adds_the_script(tmp_path):
    def dzctl(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "orchestrator", "launch", str(ROOT / "jobs/tiny-cpu.yaml"), *args]
        return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "DZCTL_HOME": str(tmp_path)})

    shown = dzctl("--slurm", "--nodes", "2", "--dry-run", "--json", "--set", "launch.remote_dir=/shared/dz")
    assert shown.returncode == 0, shown.stderr
    plan = json.loads(shown.stdout)
    assert {"job", "job_id", "world_size", "master_addr", "master_port", "nodes", "sbatch_script"} <= set(plan)
    assert plan["world_size"] == 2 and [n["node_rank"] for n in plan["nodes"]] == [0, 1]
    assert plan["sbatch_script"].startswith("#!/bin/bash\n") and "#SBATCH --nodes=2" in plan["sbatch_script"]
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node0 slots=1\n")
    both = dzctl("--slurm", "--hosts", str(hosts), "--dry-run")
    assert both.returncode == 2 and "--slurm and --hosts" in both.stderr


def test_the_test_clusters_ports_are_distinct():
    """The four daemon ports are picked with every socket held: picked one at a time, 400 ports of this
    machine's range repeat some (about 3 in each of 5 trials of 300 here), and four repeated one once in
    CI: slurmdbd took slurmctld's port."""
    from slurmhosts import free_ports

    ports = free_ports(400)
    assert len(set(ports)) == 400 and all(port > 0 for port in ports)


# -- a real cluster ----------------------------------------------------------------------------------
def _require_slurm(docker: bool = False) -> None:
    from conftest import require_test_hosts
    from slurmhosts import missing_slurm

    require_test_hosts(docker=docker)
    missing = missing_slurm()
    if missing:
        reason = "Slurm test hosts need: " + ", ".join(missing)
        if os.environ.get("DZCTL_REQUIRE_INTEGRATION") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_process(shared_process_hosts):
    _require_slurm()
    from slurmhosts import SlurmCluster

    # On the run's shared pair (conftest): Slurm's daemons for this module, the hosts reset at its end.
    with SlurmCluster(hosts=shared_process_hosts) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm_docker(shared_docker_hosts, cpu_image_tag):
    _require_slurm(docker=True)
    from slurmhosts import SlurmCluster

    # Slurm ships no image: the nodes have it already, as a site's nodes would (a registry, a load):
    # the shared docker pair holds the CPU image.
    with SlurmCluster(hosts=shared_docker_hosts.first(2)) as cluster:  # two Slurm nodes, as slurm_process
        yield cluster, cpu_image_tag


class SlurmController:
    """The real dzctl CLI against one Slurm cluster, with its own DZCTL_HOME and job name."""

    def __init__(self, cluster, tmp_path: Path, runtime: str, image: str | None = None) -> None:
        self.cluster = cluster
        self.runtime = runtime
        self.home = tmp_path / "home"
        self.job = f"slurm-{runtime}-{tmp_path.name[-10:]}".lower().replace("_", "-")
        self.remote = f"/var/tmp/dzctl-slurm-{cluster.hosts.cid}"
        self.sets = [
            f"name={self.job}",
            f"runtime={runtime}",
            f"launch.remote_dir={self.remote}",
            "launch.master_port=29641",
            "train.save_steps=100",
            "slurm.nodes=2",
        ]
        if runtime == "process":
            self.sets.append(f"launch.python={sys.executable}")
        if image:
            self.sets.append(f"image={image}")

    def argv_env(self, *args: str, path_first: Path | None = None) -> tuple[list[str], dict[str, str]]:
        env = {**self.cluster.env, "DZCTL_HOME": str(self.home), "PYTHONPATH": str(ROOT)}
        env.pop("DOCKER_HOST", None)  # each node's job steps talk to that node's own dockerd
        if path_first is not None:
            env["PATH"] = f"{path_first}:{env['PATH']}"
        # dzctl as a login node runs it: Slurm's client commands reach this cluster's munged.
        return self.cluster.in_namespace([sys.executable, "-m", "orchestrator", *args]), env

    def dzctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        argv, env = self.argv_env(*args)
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)

    def launch_argv(self, *extra: str, steps: int) -> list[str]:
        sets = [item for s in [*self.sets, f"train.max_steps={steps}"] for item in ("--set", s)]
        return ["launch", str(ROOT / "jobs/tiny-cpu.yaml"), "--slurm", *sets, *extra]

    def launch(self, *extra: str, steps: int, timeout: float = 900) -> subprocess.CompletedProcess:
        return self.dzctl(*self.launch_argv(*extra, steps=steps), timeout=timeout)

    def launch_in_background(self, *extra: str, steps: int, path_first: Path) -> subprocess.Popen:
        """A launch whose Slurm commands are found in ``path_first`` first (a wrapper around the real sbatch)."""
        argv, env = self.argv_env(*self.launch_argv(*extra, steps=steps), path_first=path_first)
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # fmt: skip

    def record(self):
        from orchestrator.observe.store import JobStore

        with JobStore(self.home / "jobs.sqlite") as store:
            return store.get(self.job)

    def slurm_job_id(self) -> str:
        from orchestrator.backends.slurm.jobid import slurm_job_id

        found = slurm_job_id(self.record())  # kept in the job dir once sbatch answered
        assert found, "no Slurm job id kept for the job"
        return found

    def status(self) -> dict:
        result = self.dzctl("status", self.job, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

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

    def leftovers(self) -> str:
        """What of the job still runs on either node: processes (both runtimes' wrappers), containers."""
        found = subprocess.run(["pgrep", "-af", f"{self.remote}/jobs/{self.job}-"], capture_output=True, text=True)
        left = found.stdout.strip()
        if self.runtime == "docker":
            for host in self.cluster.hosts.hosts:
                argv = ["docker", "-H", host.docker_host, "ps", "-aq", "--filter", f"label=dzctl.job={self.job}"]
                left += subprocess.run(argv, capture_output=True, text=True).stdout.strip()
        return left

    def kill_rank(self, rank: int) -> None:
        """SIGKILL node ``rank``'s launcher (the container, for docker), as a crash or the OOM killer would."""
        job_dir = f"{self.remote}/jobs/{self.status()['job_id']}"
        if self.runtime == "docker":
            host = self.cluster.hosts.hosts[rank]
            name = f"dzctl-{self.status()['job_id']}-{rank}"
            subprocess.run(["docker", "-H", host.docker_host, "kill", "--signal", "KILL", name], check=True)
            return
        pattern = rf"^\S+ -m torch\.distributed\.run --nnodes 2 --node_rank {rank} .*{job_dir}/job.yaml"
        subprocess.run(["pkill", "-9", "-f", pattern], check=True)


@pytest.fixture(params=["process", "docker"])
def controller(request, tmp_path):
    if request.param == "docker":
        cluster, image = request.getfixturevalue("slurm_docker")
        made = SlurmController(cluster, tmp_path, "docker", image=image)
    else:
        made = SlurmController(request.getfixturevalue("slurm_process"), tmp_path, "process")
    yield made
    made.dzctl("stop", made.job)


@pytest.mark.integration
@pytest.mark.slow
def test_the_tiny_job_trains_across_both_slurm_nodes_and_reports_through_slurm(controller):
    result = controller.launch("--follow", "--json", steps=3)
    assert result.returncode == 0, result.stderr[-3000:]
    final = json.loads(result.stdout)
    assert final["state"] == "succeeded", final
    status = controller.status()
    assert status["state"] == "succeeded"
    # The job left the queue: the accounting has it (what `dzctl status` read), as COMPLETED.
    slurm_id = controller.slurm_job_id()
    acct = controller.cluster.client(["sacct", "-X", "-n", "-P", "-j", slurm_id, "-o", "State"]).stdout.split()
    assert acct == ["COMPLETED"]
    assert controller.cluster.client(["squeue", "-h", "-j", slurm_id], check=False).stdout.strip() == ""
    # Each rank on its own allotted node, as Slurm's node ids ordered them.
    assert [(n["node_rank"], n["host"], n["exit_code"]) for n in status["nodes"]] == [
        (0, "node0", 0),
        (1, "node1", 0),
    ]
    assert status["progress"]["step"] == 3 and status["first_failure"] is None
    logs = controller.dzctl("logs", controller.job)
    assert logs.returncode == 0, logs.stderr
    assert "[0 node0] " in logs.stdout and "[1 node1] " in logs.stdout
    assert any(line.startswith("[0 node0] ") and "train_loss" in line for line in logs.stdout.splitlines())
    assert controller.leftovers() == ""
    # Stopping a job that already ended is not an error (scancel refuses it; nothing runs), nor a new state.
    stopped = controller.dzctl("stop", controller.job, "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert controller.status()["state"] == "succeeded"


@pytest.mark.integration
@pytest.mark.slow
def test_stop_cancels_the_slurm_job_and_leaves_nothing_on_either_node(controller):
    result = controller.launch("--detach", "--json", steps=100000)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["slurm_job_id"]
    controller.wait_for(lambda s: (s["progress"] or {}).get("step", 0) >= 1, 600, "training to reach step 1")
    stopped = controller.dzctl("stop", controller.job, "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert set(json.loads(stopped.stdout)["hosts"].values()) == {"stopped"}
    status = controller.status()
    assert status["state"] == "stopped"
    assert all(n["state"] != "running" for n in status["nodes"])
    assert controller.leftovers() == ""


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_rank_fails_the_slurm_job_on_both_nodes_and_is_named(controller):
    result = controller.launch("--detach", steps=100000)
    assert result.returncode == 0, result.stderr[-3000:]
    controller.wait_for(lambda s: (s["progress"] or {}).get("step", 0) >= 2, 600, "training to reach step 2")
    controller.kill_rank(1)
    status = controller.wait_for(
        lambda s: s["state"] == "failed" and all(n["state"] == "exited" for n in s["nodes"]), 120, "gang failure"
    )
    assert status["first_failure"]["node_rank"] == 1, status
    assert status["first_failure"]["exit_code"] == 137
    assert status["nodes"][0]["exit_code"] != 0
    assert controller.leftovers() == ""


@pytest.mark.integration
@pytest.mark.slow
def test_a_failed_check_inside_the_allocation_ends_the_job_before_training(slurm_process, tmp_path):
    controller = SlurmController(slurm_process, tmp_path, "process")
    controller.sets = [s for s in controller.sets if not s.startswith("launch.python=")]
    controller.sets.append("launch.python=/nonexistent/python3")  # the nodes' Python env check fails
    result = controller.launch("--follow", steps=3)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "preflight failed on 2 of 2 node(s): node0, node1" in result.stderr
    status = controller.status()
    assert status["state"] == "failed"
    assert [n["state"] for n in status["nodes"]] == ["missing", "missing"]  # no launcher ever started
    assert "preflight failed on 2 of 2" in status["first_failure"]["reason"]
    # The same report as `dzctl preflight`, in the batch log.
    batch_log = next(Path(f"{controller.remote}/jobs/{status['job_id']}").glob("slurm-*.out")).read_text()
    assert "python-env" in batch_log and "/nonexistent/python3" in batch_log


# -- trust (issue 28): Slurm unreachable, the record before sbatch, what sbatch reads ------------------
def _wrap_sbatch(folder: Path, before: str = "", after: str = "") -> Path:
    """``folder/sbatch``: the real sbatch, with shell lines run before it and after it answered."""
    import shutil

    real = shutil.which("sbatch") or "/usr/bin/sbatch"
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "sbatch"
    lines = ["#!/bin/sh", before, f'out="$({real} "$@")"; code=$?', after, 'printf "%s\\n" "$out"; exit "$code"']
    wrapper.write_text("\n".join(lines) + "\n")
    wrapper.chmod(0o755)
    return folder


@pytest.fixture
def process_controller(slurm_process, tmp_path):
    """A process-runtime controller whose job is stopped at the end, whatever the test left running."""
    made = SlurmController(slurm_process, tmp_path, "process")
    yield made
    made.dzctl("stop", made.job)


def _wait_for_file(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the launch ended ({process.returncode}) first: {process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.2)


def _end(process: subprocess.Popen) -> None:
    import signal

    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.integration
@pytest.mark.slow
def test_stop_with_slurm_down_names_each_node_whose_rank_runs_and_status_never_reads_stopped(
    process_controller, slurm_process
):
    controller = process_controller
    result = controller.launch("--detach", steps=100000)
    assert result.returncode == 0, result.stderr[-3000:]
    controller.wait_for(lambda s: (s["progress"] or {}).get("step", 0) >= 1, 600, "training to reach step 1")
    job_dir = Path(f"{controller.remote}/jobs/{controller.status()['job_id']}")
    with slurm_process.unreachable():
        stopped = controller.dzctl("stop", controller.job, "--json", timeout=300)
        assert stopped.returncode == 1, (stopped.stdout, stopped.stderr)
        hosts = json.loads(stopped.stdout)["hosts"]
        assert set(hosts) == {"node0", "node1"}, hosts
        for host, outcome in hosts.items():
            assert outcome.startswith("error: rank ") and "still running" in outcome, (host, outcome)
        assert "could not stop job" in stopped.stderr and "node0" in stopped.stderr and "node1" in stopped.stderr
        shown = controller.dzctl("status", controller.job, "--json")
        assert shown.returncode == 1, shown.stdout
        error = json.loads(shown.stdout)
        assert "state is unknown" in error["error"] and "rank 0 on node0 running" in error["error"], error
        # The ranks ran on all along: their records have no end.
        for rank in (0, 1):
            assert json.loads((job_dir / f"rank-{rank}.json").read_text()).get("exit_code") is None
    assert controller.record().state not in ("stopped", "failed", "succeeded")
    # Slurm answers again: the same stop now stops it.
    stopped = controller.dzctl("stop", controller.job, "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert set(json.loads(stopped.stdout)["hosts"].values()) == {"stopped"}
    assert controller.status()["state"] == "stopped"
    assert controller.leftovers() == ""


@pytest.mark.integration
@pytest.mark.slow
def test_the_job_is_recorded_before_sbatch_runs_and_a_relaunch_is_refused_meanwhile(process_controller, tmp_path):
    controller = process_controller
    gate = tmp_path / "gate"
    wrappers = _wrap_sbatch(
        tmp_path / "bin", before=f"touch {gate}.called; while [ ! -e {gate}.open ]; do sleep 0.2; done"
    )
    launching = controller.launch_in_background("--detach", steps=3, path_first=wrappers)
    try:
        _wait_for_file(Path(f"{gate}.called"), launching)
        # sbatch has not run yet: the job is there, pending, no rank started.
        status = controller.status()
        assert status["state"] == "pending", status
        assert [n["state"] for n in status["nodes"]] == ["missing", "missing"]
        again = controller.launch("--detach", steps=3)
        assert again.returncode == 2, again.stderr[-3000:]
        assert f"job {controller.job!r} is still pending" in again.stderr and "sbatch has not answered" in again.stderr
        Path(f"{gate}.open").touch()
        _, err = launching.communicate(timeout=120)
        assert launching.returncode == 0, err[-3000:]
    finally:
        _end(launching)
    slurm_id = controller.slurm_job_id()
    assert controller.status()["state"] in ("pending", "running")
    comment = controller.cluster.client(["squeue", "-h", "-j", slurm_id, "-o", "%k"]).stdout.strip()
    assert comment == f"dzctl:{controller.status()['job_id']}"
    stopped = controller.dzctl("stop", controller.job, "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert controller.status()["state"] == "stopped"
    assert controller.leftovers() == ""


@pytest.mark.integration
@pytest.mark.slow
def test_a_controller_killed_after_sbatch_leaves_a_job_that_status_relaunch_and_stop_find(process_controller, tmp_path):
    controller = process_controller
    submitted = tmp_path / "submitted"
    # The real sbatch queues the job; then this controller dies before it could keep the id.
    wrappers = _wrap_sbatch(tmp_path / "bin", after=f"touch {submitted}; sleep 600")
    launching = controller.launch_in_background("--detach", steps=100000, path_first=wrappers)
    try:
        _wait_for_file(submitted, launching)
    finally:
        _end(launching)
    record = controller.record()
    assert record.state == "starting"
    assert not (Path(record.plan["nodes"][0]["job_dir"]) / "slurm-job-id").exists()
    status = controller.status()
    assert status["state"] in ("pending", "running"), status
    queued = controller.cluster.client(["squeue", "-h", "-n", controller.job, "-o", "%i"]).stdout.split()
    assert len(queued) == 1
    again = controller.launch("--detach", steps=3)
    assert again.returncode == 2, again.stderr[-3000:]
    assert f"slurm job {queued[0]}" in again.stderr
    stopped = controller.dzctl("stop", controller.job, "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert controller.status()["state"] == "stopped"
    assert controller.cluster.client(["squeue", "-h", "-n", controller.job]).stdout.strip() == ""
    assert controller.leftovers() == ""


@pytest.mark.integration
@pytest.mark.slow
def test_a_job_sbatch_refuses_is_recorded_failed_with_sbatchs_reason(process_controller):
    controller = process_controller
    result = controller.launch("--detach", "--partition", "nosuch", steps=3)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "sbatch refused the job" in result.stderr
    status = controller.status()
    assert status["state"] == "failed"
    assert "sbatch refused the job" in status["first_failure"]["reason"], status
    assert "invalid partition" in status["first_failure"]["reason"].lower(), status


@pytest.mark.integration
@pytest.mark.slow
def test_sbatch_reads_a_quoted_job_dir_with_a_blank_and_the_batch_log_lands_where_dzctl_reads_it(process_controller):
    controller = process_controller
    controller.remote += " my runs #2"
    controller.sets = [s for s in controller.sets if not s.startswith("launch.remote_dir=")]
    controller.sets.append(f"launch.remote_dir='{controller.remote}'")
    result = controller.launch("--detach", steps=100000)
    assert result.returncode == 0, result.stderr[-3000:]
    slurm_id = controller.slurm_job_id()
    job_dir = Path(f"{controller.remote}/jobs/{controller.status()['job_id']}")
    shown = controller.cluster.client(["scontrol", "show", "job", slurm_id]).stdout
    assert f"StdOut={job_dir}/slurm-{slurm_id}.out\n" in shown, shown
    from orchestrator.backends.slurm.backend import batch_log_path

    assert batch_log_path(controller.record()) == job_dir / f"slurm-{slurm_id}.out"
    deadline = time.monotonic() + 120
    while not (job_dir / f"slurm-{slurm_id}.out").exists():
        assert time.monotonic() < deadline, "no batch log at the quoted path"
        time.sleep(1)
    stopped = controller.dzctl("stop", controller.job, "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert controller.leftovers() == ""
