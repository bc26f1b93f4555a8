"""The webhook (issue 31 item 3) against real HTTP servers on 127.0.0.1: delivered, down, hung, erroring.

A failing receiver costs at most notify.timeout_s and never raises; the URL's ${NAME} parts come
from the job's secrets and never appear in what is recorded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.backends.recovery import notify
from orchestrator.errors import SpecError
from orchestrator.spec.recovery import NotifySpec


class _Server:
    def __init__(self, status: int = 204, hang_s: float = 0.0) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, self.headers["Content-Type"], json.loads(body)))
                time.sleep(hang_s)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_one_post_with_the_job_its_state_and_first_failure():
    failure = {"node_rank": 1, "host": "node1", "exit_code": 137, "reason": "killed"}
    body = notify.payload("failed", job="tiny", job_id="tiny-1", state="failed", first_failure=failure, cause="x")
    with _Server() as server:
        outcome = notify.post(f"{server.url}/hook", body, timeout_s=5)
    assert outcome["ok"] is True and outcome["status"] == 204
    [(path, kind, got)] = server.received
    assert (path, kind) == ("/hook", "application/json")
    assert {k: got[k] for k in ("version", "event", "job", "job_id", "state", "first_failure", "cause")} == {
        "version": 1, "event": "failed", "job": "tiny", "job_id": "tiny-1", "state": "failed",
        "first_failure": failure, "cause": "x",
    }  # fmt: skip


def test_a_down_a_hung_and_an_erroring_receiver_never_raise_and_stay_within_the_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    down = notify.post(f"http://127.0.0.1:{closed}/secret-part", {"event": "failed"}, timeout_s=2)
    assert down["ok"] is False and "Connection refused" in down["error"] and down["seconds"] < 2
    assert "secret-part" not in down["error"]
    with _Server(hang_s=5) as hung:
        slow = notify.post(hung.url, {"event": "failed"}, timeout_s=1)
    assert slow["ok"] is False and "timed out" in slow["error"] and slow["seconds"] < 2.5, slow
    with _Server(status=500) as broken:
        answered = notify.post(broken.url, {"event": "failed"}, timeout_s=2)
    assert answered == {"ok": False, "status": 500, "seconds": answered["seconds"]}


def test_the_url_takes_its_secret_from_the_env_file_or_is_refused_naming_the_name():
    spec = NotifySpec(webhook="https://hooks.example.invalid/services/${HOOK_TOKEN}")
    assert (
        notify.webhook_url(spec, {"HOOK_TOKEN": "abc"}, "job.yaml:40") == "https://hooks.example.invalid/services/abc"
    )
    with pytest.raises(SpecError) as raised:
        notify.webhook_url(spec, {}, "job.yaml:40")
    assert raised.value.message.startswith("job.yaml:40: notify.webhook names ${HOOK_TOKEN}")
    assert "launch.env_file" in raised.value.fix
