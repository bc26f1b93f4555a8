"""The supervisor: a detached process on the controller that watches one job and relaunches it.

``dzctl launch`` of a job with ``restart:`` or ``notify:`` starts it (``start_supervisor``) once
every node runs; it records its pid in the supervision record (``record.py``) and lives in its
own session, so closing the terminal (SIGHUP) or ending the launch leaves it running. Why the
controller, and not node 0 or a Slurm requeue: the controller already holds what a relaunch
needs (the job file, its env file's secrets, the hostfile and the SSH keys); node 0 may be the
node that was lost; and a relaunch there would need the controller's credentials on a node.
The cost: the controller must stay up. Slurm jobs are not supervised yet (``launch`` refuses
``restart:``/``notify:`` there and names ``sbatch --requeue``).

On a failure the policy (``policy.decide``) says no to:
bad input, out of memory, a listed final exit code, a cause ``restart.on`` leaves out, the
limit. Otherwise:

1. wait until no node of the failed attempt still runs a rank (the gang watchdog stops them
   within its grace time; after ``GANG_DOWN_TIMEOUT_S`` they are stopped). A node that cannot be
   reached is not waited for: its ranks lose the rendezvous store and stop by themselves;
2. wait ``restart.backoff_s``, in slices, so that ``dzctl stop`` ends it at once;
3. relaunch with ``launcher.prepare`` and ``launcher.execute`` (the same code as ``dzctl
   launch``: preflight on the nodes, the memory plan, the collective check, the start) as a new
   attempt: a new job id, the same name and output dir, so the trainer resumes from the newest
   complete checkpoint. A node that fails preflight is swapped for a spare (``spares.py``),
   keeping its node rank and slot count, and preflight runs again on the new set;
4. record the restart (cause, the node replaced, the seconds from the failure seen to running)
   and tell the webhook.

``dzctl stop`` marks the record stopped and sends SIGTERM: outside a start the supervisor ends at
once; during one it finishes the start, stops what it started, then ends. Nothing starts after.

Cost on the controller: one ``status`` poll every ``POLL_S`` (one SSH command per node, the
connections kept open), a preflight per restart; memory independent of rows and model size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ...errors import DzError, RuntimeFailure
from ...observe.hosts import gather_status, node_states, stop_nodes
from ...observe.status import JobStatus
from ...observe.store import JobRecord, JobStore, dzctl_home
from ...planning.inputs import job_secrets
from ...spec.hostfile import Node, read_hostfile
from ...spec.job import LoadedJob, load_job
from ...spec.recovery import NotifySpec, RestartSpec
from ...transport.pool import HostPool
from .. import launcher
from ..fleet import SshFleet
from . import notify
from .policy import Verdict, decide
from .record import ENDED, SupervisionStore
from .spares import Replacement, replace_failed, spare_candidates, unused_entries

MODULE = "orchestrator.backends.recovery.supervisor"
POLL_S = float(os.environ.get("DZCTL_SUPERVISOR_POLL_S", "5"))  # a fault is seen within one poll
# The gang watchdog's default grace (15 s, train/gang.py) twice, plus a start's slack: past it a
# rank still running after its gang failed is stopped, not waited for.
GANG_DOWN_TIMEOUT_S = 60.0


def supervised(spec) -> bool:
    """Whether a launched job gets a supervisor: it has a restart policy or a webhook to tell."""
    return spec.restart is not None or spec.notify is not None


def start_supervisor(lineage: str, name: str, launch_args: dict) -> int:
    """Record the supervision and start its detached process; its pid."""
    with SupervisionStore() as store:
        store.add(lineage, name, launch_args)
        log_path = log_file(lineage)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", MODULE, lineage],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not the terminal's: its hangup and Ctrl-C do not reach here
                close_fds=True,
            )
        store.set_pid(lineage, proc.pid)
    return proc.pid


def log_file(lineage: str) -> Path:
    return dzctl_home() / "supervisors" / f"{lineage}.log"


def end_supervisor(pid: int | None, lineage: str, timeout_s: float = 180.0) -> str:
    """SIGTERM the supervisor of ``lineage`` (only if ``pid`` is it) and wait for it to end."""
    if pid is None or not _is_supervisor(pid, lineage):
        return "not running"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _is_supervisor(pid, lineage):
        if time.monotonic() > deadline:
            raise RuntimeFailure(
                f"the supervisor of {lineage} (pid {pid}) did not end within {timeout_s:g} s of SIGTERM",
                fix=f"kill {pid}, then rerun dzctl stop",
            )
        time.sleep(0.2)
    return f"stopped (pid {pid})"


def _is_supervisor(pid: int, lineage: str) -> bool:
    """The pid runs this lineage's supervisor (a recycled pid is some other process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    zombie = stat.rpartition(")")[2].split()[:1] == ["Z"]
    return not zombie and MODULE.encode() in argv and lineage.encode() in argv


