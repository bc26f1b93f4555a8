"""The SSH fleet backend: a prepared job runs on the hostfile's nodes, one launcher per node over SSH.

``launcher.execute(prepared, SshFleet(pool, store))`` records the job, uploads
each node's files and starts every node (``start.start_job``: all or none).
What runs on each node is the runtime's (``runtimes.control.node_runtime``); this
backend only decides that it is reached over SSH and recorded locally.
"""

from __future__ import annotations

from ..observe.store import JobStore
from ..transport.pool import HostPool
from .start import Started, start_job


class SshFleet:
    name = "ssh"

    def __init__(self, pool: HostPool, store: JobStore) -> None:
        self.pool = pool
        self.store = store

    def start(self, prepared, progress) -> Started:
        started = start_job(
            prepared.job,
            prepared.files,
            self.pool,
            self.store,
            spec_record=prepared.spec_record,
            ssh_config=prepared.options.ssh_config,
            replace=prepared.options.replace,
            phases=prepared.phases,
            busy=progress.busy,
        )
        self.store.set_preflight(started.job_id, {"collective": prepared.preflight.collective})
        return started
