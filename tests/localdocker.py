"""A Docker daemon on this machine's root network namespace, for the image tests.

If one already answers (``DOCKER_HOST``, or ``/var/run/docker.sock`` started by ``.ci/run``) it is
used as is. Otherwise one is started here and stopped afterwards, by its pid. Its data root lives
under ``/var/lib/dzctl-test`` on purpose: images and build cache survive between runs, so a rerun
on the same machine does not rebuild torch layers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors

STATE = Path(os.environ.get("DZCTL_TEST_DOCKER_STATE", "/var/lib/dzctl-test/docker"))
RUN = Path("/run/dzctl-test")
SOCKET = RUN / "docker.sock"


def _answers(base_url: str) -> bool:
    try:
        docker.DockerClient(base_url=base_url, version="auto", timeout=5).ping()
        return True
    except (docker.errors.DockerException, OSError):
        return False


def dockerd_argv() -> list[str]:
    # No bridge, no iptables: containers here always run with --network host (DESIGN §6), and
    # this machine's kernel setup does not allow docker to rewrite iptables anyway.
    return [
        "dockerd",
        f"--data-root={STATE}",
        f"--exec-root={RUN / 'exec'}",
        f"--pidfile={RUN / 'docker.pid'}",
        f"--host=unix://{SOCKET}",
        "--bridge=none",
        "--iptables=false",
        "--ip-masq=false",
    ]


@contextlib.contextmanager
def local_docker() -> Iterator[str]:
    """Yield a ``DOCKER_HOST`` URL of a daemon that answers; start one if none does."""
    for url in (os.environ.get("DOCKER_HOST"), "unix:///var/run/docker.sock", f"unix://{SOCKET}"):
        if url and _answers(url):
            yield url
            return
    STATE.mkdir(parents=True, exist_ok=True)
    RUN.mkdir(parents=True, exist_ok=True)
    log = open(RUN / "dockerd.log", "ab")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(dockerd_argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"unix://{SOCKET}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (RUN / "dockerd.log").read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError("dockerd did not start:\n" + "\n".join(tail))
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