class _Progress(launcher.Silent):
    """The launch sequence's notes go to the supervisor's log; the last preflight report is kept."""

    def __init__(self) -> None:
        self.report = None

    def note(self, text: str) -> None:
        say(text)

    def preflight(self, report, *, final: bool) -> None:
        self.report = report


def say(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} {text}", flush=True)


class Supervisor:
    def __init__(self, lineage: str, poll_s: float = POLL_S) -> None:
        self.lineage = lineage
        self.poll_s = poll_s
        self.store = SupervisionStore()
        self._starting = False  # inside a start: SIGTERM waits for it to finish
        self._terminated = False

    # -- signals --------------------------------------------------------------------------------
    def on_sigterm(self, signum, frame) -> None:
        if self._starting:
            self._terminated = True
        else:
            raise SystemExit(143)

    def stopped(self) -> bool:
        return self._terminated or self.store.get(self.lineage).state == "stopped"

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        say(f"supervising {self.lineage} (pid {os.getpid()})")
        while True:
            current = self.store.get(self.lineage)
            if current.state in ENDED:
                say(f"ended: {current.state}")
                return 0
            with JobStore() as jobs:
                record = jobs.get(current.current_job_id)
            status = self.watch(record, current.launch)
            if status is None:  # stopped while watching
                return 0
            if status.state == "succeeded":
                self.tell("succeeded", record, status)
                self.store.set_state(self.lineage, "succeeded", final=f"{record.job_id} succeeded")
                continue
            if status.state == "stopped":
                self.store.stop(self.lineage, f"{record.job_id} was stopped")
                continue
            restart_policy = _policy(record, "restart", RestartSpec)
            verdict = decide(status, restart_policy, len(current.restarts))
            say(f"{record.job_id} failed: {verdict.why}")
            if not verdict.restart:
                self.tell("failed", record, status, cause=verdict.cause, why=verdict.why, **_culprit(status))
                self.store.set_state(self.lineage, "gave-up", final=verdict.why)
                continue
            seen_at = time.time()
            # A hang's evidence is taken (status did, before this verdict): its ranks never end by
            # themselves, so they are stopped now rather than after the gang's grace.
            self.wait_gang_down(record, current.launch, stop_now=verdict.cause == "hang")
            if not self.backoff(restart_policy.backoff_s):
                continue
            self.restart(record, status, verdict, seen_at)

    def watch(self, record: JobRecord, launch: dict) -> JobStatus | None:
        """Poll the attempt until it is no longer running; None once the supervision is stopped."""
        stalled_at = None  # (phase, step) of a stall seen once: acted on only when the next poll agrees
        with _pool(record.hosts, launch) as pool:
            while True:
                if self.stopped():
                    return None
                try:
                    status = gather_status(record, pool)
                except DzError as exc:  # the controller's own network, a blip: ask again
                    say(f"status of {record.job_id}: {exc}")
                    time.sleep(self.poll_s)
                    continue
                if status.state == "stalled":
                    seen = ((status.stall or {}).get("phase"), (status.stall or {}).get("step"))
                    if seen != stalled_at:  # one poll more: a step that ended meanwhile clears it
                        say(f"{record.job_id}: {(status.stall or {}).get('line')}; confirming on the next poll")
                        stalled_at = seen
                        time.sleep(self.poll_s)
                        continue
                if status.state not in ("running", "pending"):
                    if status.state != "stalled":  # the ranks still run: the record keeps "running"
                        with JobStore() as jobs:
                            jobs.set_state(record.job_id, status.state)
                    return status
                time.sleep(self.poll_s)

    def wait_gang_down(self, record: JobRecord, launch: dict, stop_now: bool = False) -> None:
        deadline = time.monotonic() + (0.0 if stop_now else GANG_DOWN_TIMEOUT_S)
        with _pool(record.hosts, launch) as pool:
            while True:
                states = node_states(record, pool)
                running = [rank for rank, s in states.items() if s.state in ("running", "created")]
                if not running:
                    return
                if time.monotonic() >= deadline:
                    say(f"ranks still running on nodes {running}: stopping them")
                    stop_nodes(record, pool, remove=False, ranks=running)
                    return
                time.sleep(1.0)

    def backoff(self, seconds: float) -> bool:
        """Wait before the relaunch; False once stopped (the stop ends the wait at once)."""
        if not self.store.set_state(self.lineage, "backoff"):
            return False
        say(f"backing off {seconds:g} s")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stopped():
                return False
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return not self.stopped() and self.store.set_state(self.lineage, "restarting")

    # -- the relaunch ---------------------------------------------------------------------------
    def restart(self, failed: JobRecord, status: JobStatus, verdict: Verdict, seen_at: float) -> None:
        current = self.store.get(self.lineage)
        launch = current.launch
        try:
            job = _load(launch)
            suspects = set((status.stall or {}).get("culprit", {}).get("suspect_hosts") or ()) if (
                verdict.cause == "hang") else set()  # fmt: skip
            prepared, replaced, pool = self.prepare_on_healthy_nodes(job, failed, launch, suspects)
        except DzError as exc:
            why = f"restart after {verdict.cause} refused: {exc.message}" + (f" (fix: {exc.fix})" if exc.fix else "")
            say(why)
            self.tell("failed", failed, status, cause=verdict.cause, why=why)
            self.store.set_state(self.lineage, "gave-up", final=why)
            return
        with pool:
            self._starting = True
            try:
                if self.stopped():
                    return
                with JobStore() as jobs:
                    launcher.execute(prepared, SshFleet(pool, jobs), _Progress())
            except DzError as exc:
                why = f"the relaunch did not start: {exc.message}"
                say(why)
                self.tell("failed", failed, status, cause=verdict.cause, why=why)
                self.store.set_state(self.lineage, "gave-up", final=why)
                return
            finally:
                self._starting = False
            new_id = prepared.plan.job_id
            if self._terminated:  # `dzctl stop` came during the start: undo it, then end
                with JobStore() as jobs:
                    stop_nodes(jobs.get(new_id), pool, remove=True)
                    jobs.set_state(new_id, "stopped", reason="dzctl stop (during a restart)")
                raise SystemExit(143)
        restart = {
            "number": len(current.restarts) + 1,
            "cause": verdict.cause,
            "why": verdict.why,
            "from_job_id": failed.job_id,
            "job_id": new_id,
            "first_failure": status.first_failure,
            "replaced": [r.to_dict() for r in replaced],
            "failed_seen_at": seen_at,
            "started_at": time.time(),
            "seconds_to_running": round(time.time() - seen_at, 1),
        }
        self.store.started(self.lineage, new_id, restart)
        self.store.set_state(self.lineage, "watching")
        say(f"restarted as {new_id}" + "".join(f"; node {r.node_rank}: {r.host} -> {r.spare}" for r in replaced))
        with JobStore() as jobs:
            new_record = jobs.get(new_id)
        self.tell("restarted", new_record, None, cause=verdict.cause, why=verdict.why,
                  failed_job_id=failed.job_id, failure=status.first_failure, **_culprit(status),
                  replaced=restart["replaced"], restarts=restart["number"])  # fmt: skip

    def prepare_on_healthy_nodes(
        self, job: LoadedJob, failed: JobRecord, launch: dict, suspects: frozenset[str] | set[str] = frozenset()
    ):
        """``launcher.prepare`` on the failed attempt's nodes, swapping each that fails preflight for a spare.

        ``suspects``: hosts a hang's evidence points at (their rank stopped, in uninterruptible I/O,
        blocked in a read, unreachable: observe/culprit.py). Each is swapped for a spare before
        preflight, where one fits; with none left, the job restarts on the same nodes (preflight
        still judges them)."""
        nodes = [Node(n["host"], tuple(n["gpus"]) or tuple(range(n["slots"]))) for n in failed.plan["nodes"]]
        spares = spare_candidates(
            list(job.spec.restart.spare_hosts) if job.spec.restart else [],
            job.where("restart.spare_hosts"),
            unused_entries(read_hostfile(launch["hostfile"]), nodes),
            launch["hostfile"],
        )
        node_local = failed.spec.get("train", {}).get("output_storage") == "node-local"
        options = launcher.LaunchOptions(
            skip_collective=launch.get("skip_collective", False),
            collective_timeout_s=launch.get("collective_timeout", 60.0),
            ssh_config=launch.get("ssh_config"),
        )
        tried: set[str] = set()
        replaced: list[Replacement] = []
        if suspects and not node_local:
            try:
                nodes, replaced = replace_failed(nodes, suspects, spares, tried)
                tried |= suspects
                say("the hang's evidence points at " + ", ".join(sorted(suspects)) + ": "
                    + "; ".join(f"node {r.node_rank}: {r.host} -> {r.spare}" for r in replaced))  # fmt: skip
            except DzError as exc:
                say(f"the hang's evidence points at {', '.join(sorted(suspects))}, but no spare: {exc.message}")
        while True:
            if self.stopped():
                raise SystemExit(0)
            job_id = launcher.new_job_id(job.spec.name)
            self.store.add_attempt(self.lineage, job_id)
            progress = _Progress()
            pool = _pool([n.host for n in nodes], launch)
            try:
                prepared = launcher.prepare(job, nodes, pool, options, progress, job_id=job_id)
                return prepared, replaced, pool
            except RuntimeFailure as exc:
                pool.close()
                failures = progress.report.failures() if progress.report is not None else []
                # An unreachable node first: the others' checks that need it (node 0's route) fail with it.
                unreachable = {host for host, check in failures if check.name == "ssh"}
                bad = unreachable or {host for host, _ in failures}
                if not bad or (not unreachable and bad == {n.host for n in nodes}):
                    raise  # not one node's fault (or every node's): a spare would not fix it
                say(f"preflight failed on {', '.join(sorted(bad))}: {exc.message}")
                if node_local:
                    raise RuntimeFailure(
                        f"{', '.join(sorted(bad))} failed preflight, and the job's checkpoints are on each "
                        "node's own disk (train.output_storage node-local): a spare would not hold that "
                        "node's shards, so no spare is used",
                        fix="repair the node and launch again, or keep checkpoints on shared storage "
                        "(train.output_dir on a filesystem every node mounts) so a spare can resume",
                    ) from None
                nodes, now = replace_failed(nodes, bad, spares, tried)
                tried |= bad
                # A spare that failed in turn: the node it stood in for is the one replaced.
                original = {r.spare: r.host for r in replaced}
                now = [dataclasses.replace(r, host=original.get(r.host, r.host)) for r in now]
                replaced = [r for r in replaced if r.spare not in bad] + now
            except BaseException:
                pool.close()
                raise

    # -- notifications -----------------------------------------------------------------------
    def tell(self, event: str, record: JobRecord, status: JobStatus | None, **facts) -> None:
        spec = _policy(record, "notify", NotifySpec)
        if spec is None or event not in spec.on:
            return
        try:
            url = notify.webhook_url(spec, _secrets(self.store.get(self.lineage).launch), "notify.webhook")
        except DzError as exc:
            self.store.notified(self.lineage, {"event": event, "job_id": record.job_id, "ok": False,
                                               "error": exc.message})  # fmt: skip
            return
        failure = facts.pop("failure", None) or (status.first_failure if status else None)
        state = status.state if status else "running"
        body = notify.payload(event, job=record.name, job_id=record.job_id, state=state, first_failure=failure,
                              lineage=self.lineage, **facts)  # fmt: skip
        outcome = notify.post(url, body, spec.timeout_s)
        say(f"notify {event}: {outcome}")
        self.store.notified(self.lineage, {"event": event, "job_id": record.job_id, **outcome})


