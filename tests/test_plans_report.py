"""benchmarks/plans_report.py rebuilds a tune that its time limit cut as ``dzctl tune`` measured it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
CUT_TUNE = ROOT / "benchmarks" / "results" / "plans-h100x1-20261208" / "tune-off"  # --steps 3 --warmup 1, cut in c4
MEASURED = re.compile(r"tune: candidate (\d+): ([\d,.]+) tokens/s per rank")


def test_a_cut_tunes_candidates_are_the_medians_dzctl_tune_printed_after_its_own_warmup():
    """Failed before: the rebuild left out dzctl tune's default 2 warm-up steps, not the tune's --warmup 1, so it
    read 11,142.7 tokens/s (step 3 alone) where the tune had printed 11,080.1 (the median of steps 2 and 3)."""
    from plans_report import tune_from_progress

    runs = (CUT_TUNE / "runs.log").read_text(encoding="utf-8")
    printed = {int(rank): float(rate.replace(",", "")) for rank, rate in MEASURED.findall(runs)}
    assert sorted(printed) == [1, 2, 3]  # the fourth was cut before its first step
    rebuilt = {c["model_rank"]: c["tokens_per_s"] for c in tune_from_progress(CUT_TUNE)["candidates"]}
    assert {rank: rebuilt[rank] for rank in printed} == printed
    assert rebuilt[4] is None
