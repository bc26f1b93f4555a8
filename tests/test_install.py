"""The README's install lines, the extras they name, and what ``./dev test`` installs, kept true.

The install lines are run as written (from a copy of this checkout, as from a clone) in a
fresh venv: the controller's for real, the trainer's with ``--no-deps`` (torch and DeepSpeed
are gigabytes; that the extra exists and names them is what is checked).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from orchestrator import __version__

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def install_lines() -> list[list[str]]:
    """The ``pip install`` commands in the README's Install section, as argv (comments dropped)."""
    block = re.search(r"```\n(.*?)```", section("Install"), flags=re.S)
    assert block, "the Install section has a code block"
    lines = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    return [argv for argv in lines if argv[:2] == ["pip", "install"]]


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_install_lines_install_from_this_repository_not_an_index():
    lines = install_lines()
    assert lines, "the README says how to install"
    for argv in lines:
        target = argv[-1]
        # dzctl is not on any package index: each line installs a checkout (".", ".[train]", ...).
        assert re.fullmatch(r"\.(\[[a-z,]+\])?", target), f"`{shlex.join(argv)}` does not install this checkout"
        extras = re.findall(r"[a-z]+", target.partition("[")[2])
        assert set(extras) <= set(EXTRAS), f"`{shlex.join(argv)}` names an extra pyproject.toml lacks"


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """This checkout's files as a clone would have them (tracked and new files, nothing ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    )  # fmt: skip
    target = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.mark.slow
def test_the_install_lines_work_in_a_fresh_venv(clone, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for argv in install_lines():
        heavy = "[" in argv[-1]  # the train extra: torch and DeepSpeed are not installed here
        command = [str(venv / "bin" / "python"), "-m", *argv, *(["--no-deps"] if heavy else [])]
        done = subprocess.run(command, cwd=clone, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"`{shlex.join(argv)}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert "does not provide the extra" not in done.stderr, done.stderr
    shown = subprocess.run([str(venv / "bin" / "dzctl"), "--version"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert __version__ in shown.stdout


def test_the_train_extra_leaves_liger_and_triton_to_the_gpu_extra():
    # Liger brings Triton (about 1 GB) that CPU runs never import: CPU installs leave it out.
    assert not names(EXTRAS["train"]) & {"liger-kernel", "triton"}, EXTRAS["train"]
    assert "liger-kernel" in names(EXTRAS["gpu"])


def test_the_cuda_image_installs_the_gpu_extra_and_the_cpu_image_does_not():
    script = (ROOT / "docker" / "install-python.sh").read_text(encoding="utf-8")
    step = script[script.index("\nproject-deps)") : script.index("\n    ;;", script.index("\nproject-deps)"))]
    extras = dict(re.findall(r"^\s*(\w+)\) EXTRAS=([\w,]+) ;;", step, flags=re.M))
    assert extras == {"cuda": "train,gpu", "cpu": "train"}, step
    assert '"/opt/dzctl-meta[$EXTRAS]"' in step


def test_dev_installs_no_gpu_extra():
    dev = (ROOT / "dev").read_text(encoding="utf-8")
    installs = re.findall(r"pip install -q -e '\.\[([a-z,]+)\]'", dev)
    assert installs, "dev installs the project with extras"
    for extras in installs:
        assert "gpu" not in extras.split(","), "the CPU venv gets no Liger/Triton"


def test_readme_lists_every_debian_package_dev_test_installs():
    dev = (ROOT / "dev").read_text(encoding="utf-8")
    packages = re.search(r"^TEST_PACKAGES=\(([^)]*)\)", dev, flags=re.M).group(1).split()
    quick = section("Quick start")
    missing = [p for p in packages if f"`{p}`" not in quick]
    assert not missing, f"README's quick start does not name what `./dev test` installs: {missing}"
