"""Under DZCTL_REQUIRE_INTEGRATION=1 (CI) no test may skip: a skip there is coverage silently lost.

Runs a real pytest on a small file that skips in each way pytest offers, with this
suite's conftest loaded as a plugin, with and without the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SKIPPING = """
import pytest

@pytest.mark.skipif(True, reason="tool missing")
def test_marked():
    pass

def test_inside():
    pytest.skip("nothing to try")

def test_importorskip():
    pytest.importorskip("no_such_module_dzctl")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_plain():
    pass
"""

MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_module_dzctl")

def test_never_collected():
    pass
"""


def _pytest(folder: Path, require: bool, name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DZCTL_REQUIRE_INTEGRATION"}
    if require:
        env["DZCTL_REQUIRE_INTEGRATION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-q", "-rA", "--rootdir", str(folder), name],
        capture_output=True, text=True, timeout=300, env=env, cwd=folder,
    )  # fmt: skip


def _write(tmp_path: Path) -> None:
    (tmp_path / "test_skipping.py").write_text(SKIPPING, encoding="utf-8")
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP, encoding="utf-8")


def test_skips_are_failures_when_integration_is_required(tmp_path):
    _write(tmp_path)
    done = _pytest(tmp_path, require=True, name="test_skipping.py")
    out = done.stdout
    assert done.returncode == 1, out
    for name in ("test_marked", "test_inside", "test_importorskip"):
        # A skipif acts in setup, so it reads as an error; a skip in the body, as a failure.
        assert f"FAILED test_skipping.py::{name}" in out or f"ERROR test_skipping.py::{name}" in out, out
    assert "DZCTL_REQUIRE_INTEGRATION=1 allows no skip: " in out and "tool missing" in out, out
    assert "PASSED test_skipping.py::test_plain" in out and "XFAIL test_skipping.py::test_expected_failure" in out
    assert "skipped" not in out.splitlines()[-1], out

    module = _pytest(tmp_path, require=True, name="test_module_skip.py")
    assert module.returncode != 0 and "ERROR test_module_skip.py" in module.stdout, module.stdout
    assert "skipped" not in module.stdout.splitlines()[-1], module.stdout


def test_skips_stay_skips_otherwise(tmp_path):
    _write(tmp_path)
    for name, skipped in (("test_skipping.py", "3 skipped"), ("test_module_skip.py", "1 skipped")):
        done = _pytest(tmp_path, require=False, name=name)
        # 5: nothing collected, which is what a module-level skip leaves.
        assert done.returncode in (0, 5) and skipped in done.stdout.splitlines()[-1], done.stdout
