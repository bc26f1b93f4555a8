"""The culprit's collective when the waiting rank is in a ZeRO-3 handle's wait, not in distributed_c10d."""

from __future__ import annotations

from orchestrator.observe.culprit import collective_of, name_culprit

# Rank 0 stopped in the forward's parameter fetch, as faulthandler dumped it in tests/test_hang_recovery.py:
# ZeRO-3 waits on its async all-gather's handle from its own frame, and no distributed_c10d frame is left.
IN_FETCH = """Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/zero/partition_parameters.py", line 720 in wait
  File "/venv/site-packages/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 340 in fetch_sub_module
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1790 in _call_impl
  File "/repo/orchestrator/train/entry.py", line 40 in main
"""
IN_STEP = IN_FETCH.replace('partition_parameters.py", line 720 in wait', 'stage3.py", line 1390 in step')


def test_a_rank_waiting_on_a_zero3_fetch_handle_is_inside_the_all_gather():
    assert collective_of(IN_FETCH) == "all_gather (ZeRO-3 parameter fetch)"
    assert collective_of(IN_STEP) is None
    nodes = [
        {"node_rank": 0, "host": "node0", "ranks": [{"rank": 0, "state": "S", "stack": IN_FETCH}]},
        {"node_rank": 1, "host": "node1", "ranks": [{"rank": 1, "state": "T", "stack": IN_STEP}]},
    ]
    culprit = name_culprit(nodes, step=6)
    assert culprit is not None and culprit["ranks"] == [1] and culprit["kind"] == "stopped"
    assert culprit["collective"] == "all_gather (ZeRO-3 parameter fetch)" and culprit["waiting_ranks"] == [0]


def test_the_predicted_step_is_the_plans_optimizer_step_counted_once():
    from orchestrator.observe.stall import predicted_step_s

    speed = {"predicted": True, "micro_step_s": 1.0, "optimizer_step_s": 4.2}  # 4 micro-steps + 0.2 s
    assert predicted_step_s(speed, 4) == 4.2  # was 1.0 × 4 + 4.2
    assert predicted_step_s({"predicted": True, "micro_step_s": 1.0}, 4) == 4.0  # a plan from before the key
    assert predicted_step_s({"predicted": False}, 4) is None
