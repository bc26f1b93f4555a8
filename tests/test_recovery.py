"""Unattended recovery on real test hosts (issue 31): the supervisor's restart, its refusals, and `stop`.

- docker hosts (real sshd and dockerd), the run's shared three: node 1's container is killed mid-run and its
  sshd stopped; the supervisor finds node 1 failing preflight, puts the spare node 2 in its place
  (world size unchanged), resumes from the newest complete checkpoint, and the job succeeds with
  every step's loss equal to an uninterrupted run's; `status` shows the one restart with its cause
  and the node replaced; the webhook got one POST per event;
- process hosts (cheaper): a data error found on the nodes never restarts (and a webhook that is
  down changes nothing), and `stop` during the backoff stops for good.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_e2e import ROOT, Controller, _progress_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SUPERVISOR_POLL_S = 1  # the supervisors these tests start poll status this often (the product's default is 5)


@pytest.fixture(autouse=True)
def _fast_supervisor_poll(monkeypatch):
    """Each supervisor (started by launch, inheriting this env) sees a failure and a success within 1 s, not 5."""
    monkeypatch.setenv("DZCTL_SUPERVISOR_POLL_S", str(SUPERVISOR_POLL_S))


class Webhook:
    """A real HTTP server on 127.0.0.1 (the supervisor runs on this controller) keeping every POST."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, json.loads(body)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed once this returns: nothing listens there


def _supervision(controller) -> dict:
    return controller.status().get("restarts") or {}


def _wait(predicate, timeout: float, what: str, controller):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = controller.status()
        if predicate(status):
            return status
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}; last status: {status}")


def _supervisor_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def supervised(request):
    """Controllers whose supervisors are ended by pid after the test, whatever it left."""
    made = []
    yield made.append
    for controller in made:
        for pid in controller.supervisor_pids:
            if _supervisor_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _track_supervisor(controller, status: dict) -> int:
    pid = status["restarts"]["pid"]
    controller.supervisor_pids.append(pid)
    return pid


def _process_controller(process_pair, tmp_path, supervised, *sets: str) -> Controller:
    controller = Controller(process_pair, tmp_path, "process")
    controller.supervisor_pids = []
    controller.sets += list(sets)
    # No relaunch reads the collective check's figures here (about 8 s a launch); the docker test keeps it.
    controller.launch = functools.partial(controller.launch, "--skip-collective")
    supervised(controller)
    return controller


def test_a_data_error_on_the_nodes_never_restarts_and_a_down_webhook_changes_nothing(
    process_pair, tmp_path, supervised
):
    rows = [json.loads(x) for x in (ROOT / "jobs/data/tiny-alpaca-zh.jsonl").read_text().splitlines() if x.strip()]
    del rows[6]["output"]  # row 7: past the rows launch reads before touching a host, found on the nodes
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    secrets = tmp_path / "secrets.env"
    secrets.write_text("HOOK_TOKEN=t0ken-never-shown\n")
    controller = _process_controller(
        process_pair, tmp_path, supervised,
        f"data.path={data}", f"launch.env_file={secrets}", "restart.max=3", "restart.backoff_s=0",
        f"notify.webhook=http://127.0.0.1:{_closed_port()}/hook/${{HOOK_TOKEN}}", "notify.timeout_s=2",
    )  # fmt: skip
    result = controller.launch("--detach", steps=20)
    assert result.returncode == 0, result.stderr[-3000:]
    status = _wait(lambda s: (s.get("restarts") or {}).get("supervisor") == "gave-up", 300, "the supervisor to end",
                   controller)  # fmt: skip
    pid = _track_supervisor(controller, status)
    restarts = status["restarts"]
    assert status["state"] == "failed" and restarts["count"] == 0 and len(restarts["attempts"]) == 1
    assert "bad input (exit 2)" in restarts["final"] and "row 7" in restarts["final"], restarts["final"]
    assert "a restart cannot fix input-error" in restarts["final"]
    # The webhook was down: one attempt for the one event, recorded as failed, and nothing else changed.
    [sent] = restarts["notifications"]
    assert sent["event"] == "failed" and sent["ok"] is False and "Connection refused" in sent["error"], sent
    assert "t0ken-never-shown" not in json.dumps(status)
    deadline = time.monotonic() + 10
    while _supervisor_alive(pid):
        assert time.monotonic() < deadline, "the supervisor outlived its job"
        time.sleep(0.2)


