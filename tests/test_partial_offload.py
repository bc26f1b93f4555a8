"""DeepSpeed's partial optimizer offload (``offload_optimizer.ratio``, ZeRO-Offload++) in the plan (issue 42).

A job whose ``zero.overrides`` set a ratio runs with that share of the optimizer's sub-groups on the host and the
rest stepped on the GPU, each keeping its fp32 master, Adam's moments and an fp32 gradient there. The planner
used to plan the whole optimizer on the host: the GPU-resident states were missing from the peak (the unsafe
side) and from the step. DeepSpeed keeps whole sub-groups only (``int((1 - ratio) * groups)`` of them), so the
plan says when a ratio keeps none. Pure: ``dzctl plan`` on one H100's memory, no GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from shapejobs import write_shape_job

from orchestrator.cli import main
from orchestrator.planning.memory.estimate import GIB, PARTIAL_OFFLOAD_TERM, PartialOffload
from orchestrator.planning.speed.offload import HOST_OTHER_PASSES
from orchestrator.planning.speed.partialchoice import MIN_GAIN


def _plan(tmp_path: Path, *sets: str, host_adam_rate: str = "5") -> tuple[int, dict | str]:
    train = {"max_seq_len": 4096, "global_batch_size": 32, "save": False}
    job = write_shape_job(tmp_path / "job.yaml", "partial-offload", train, layers=18, data={"path": "synthetic:random"})
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=1\n", encoding="utf-8")
    args = ["plan", str(job), "--hosts", str(hosts), "--gpu-mem-gib", "80", "--host-mem-gib", "125"]
    args += ["--gpu-kind", "H100", "--host-adam-rate", host_adam_rate, "--json", "--set", "zero.offload=optimizer"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(main, args)
    return result.exit_code, json.loads(result.output) if result.exit_code == 0 else result.output


def test_a_ratio_plans_the_sub_groups_it_keeps_on_the_gpu_and_the_host_steps_the_rest(tmp_path):
    code, whole = _plan(tmp_path)
    assert code == 0, whole
    half_overrides = "zero.overrides={zero_optimization: {sub_group_size: 500000000, offload_optimizer: {ratio: 0.5}}}"
    code, half = _plan(tmp_path, half_overrides)
    assert code == 0, half
    shard = whole["trainable_params"]  # one rank: the whole model
    on_gpu = PartialOffload(0.5, 500_000_000).on_gpu(shard)
    assert on_gpu == 5 * 500_000_000  # 5 of the shard's 10 sub-groups
    gpu, host = half["breakdown"]["gpu"], half["breakdown"]["host_per_rank"]
    assert gpu[PARTIAL_OFFLOAD_TERM] == pytest.approx(16 * on_gpu / GIB, abs=0.01)
    assert host["fp32 master + Adam m,v"] == pytest.approx(12 * (shard - on_gpu) / GIB, abs=0.01)
    assert whole["breakdown"]["host_per_rank"]["fp32 master + Adam m,v"] == pytest.approx(12 * shard / GIB, abs=0.01)
    assert PARTIAL_OFFLOAD_TERM not in whole["breakdown"]["gpu"]
    # The host steps half the elements; every gradient still makes its trips: the optimizer's part is shorter.
    # At --host-adam-rate 5 (G/s) the host's AdamW and its other passes over 2.5 G elements are saved; the weights'
    # upload saved and the GPU's own AdamW over them are a few percent of that.
    saved = whole["step_time"]["optimizer_s"] - half["step_time"]["optimizer_s"]
    assert saved == pytest.approx((1 + HOST_OTHER_PASSES) * on_gpu / 5e9, rel=0.1)
    assert half["ds_config"]["zero_optimization"]["offload_optimizer"] == {
        "device": "cpu",
        "pin_memory": True,
        "ratio": 0.5,
    }
    assert any("5 of 10 sub-groups" in note for note in half["notes"])


def test_a_ratio_that_keeps_no_whole_sub_group_on_the_gpu_is_said_and_planned_as_the_full_offload(tmp_path):
    # int((1 - 0.9) * 10) is 0 in DeepSpeed's float arithmetic as in Python's.
    code, plan = _plan(
        tmp_path, "zero.overrides={zero_optimization: {sub_group_size: 500000000, offload_optimizer: {ratio: 0.9}}}"
    )
    assert code == 0, plan
    assert PARTIAL_OFFLOAD_TERM not in plan["breakdown"]["gpu"]
    assert any("no sub-group stays on the GPU" in note for note in plan["notes"])


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ("{zero_optimization: {offload_optimizer: {ratio: 1.5}}}", "offload_optimizer.ratio is 1.5"),
        ("{zero_optimization: {offload_optimizer: {ratio: half}}}", "offload_optimizer.ratio is 'half'"),
        ("{zero_optimization: {sub_group_size: 5e8, offload_optimizer: {ratio: 0.5}}}", "YAML reads 5e8"),
    ],
)
def test_a_ratio_or_sub_group_size_deepspeed_would_refuse_names_the_override(tmp_path, overrides, said):
    code, output = _plan(tmp_path, f"zero.overrides={overrides}")
    assert code == 2
    assert f"--set zero.overrides={overrides}" in output and said in output


def test_the_ratios_tried_keep_as_many_sub_groups_as_deepspeed_would():
    from orchestrator.planning.speed.partialchoice import options

    shard = 4_724_000_000  # the 18-layer shape on one GPU: 10 sub-groups of 5e8
    tried = options(shard)
    kept = [p.groups_on_gpu(shard)[0] for p in tried]
    # DeepSpeed's int((1 - ratio) * 10) in floats: 0.8 keeps 1 (1.9999999999999996), 0.9 keeps none (not tried),
    # so no ratio of 0.1 to 0.9 keeps 2.
    assert kept == [9, 8, 7, 6, 5, 4, 3, 1]
    assert [p.ratio for p in tried] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    assert options(400_000_000) == []  # one sub-group: kept whole or not at all


def test_a_forced_whole_offload_names_the_faster_partial_offload_and_its_prediction_holds(tmp_path):
    """The plan's note gives the ``--set`` of the fastest partial offload that fits; planned with it, the job
    fits and predicts what the note said. A host AdamW of 2.5 G params/s (what one H100 node's preflight once read):
    the host's step is long, and a partial offload predicted more than MIN_GAIN faster."""
    import re

    code, whole = _plan(tmp_path, host_adam_rate="2.5")
    assert code == 0, whole
    note = next(n for n in whole["step_time"]["notes"] if n.startswith("a partial optimizer offload fits"))
    override = re.search(r"--set '(zero\.overrides=[^']+)'", note)[1]
    predicted = float(re.search(r": ([\d,]+) tokens/s/GPU against", note)[1].replace(",", ""))
    code, partial = _plan(tmp_path, override, host_adam_rate="2.5")
    assert code == 0, partial
    assert partial["fits"] is True
    assert partial["step_time"]["tokens_per_s_per_gpu"] == pytest.approx(predicted, abs=1)
    assert predicted > whole["step_time"]["tokens_per_s_per_gpu"] * (1 + MIN_GAIN)
    # Asked for, it is planned, not suggested again.
    assert not any(n.startswith("a partial optimizer offload fits") for n in partial["step_time"]["notes"])


def test_no_partial_offload_is_suggested_within_the_models_measured_error(tmp_path):
    """At 5 G params/s the best ratio is predicted +11.7 %: within the +14.1 % the step model erred by on a
    measured partial offload (ratio 0.4 on one H100, measured 2.4 % slower than the whole offload). Failed
    before: the note named it from +3 %."""
    code, whole = _plan(tmp_path)
    assert code == 0, whole
    assert whole["zero"]["offload_optimizer"] is True
    assert not any(n.startswith("a partial optimizer offload fits") for n in whole["step_time"]["notes"])


def test_no_partial_offload_is_suggested_over_the_users_own_ratio(tmp_path):
    code, users = _plan(
        tmp_path, "zero.overrides={zero_optimization: {sub_group_size: 500000000, offload_optimizer: {ratio: 0.7}}}"
    )
    assert code == 0, users
    assert not any("partial optimizer offload fits" in n for n in users["step_time"]["notes"])
