"""What reaches the sbatch script from the user (issue 28, item 3): every ``slurm:`` value and the
shared job directory, from the command line or the spec, is held to one rule; a hostile value
exits 2 naming its option or key and the allowed form, and nothing of it reaches the script.

The script text is checked here (``launch --slurm --dry-run`` and ``bash -n``); how the real
sbatch reads a quoted ``--output`` path is checked on the real cluster in test_slurm.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "jobs/tiny-cpu.yaml"


def _job_copy(tmp_path: Path, extra: str) -> Path:
    """The tiny job with ``extra`` appended, in its own folder (its data file named by absolute path)."""
    job = tmp_path / "job.yaml"
    data = TINY.parent / "data/tiny-alpaca-zh.jsonl"
    job.write_text(TINY.read_text().replace("path: data/tiny-alpaca-zh.jsonl", f"path: {data}") + extra)
    return job


def _dry_run(tmp_path: Path, *args: str, job: Path = TINY) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "orchestrator", "launch", str(job), "--slurm", "--dry-run", *args]
    return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "DZCTL_HOME": str(tmp_path)})


@pytest.mark.parametrize(
    ("args", "option", "form"),
    [
        (["--partition", "gpu\ntouch PWNED"], "--partition", "a partition name"),
        (["--partition", "gpu --exclusive"], "--partition", "a partition name"),
        (["--time", "1:00:00 --exclusive"], "--time", "HOURS:MINUTES:SECONDS"),
        (["--time", "1:00:00\ntouch PWNED"], "--time", "HOURS:MINUTES:SECONDS"),
        (["--account", "ml #touch PWNED"], "--account", "an account name"),
        (["--account", "ml\ntouch PWNED"], "--account", "an account name"),
    ],
    ids=["partition-newline", "partition-blank", "time-blank", "time-newline", "account-hash", "account-newline"],
)
def test_a_hostile_slurm_option_exits_2_naming_the_option_and_its_form(tmp_path, args, option, form):
    result = _dry_run(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""  # no script printed, so no "touch PWNED" line in one
    assert f"{option} " in result.stderr and form in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    # The refused value is shown escaped: the message stays one line per problem.
    assert "\ntouch PWNED" not in result.stderr


def test_the_same_values_in_the_spec_are_refused_by_the_same_rule(tmp_path):
    job = _job_copy(tmp_path, 'slurm:\n  nodes: 1\n  time: "1:00:00 --exclusive"\n')
    result = _dry_run(tmp_path, job=job)
    assert result.returncode == 2, result.stderr
    assert f"{job}:" in result.stderr and "slurm.time" in result.stderr
    assert "HOURS:MINUTES:SECONDS" in result.stderr
    # The well-formed forms sbatch takes still pass, from either side.
    for limit in ("90", "02:00:00", "2-12", "1-00:30:00", "UNLIMITED"):
        shown = _dry_run(tmp_path, "--time", limit, "--partition", "gpu,debug", "--account", "ml-team.a")
        assert shown.returncode == 0, (limit, shown.stderr)
        assert f"#SBATCH --time={limit}\n" in shown.stdout


def test_a_line_break_in_the_job_dir_never_becomes_a_script_line(tmp_path):
    job = _job_copy(tmp_path, '  remote_dir: "/shared/x\\ntouch PWNED3 #"\n')
    result = _dry_run(tmp_path, job=job)
    assert result.returncode == 2, result.stdout
    assert "touch PWNED3" not in result.stdout
    line = next(n for n, text in enumerate(job.read_text().splitlines(), 1) if "remote_dir" in text)
    assert f"{job}:{line}: launch.remote_dir" in result.stderr, result.stderr
    assert "#SBATCH --output" in result.stderr and "\\n" in result.stderr
    for hostile in ('/shared/a"b', "/shared/a\\b", "/shared/%j"):
        refused = _dry_run(tmp_path, "--set", f"launch.remote_dir={hostile}")
        assert refused.returncode == 2, (hostile, refused.stdout)
        assert "launch.remote_dir" in refused.stderr


def test_a_blank_in_the_job_dir_is_quoted_on_the_output_line_and_the_script_parses(tmp_path):
    result = _dry_run(tmp_path, "--set", "launch.remote_dir='/shared/my runs #2'", "--nodes", "2")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    output = next(line for line in script.splitlines() if line.startswith("#SBATCH --output="))
    assert output.startswith('#SBATCH --output="/shared/my runs #2/jobs/tiny-cpu-')
    assert output.endswith('/slurm-%j.out"')
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    # Where a shell reads the path (srun's script argument, the interfaces file), it is one word.
    assert "'/shared/my runs #2/jobs/" in script


def test_the_directive_writer_refuses_what_sbatch_cannot_carry():
    from orchestrator.backends.slurm.script import directive

    assert directive("--partition", "gpu") == "#SBATCH --partition=gpu"
    assert directive("--output", "/a b/x") == '#SBATCH --output="/a b/x"'
    for value in ("gpu\ntouch PWNED", 'a"b', "a\\b", "a\tb"):
        with pytest.raises(ValueError, match="cannot be written"):
            directive("--partition", value)