def test_stop_during_the_backoff_stops_for_good(process_pair, tmp_path, supervised):
    backoff = 8  # long enough for `stop` to land inside it on a loaded machine (it takes 2-3 s)
    controller = _process_controller(process_pair, tmp_path, supervised, "restart.max=3",
                                     f"restart.backoff_s={backoff}")  # fmt: skip
    result = controller.launch("--detach", steps=100000)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "supervisor: pid " in result.stderr
    controller.wait_for(lambda s: (s["progress"] or {}).get("step", 0) >= 2, 600, "training to reach step 2")
    controller.kill_node(controller.cluster.hosts[1])
    status = _wait(lambda s: (s.get("restarts") or {}).get("supervisor") == "backoff", 120, "the backoff",
                   controller)  # fmt: skip
    in_backoff_at = time.monotonic()
    pid = _track_supervisor(controller, status)
    stopped = controller.dzctl("stop", controller.job, "--ssh-config", str(controller.cluster.ssh_config), "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["supervisor"] == f"stopped (pid {pid})"
    assert not _supervisor_alive(pid)
    # Past the end of the backoff and two polls: nothing was started.
    time.sleep(max(0.0, backoff + 2 * SUPERVISOR_POLL_S + 1 - (time.monotonic() - in_backoff_at)))
    restarts = _supervision(controller)
    assert restarts["supervisor"] == "stopped" and restarts["count"] == 0, restarts
    assert len(restarts["attempts"]) == 1, restarts
    for host in controller.cluster.hosts:
        assert controller.leftovers(host) == "", f"something runs on {host.name} after the stop"


def _step_losses(events: list[dict], job_id: str) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e.get("job_id") == job_id and e["event"] == "step"}