def _culprit(status: JobStatus) -> dict:
    """A hang's one line for the webhook: who the ranks wait for, where, in which collective and step."""
    culprit = (status.stall or {}).get("culprit") if status.state == "stalled" else None
    return {"culprit": culprit["line"]} if culprit else {}


def _policy(record: JobRecord, key: str, model):
    value = record.spec.get(key)
    return None if value is None else model.model_validate(value)


def _load(launch: dict) -> LoadedJob:
    """The job as the launch read it: its file and ``--set`` again (and its env file's secrets, now)."""
    return load_job(launch["job_file"], tuple(launch.get("overrides", ())))


def _secrets(launch: dict) -> dict[str, str]:
    return job_secrets(_load(launch))


def _pool(hosts: list[str], launch: dict) -> HostPool:
    return HostPool(hosts, ssh_config=launch.get("ssh_config"), trust_new_hosts=launch.get("trust_new_hosts", False))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    supervisor = Supervisor(args[0])
    signal.signal(signal.SIGTERM, supervisor.on_sigterm)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a terminal closing is no reason to stop
    try:
        return supervisor.run()
    except SystemExit as exc:
        say(f"supervisor exits ({exc.code})")
        return 0
    except BaseException as exc:  # a bug here: said in the log and the record, the job itself goes on
        import traceback

        traceback.print_exc()
        supervisor.store.set_state(args[0], "gave-up", final=f"the supervisor failed: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
