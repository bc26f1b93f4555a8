"""``python -m orchestrator.train JOB.yaml [--ds-config PATH] [--output-dir DIR] [--set KEY=VALUE]``.

Run on every rank by the per-node launcher (``torchrun ... -m orchestrator.train
/job/job.yaml``). The spec is read and the environment prepared before torch is
imported (DeepSpeed reads ``DS_ACCELERATOR`` at import).

- ``--ds-config``: the DeepSpeed config to use. Default: ``ds_config.json`` beside
  the job file (where ``dzctl launch`` puts the planner's config), else one
  generated from the spec by ``orchestrator.planning.dsconfig``.
- ``--output-dir``: where checkpoints, the final model and ``progress.jsonl`` go.
  Default: ``train.output_dir``, else ``<launch.remote_dir>/output/<name>`` with
  ``{host}`` in ``remote_dir`` replaced by this machine's host name
  (``socket.gethostname()``, which with ``--network host`` is the node's).
- ``--set KEY=VALUE``: spec overrides, as for dzctl. (``dzctl launch`` writes the
  planner's choices into the job.yaml it ships, so it needs none.) The trainer
  takes micro-batch, accumulation and precision from the DeepSpeed config, and
  gradient checkpointing from the spec (``auto``: on for GPUs, off on CPU).
- ``--no-save``: no checkpoints, no final model (throughput benchmarks only).

Exit codes: 0 done; 2 bad input (spec, data, ds_config, a checkpoint that cannot
be resumed); 1 anything else. Every failure is also an ``error`` event in
``progress.jsonl`` (when the output folder is known) with a one-line reason.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from ..errors import DzError
from ..spec.job import JobSpec, load_job
from .progress import ProgressLog


def default_output_dir(spec: JobSpec) -> Path:
    if spec.train.output_dir:
        return Path(spec.train.output_dir.replace("{host}", socket.gethostname()))
    remote = spec.launch.remote_dir.replace("{host}", socket.gethostname())
    return Path(remote) / "output" / spec.name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.train", description=__doc__.splitlines()[0])
    parser.add_argument("job", type=Path, help="the job file (job.yaml)")
    parser.add_argument("--ds-config", type=Path, default=None)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-save", action="store_true")
    return parser.parse_args(argv)


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", 0))


def single_rank_defaults(env=None) -> None:
    """A plain ``python -m orchestrator.train`` (no launcher) is a job of one rank on this machine."""
    import os

    env = os.environ if env is None else env
    if "RANK" in env:
        return
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        # A free port, so two single-rank runs on one machine do not collide.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    single_rank_defaults()
    from .rankprefix import prefix_rank_output

    prefix_rank_output()  # "[rankN]:" on each line: the live view says which ranks printed what
    log: ProgressLog | None = None
    try:
        loaded = load_job(args.job, args.overrides)
        output_dir = args.output_dir or default_output_dir(loaded.spec)
        log = ProgressLog(output_dir / "progress.jsonl", echo=True)
        from .environment import cuda_arch_default, early_defaults, quiet_known_warnings

        early_defaults(loaded.spec.accelerator)
        from .hang import stacks  # before torch: the flight recorder reads its variables at import

        stacks.start_pulse(stacks.prepare(output_dir, loaded.spec.accelerator), _rank())
        quiet_known_warnings()
        from . import run  # torch, transformers, deepspeed: only now

        cuda_arch_default()
        save = not args.no_save and loaded.spec.train.save  # either one turns saving off
        run.train(loaded, output_dir=output_dir, ds_config_path=args.ds_config, save=save, log=log)
        end_process_group()
        return 0
    except BaseException as exc:  # every failure must leave an error event
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return 0
        reason = _one_line(exc)
        # Tell the other nodes now, rather than after they miss this node's heartbeat.
        from .gang import report_failure

        failure_seq = report_failure(reason)
        code = exc.exit_code if isinstance(exc, DzError) else 130 if isinstance(exc, KeyboardInterrupt) else 1
        # The event first: a watcher that has it knows the lines below say the same (see
        # observe/watchstate.py), and shows the message, its fix and this rank's exit code once.
        if log is not None:
            try:
                extra = {} if failure_seq is None else {"failure_seq": failure_seq}
                log.write("error", reason=reason, rank=_rank(), exit_code=code, **_message_and_fix(exc), **extra)
            except OSError as write_error:
                print(f"error: cannot write {log.path}: {write_error}", file=sys.stderr)
        if isinstance(exc, DzError):
            print(f"error: {exc.message}", file=sys.stderr)
            if exc.fix:
                print(f"fix: {exc.fix}", file=sys.stderr)
        else:
            # A crash inside torch/DeepSpeed: the traceback is the container log's evidence.
            traceback.print_exc()
        if failure_seq is not None:
            # Last, so the log's tail keeps it: status orders failures by it, not by node clocks.
            print(f"dzctl failure-seq: {failure_seq} (node's place among the job's failure reports)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        from .gang import end_node

        end_node(code)  # multi-node: ends the node now (see gang.end_node); otherwise returns
        return code


def end_process_group() -> None:
    """Destroy this rank's process group: the documented clean end (NCCL frees its communicators).

    Only after success: every rank is past its last collective, so this waits on no peer. It is
    not enough on its own to make the exit safe: see ``exit_rank``.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End this rank with ``code``: Python's exit handlers run, interpreter finalization does not.

    Left to interpreter exit, gloo's worker threads can still hold finished work whose tensors
    reference Python objects; freeing them then needs the GIL of an interpreter being torn down,
    and the rank aborts (SIGABRT, "terminate called without an active exception") after a run
    that succeeded, failing the node. The mechanism is described in pytorch/pytorch pull request
    179291 (abandoned upstream). ``destroy_process_group`` does not prevent it: for gloo it only
    forgets the group, whose threads keep running while anything still holds it (DeepSpeed's
    engine and ZeRO-3 optimizer keep theirs) until finalization frees it. CI saw the abort twice,
    the second time after ``end_process_group`` was in place.

    So the rank ends the way a crash-free exit would, minus the finalization: the ``atexit``
    handlers (logging, trackers such as wandb) run while the interpreter is whole, the streams are
    flushed, and ``os._exit`` leaves the freeing of memory, threads and sockets to the kernel.
    Every file the trainer writes is closed by then (checkpoints, the model, progress.jsonl).
    """
    import atexit
    import os

    try:
        # The handlers Python runs at exit; no public call runs them without finalizing. Their
        # exceptions are printed, not raised.
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _message_and_fix(exc: BaseException) -> dict[str, str | None]:
    """The error event's ``message`` and ``fix``, apart (``reason`` joins them on one line)."""
    if isinstance(exc, DzError):
        return {"message": exc.message.strip().splitlines()[0] if exc.message.strip() else "", "fix": exc.fix}
    return {"message": _one_line(exc), "fix": None}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    fix = getattr(exc, "fix", None)
    reason = f"{type(exc).__name__}: {first}" if not isinstance(exc, DzError) else first
    return f"{reason} (fix: {fix})" if fix else reason
