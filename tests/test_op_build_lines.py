"""The trainer says which DeepSpeed op it builds and how long it took (issue 41 item 12).

A real JIT build through DeepSpeed's own ``OpBuilder.jit_load`` (torch's cpp_extension, ninja, g++),
of the cheapest op there is: one C++ file that defines an empty Python module and includes no torch
header, so it builds in seconds where ``cpu_adam`` takes minutes. The same process then loads it
again, as the next run on the node does, from torch's extensions folder (``TORCH_EXTENSIONS_DIR``,
a fresh one here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SOURCE = """
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dzctl_tiny_op", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_dzctl_tiny_op(void) { return PyModule_Create(&module); }
"""

BUILD = """
import sys
from deepspeed.ops.op_builder.builder import OpBuilder
from orchestrator.train.environment import announce_op_builds

class TinyOpBuilder(OpBuilder):
    NAME = "dzctl_tiny_op"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return "dzctl_tiny_op"

    def sources(self):
        return [sys.argv[1]]

announce_op_builds()
announce_op_builds()  # a second call must not wrap the wrapper (one pair of lines per load)
TinyOpBuilder().jit_load(verbose=False)
print("-- next run --", flush=True)
TinyOpBuilder().jit_load(verbose=False)
"""


def test_a_jit_build_of_an_op_says_what_it_builds_and_its_seconds_then_loads_it_cached(tmp_path):
    source = tmp_path / "tiny_op.cpp"
    source.write_text(SOURCE)
    extensions = tmp_path / "extensions"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu"}
    env.pop("LOCAL_RANK", None)
    ran = subprocess.run(
        [sys.executable, "-c", BUILD, str(source)], capture_output=True, text=True, env=env, timeout=300
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = [line for line in ran.stdout.splitlines() if "dzctl_tiny_op" in line or line.startswith("--")]
    shown = "\n".join(lines) or ran.stdout + ran.stderr
    assert len(lines) == 5, shown
    folder = extensions / "dzctl_tiny_op"
    assert lines[0] == (
        f"dzctl-train: DeepSpeed op dzctl_tiny_op: building it into {folder} (a JIT build at its first use on "
        "this node with the C++ compiler: minutes for cpu_adam; later runs load it from there)"
    ), shown
    built = re.fullmatch(r"dzctl-train: DeepSpeed op dzctl_tiny_op: built in (\d+\.\d) s", lines[1])
    assert built and float(built.group(1)) > 0, shown
    assert (folder / "dzctl_tiny_op.so").exists()
    assert lines[3] == f"dzctl-train: DeepSpeed op dzctl_tiny_op: loading its cached build ({folder})", shown
    cached = re.fullmatch(
        r"dzctl-train: DeepSpeed op dzctl_tiny_op: loaded cached dzctl_tiny_op in (\d+\.\d) s", lines[4]
    )
    assert cached and float(cached.group(1)) < float(built.group(1)), shown
