"""What a rank leaves for a stall's evidence (observe/evidence.py reads it): stdlib only, set before torch.

In ``<output_dir>/dzctl-ranks/<job id>/`` (spec/recovery.py ``rank_files_dir``):

- ``rank-R.stacks``: every thread's Python stack, appended each time the rank gets SIGUSR1.
  ``faulthandler.register`` writes it from the C signal handler, so it works while the main
  thread sits in a collective, a read or a lock, where a Python-level handler would never run;
- ``pulse.json`` (rank 0): the phase (data-build, model-load, first-step, step, save, eval, done),
  when it began, the last step that ended and when, and the recent step times: what the stall
  rule (observe/stall.py) needs, rewritten at each step (one small file, renamed into place);
- on GPU jobs, the NCCL flight recorder: ``TORCH_NCCL_TRACE_BUFFER_SIZE`` keeps each rank's last
  collectives; ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` gives each rank a named pipe that makes
  ProcessGroupNCCL dump them on demand to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + rank (its own
  watchdog thread does it, with Python stuck or not), and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` dumps
  them when a collective times out.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path

from ...spec.recovery import PULSE_FILE, rank_files_dir
from ..environment import set_missing

TRACE_ENTRIES = "2000"  # the flight recorder's ring: about the last 2000 collectives of each rank
RECENT_STEPS = 20
_handle = None  # the open stacks file: faulthandler writes to its descriptor, which must stay open


def files_dir(output_dir: Path, environ: MutableMapping[str, str] = os.environ) -> Path:
    return Path(rank_files_dir(str(output_dir), environ.get("DZCTL_JOB_ID") or "run"))


def flight_recorder_env(folder: Path, env: MutableMapping[str, str]) -> dict[str, str]:
    """NCCL's flight recorder and its dump on demand (GPU jobs); values already set win."""
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": TRACE_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # torch appends the rank to both: nccl-trace-rank-0, nccl-pipe-rank-0.pipe
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(folder / "nccl-trace-rank-"),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(folder / "nccl-pipe-rank-"),
    }
    return set_missing(env, wanted)


def prepare(output_dir: Path, accelerator: str, env: MutableMapping[str, str] = os.environ) -> Path:
    """Before torch: the folder, the stack dump on SIGUSR1, and (GPU) the flight recorder's variables."""
    global _handle
    folder = files_dir(output_dir, env)
    folder.mkdir(parents=True, exist_ok=True)
    if accelerator != "cpu":
        flight_recorder_env(folder, env)
    rank = env.get("RANK", "0")
    if _handle is None:
        _handle = open(folder / f"rank-{rank}.stacks", "a", buffering=1)  # noqa: SIM115 (open for the process's life)
        faulthandler.register(signal.SIGUSR1, file=_handle, all_threads=True, chain=False)
    return folder


class Pulse:
    """Rank 0's ``pulse.json``: the phase and the step times the stall rule reads. Others: no-ops."""

    def __init__(self, folder: Path | None, rank: int) -> None:
        self.path = folder / PULSE_FILE if folder is not None and rank == 0 else None
        self.state: dict = {"phase": "data-build", "since": time.time(), "step": None, "step_ended_at": None,
                            "recent_step_s": []}  # fmt: skip
        # Told each new phase, on every rank: the process group's timeout follows it (hang/timeout.py).
        self.listeners: list[Callable[[str], None]] = []

    def listen(self, listener: Callable[[str], None]) -> None:
        self.listeners.append(listener)

    def phase(self, name: str) -> None:
        moved = name != self.state["phase"]
        self.state.update(phase=name, since=time.time())
        self._write()
        if moved:
            self._tell(name)

    def step_ended(self, step: int, seconds: float | None) -> None:
        now = time.time()
        recent = self.state["recent_step_s"]
        if seconds is not None:
            recent.append(round(seconds, 4))
            del recent[:-RECENT_STEPS]
        moved = self.state["phase"] != "step"
        self.state.update(phase="step", since=now, step=step, step_ended_at=now)
        self._write()
        if moved:
            self._tell("step")

    def resume_steps(self) -> None:
        """Back to training after a save or an eval: the next step's wait counts from now, not from the
        step before the save (which would read a long save as a stalled step)."""
        now = time.time()
        before = self.state["phase"]
        self.state.update(phase="step" if self.state["step"] is not None else "first-step", since=now,
                          step_ended_at=now)  # fmt: skip
        self._write()
        if self.state["phase"] != before:
            self._tell(self.state["phase"])

    def _tell(self, name: str) -> None:
        for listener in self.listeners:
            listener(name)

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            temp = self.path.with_suffix(".tmp")
            temp.write_text(json.dumps({**self.state, "time": time.time()}))
            os.replace(temp, self.path)
        except OSError:
            pass  # the pulse is for the watcher; a full disk must not fail the step (the save will say it)


_pulse = Pulse(None, 1)


def pulse() -> Pulse:
    return _pulse


def start_pulse(folder: Path, rank: int) -> Pulse:
    global _pulse
    _pulse = Pulse(folder, rank)
    _pulse.phase("data-build")
    return _pulse
