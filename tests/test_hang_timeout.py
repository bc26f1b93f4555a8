"""The process group's timeout follows the phase (issue 45): minutes in training, from the plan's predicted
step; long while the model loads and while a checkpoint is written (train/hang/timeout.py).

The value is pure; the predicted step travels from the memory plan to the ranks' environment in the launch
plan (a real plan of jobs/qwen3-8b.yaml on 2 x 8 H100s); and the trainer's pulse sets it on a real, live gloo
group (one rank, in this process: no launch)."""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

from orchestrator.backends.launcher import predicted_optimizer_step_s
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.launchplan import make_plan
from orchestrator.planning.memory.fromjob import SpeedInputs, plan_for_job
from orchestrator.planning.speed.communication import Links
from orchestrator.planning.speed.steptime import GPU_KINDS
from orchestrator.spec.hostfile import Node
from orchestrator.spec.job import load_job
from orchestrator.spec.recovery import StallSpec
from orchestrator.train.hang.stacks import Pulse
from orchestrator.train.hang.timeout import PREDICTED_STEP_ENV, PhaseTimeout, group_timeout_s, predicted_step_s

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = StallSpec().model_dump()


def test_the_timeout_is_twice_each_phase_stall_bound_and_never_under_five_minutes():
    phases = ("start", "model-load", "first-step", "step", "save", "eval", "done")
    got = {p: group_timeout_s(p, DEFAULTS, None) for p in phases}
    assert got == {"start": 7200.0, "model-load": 3600.0, "first-step": 1800.0, "step": 360.0, "save": 3600.0,
                   "eval": 3600.0, "done": None}  # fmt: skip
    # Training: 20 x the plan's predicted step (2 x stall.multiple 10) once that passes 2 x stall.floor_s.
    assert group_timeout_s("step", DEFAULTS, 30.0) == 600.0 and group_timeout_s("step", DEFAULTS, 1.0) == 360.0
    assert group_timeout_s("first-step", DEFAULTS, 120.0) == 2400.0  # 2 x (10 x 120 s), over 2 x first_step_s
    # The 2-host test's lowered bounds (floor 6 s, multiple 3): the 5-minute floor, not 12 s.
    assert group_timeout_s("step", {**DEFAULTS, "floor_s": 6.0, "multiple": 3.0}, 0.25) == 300.0


def test_the_plan_predicted_step_reaches_every_rank_environment_and_sets_the_training_timeout():
    loaded = load_job(str(REPO / "jobs/qwen3-8b.yaml"))
    speed = SpeedInputs(gpu=GPU_KINDS["H100"], links=Links.rated(100, GPU_KINDS["H100"].intra_bytes_per_s, "test"))
    memory, _ = plan_for_job(read_inputs(loaded), [8, 8], gpu_mem_gib=80, host_mem_gib=1024, speed=speed)
    predicted = predicted_optimizer_step_s(memory)
    assert predicted == memory.speed.step.optimizer_step_s and predicted > 0
    nodes = [Node("node0", tuple(range(8))), Node("node1", tuple(range(8)))]
    plan = make_plan(loaded.spec, nodes, "qwen3-8b-1", predicted_step_s=predicted)
    for node in plan.nodes:
        assert node.env[PREDICTED_STEP_ENV] == f"{predicted:.3f}"
        assert f"{PREDICTED_STEP_ENV}={predicted:.3f}" in node.argv  # docker run --env: what the ranks get
        # The trainer's side: the value it reads back, and the timeout it sets once steps end.
        seen = predicted_step_s(node.env)
        assert group_timeout_s("step", loaded.spec.stall.model_dump(), seen) == max(360.0, 20 * seen)
    unpredicted = make_plan(loaded.spec, nodes, "qwen3-8b-1")
    assert all(PREDICTED_STEP_ENV not in n.env for n in unpredicted.nodes)
    assert predicted_step_s({}) is None and predicted_step_s({PREDICTED_STEP_ENV: "x"}) is None


def test_the_pulse_moves_a_live_gloo_group_timeout_with_each_phase():
    import torch
    import torch.distributed as dist

    timeouts = PhaseTimeout(DEFAULTS, 30.0, rank=1)  # rank 1: says nothing
    pulse = Pulse(None, 1)
    pulse.listen(timeouts.phase)
    pulse.phase("model-load")  # before the group exists: nothing to set, the start timeout covers it
    with tempfile.NamedTemporaryFile() as rendezvous:
        store = dist.FileStore(rendezvous.name, 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeouts.start_timeout())
        try:
            gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            seen = [gloo.options._timeout]
            moves = (lambda: pulse.phase("first-step"), lambda: pulse.step_ended(1, 0.5),
                     lambda: pulse.step_ended(2, 0.5), lambda: pulse.phase("save"), pulse.resume_steps)  # fmt: skip
            for move in moves:
                move()
                seen.append(gloo.options._timeout)
        finally:
            dist.destroy_process_group()
    assert seen == [timedelta(seconds=s) for s in (7200, 1800, 600, 600, 3600, 600)]
    assert not timeouts.failed