def test_a_lost_node_is_replaced_by_a_spare_and_the_job_resumes_to_the_same_losses(
    docker_trio, cpu_image_tag, local_docker_url, tmp_path, supervised
):
    hosts = docker_trio  # the shared docker hosts: each holds the CPU image, as a distribute leaves it
    node0, node1, node2 = hosts.hosts
    controller = Controller(hosts, tmp_path, "docker", image=cpu_image_tag, docker_host=local_docker_url)
    controller.supervisor_pids = []
    supervised(controller)
    controller.hostfile = hosts.write_hostfile(tmp_path / "hosts.txt", names=[node0.name, node1.name])
    # One output dir every node sees (the hosts share a filesystem, like NFS): the spare resumes from it.
    shared = f"{controller.remote}/shared"
    steps = 24  # checkpoints every 4 (save_steps); the kill comes past step 6, the resume runs to the end
    reference = f"{controller.job}-ref"
    straight = controller.launch("--follow", "--set", f"name={reference}", "--set",
                                 f"train.output_dir={shared}/{reference}", steps=steps)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference_events = _progress_events(Path(f"{shared}/{reference}/progress.jsonl"))
    [reference_id] = {e["job_id"] for e in reference_events}
    uninterrupted = _step_losses(reference_events, reference_id)
    assert sorted(uninterrupted) == list(range(1, steps + 1))

    hook = Webhook()
    secrets = tmp_path / "secrets.env"
    secrets.write_text("HOOK_TOKEN=t0ken-never-shown\n")
    try:
        result = controller.launch(
            "--detach", "--set", f"train.output_dir={shared}/{controller.job}", "--set", "restart.max=2",
            "--set", "restart.backoff_s=1", "--set", f"restart.spare_hosts=[{node2.name}]",
            "--set", f"launch.env_file={secrets}",
            "--set", f"notify.webhook=http://127.0.0.1:{hook.port}/hook/${{HOOK_TOKEN}}", steps=steps,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        first_id = controller.job_id()
        progress = Path(f"{shared}/{controller.job}/progress.jsonl")
        deadline = time.monotonic() + 600
        # Mid-run, past a complete checkpoint, with steps after it that the resume must redo.
        while True:
            events = [e for e in (_progress_events(progress) if progress.exists() else []) if e["job_id"] == first_id]
            saved = [e["step"] for e in events if e["event"] == "checkpoint"]
            if saved and max(_step_losses(events, first_id), default=0) >= saved[-1] + 2:
                break
            assert time.monotonic() < deadline and not any(e["event"] == "end" for e in events), events[-3:]
            time.sleep(0.1)
        hosts.run_in(node1, ["docker", "kill", "--signal", "KILL", f"dzctl-{first_id}-1"])
        killed_at = time.time()
        hosts.stop_sshd(node1)  # node 1 is gone for good: the restart's preflight cannot reach it

        status = _wait(
            lambda s: s["state"] == "succeeded" and (s.get("restarts") or {}).get("supervisor") == "succeeded",
            900, "the restarted job to succeed and its supervisor to end", controller,
        )  # fmt: skip
        _track_supervisor(controller, status)
        restarts = status["restarts"]
        assert restarts["count"] == 1 and restarts["supervisor"] == "succeeded", restarts
        [restart] = restarts["history"]
        assert restart["cause"] == "node-lost" and restart["from_job_id"] == first_id, restart
        listed = f"restart.spare_hosts[0] (--set restart.spare_hosts=[{node2.name}])"
        assert restart["replaced"] == [{"node_rank": 1, "host": node1.name, "spare": node2.name, "source": listed}], (
            restart
        )
        assert status["job_id"] == restart["job_id"] != first_id
        assert [(n["node_rank"], n["host"], n["ranks"]) for n in status["nodes"]] == [
            (0, node0.name, [0]), (1, node2.name, [1])
        ]  # world size 2, as before  # fmt: skip
        text = controller.dzctl("status", controller.job, "--ssh-config", str(hosts.ssh_config)).stdout
        assert "restarts 1 of 2 (supervisor succeeded" in text, text
        assert "restart 1: node-lost: " in text and f"node 1 {node1.name} replaced by {node2.name}" in text, text

        events = _progress_events(progress)
        resumed_id = restart["job_id"]
        start = next(e for e in events if e["job_id"] == resumed_id and e["event"] == "start")
        assert start["step"] == max(e["step"] for e in events if e["job_id"] == first_id and e["event"] == "checkpoint")
        resumed = _step_losses(events, resumed_id)
        assert sorted(resumed) == list(range(start["step"] + 1, steps + 1))
        # To the digit: fp32 on CPU, the same world size, the resume at the checkpoint's data position.
        assert resumed == {step: uninterrupted[step] for step in resumed}
        first_step_at = min(e["time"] for e in events if e["job_id"] == resumed_id and e["event"] == "step")
        print(f"\nkilled node -> training again on the spare: {first_step_at - killed_at:.1f} s "
              f"(supervisor: failure seen -> running {restart['seconds_to_running']} s)")  # fmt: skip

        # One POST per event, to the URL with the env file's secret filled in.
        assert [(path, body["event"]) for path, body in hook.received] == [
            ("/hook/t0ken-never-shown", "restarted"), ("/hook/t0ken-never-shown", "succeeded")
        ]  # fmt: skip
        restarted = hook.received[0][1]
        assert restarted["first_failure"]["node_rank"] == 1 and restarted["cause"] == "node-lost"
        assert restarted["job_id"] == resumed_id and restarted["failed_job_id"] == first_id
        assert hook.received[1][1]["state"] == "succeeded"
        assert "t0ken-never-shown" not in json.dumps(status)
    finally:
        hook.close()
