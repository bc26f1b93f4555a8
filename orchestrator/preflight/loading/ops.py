"""The ``deepspeed-ops`` check: can every DeepSpeed op the plan loads be loaded where the job runs?

DeepSpeed loads an op prebuilt into its install (``DS_BUILD_*`` at install time), or JIT-builds
it at first use into ``TORCH_EXTENSIONS_DIR``. A JIT build needs, besides the builder's own
``is_compatible()`` (libaio for async_io, say), what torch's ``cpp_extension.load`` runs:
``ninja`` and the C++ compiler (``$CXX``, else ``c++``), plus ``nvcc`` for an op with CUDA
sources. ``is_compatible()`` alone does not look for the compiler (DeepSpeed 0.19's CPU
builders return True), so a run without one dies at its first step with ``Error building
extension``. An op built once into the extensions folder loads again without any of them.

Which ops a plan loads (DeepSpeed 0.19, with the configs ``planning/dsconfig.py`` writes):

- ``deepspeed_shm_comm`` (``ShareMemCommBuilder``): every run on the CPU accelerator; DeepSpeed's
  CPU collectives build it when the process group starts.
- ``cpu_adam`` (``CPUAdamBuilder``): optimizer offload (``zero.offload`` optimizer, all or nvme):
  the ds_config's AdamW then runs as ``DeepSpeedCPUAdam`` on the host, on GPU nodes too (the CUDA
  accelerator shares the CPU builder). Parameter offload alone keeps the optimizer on the GPU.
- ``async_io`` (``AsyncIOBuilder``): offload to NVMe (``zero.nvme_path``), swapping through libaio.

A GPU plan without offload loads none: the optimizer is torch's fused AdamW (no ``optimizer``
section in the ds_config), not DeepSpeed's FusedAdam. A user ``zero.config`` naming another
DeepSpeed optimizer is not followed here.

With ``zero.offload: auto`` preflight does not know yet whether the planner will offload: an op
only that choice would need is a warning then, and ``require_ops`` refuses the launch once the
memory plan is made, before anything starts.
"""

from __future__ import annotations

from ...errors import RuntimeFailure
from ...planning.dsconfig import offload_of
from ..model import Check, fail, ok, warn

SHM_COMM = "ShareMemCommBuilder"
CPU_ADAM = "CPUAdamBuilder"
ASYNC_IO = "AsyncIOBuilder"
WHY = {
    SHM_COMM: "DeepSpeed's CPU collectives",
    CPU_ADAM: "optimizer offload",
    ASYNC_IO: "offload to NVMe",
}
BUILD_FIX = (
    "install a C++ compiler and ninja where the job runs (the image: dzctl build installs g++; "
    "runtime process: the node, e.g. apt-get install g++ ninja-build), or prebuild the ops into DeepSpeed "
    "(DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 pip install deepspeed)"
)
CUDA_FIX = "build the image on a CUDA devel base, which has nvcc (dzctl build --flavour cuda with its default base)"


def ops_for(accelerator: str, offload_optimizer: bool, nvme: bool) -> list[str]:
    """The op builders a plan loads (pure)."""
    ops = [SHM_COMM] if accelerator == "cpu" else []
    if offload_optimizer:
        ops.append(CPU_ADAM)
    if nvme:
        ops.append(ASYNC_IO)
    return ops


def ops_to_probe(accelerator: str, offload_optimizer: bool | None, nvme: bool) -> tuple[list[str], list[str]]:
    """(ops the plan surely loads, ops only an offload the planner may still choose loads).

    ``offload_optimizer`` None: ``zero.offload: auto``, decided after preflight."""
    sure = ops_for(accelerator, bool(offload_optimizer), nvme)
    maybe = [CPU_ADAM] if offload_optimizer is None and CPU_ADAM not in sure else []
    return sure, maybe


def _name(builder: str, answer: dict) -> str:
    return f"{answer.get('op', builder)} ({WHY.get(builder, builder)})"


def _fix_for(problems: dict[str, dict]) -> str:
    nvcc = any("nvcc" in reason for answer in problems.values() for reason in answer.get("missing", []))
    return f"{BUILD_FIX}; {CUDA_FIX}" if nvcc else BUILD_FIX


def problems_of(answers: dict, builders: list[str]) -> dict[str, dict]:
    """The ops of ``builders`` that cannot be loaded, by the probe's answers (an op it did not answer for too)."""
    found = {}
    for builder in builders:
        answer = answers.get(builder) or {"missing": ["the Python probe gave no answer for it"]}
        if answer.get("missing"):
            found[builder] = answer
    return found


def describe(problems: dict[str, dict]) -> str:
    return "; ".join(
        f"{_name(b, a)} is not prebuilt and cannot be JIT-built: {', '.join(a['missing'])}" for b, a in problems.items()
    )


def ops_check(env: dict, sure: list[str], maybe: list[str], where: str) -> Check | None:
    """Judge the probe's answers (``env["ops"]``) for one node; None when the plan loads no op."""
    if not sure and not maybe:
        return None
    if "ops" not in env:
        detail = env.get("ops_error") or "the Python probe did not answer about DeepSpeed's ops"
        return fail("deepspeed-ops", f"{where}: {detail}", BUILD_FIX)
    answers = env["ops"]
    broken = problems_of(answers, sure)
    if broken:
        detail = f"{where}: {describe(broken)}; the run would die at its first step"
        return fail("deepspeed-ops", detail, _fix_for(broken))
    unsure = problems_of(answers, maybe)
    if unsure:
        return warn(
            "deepspeed-ops",
            f"{where}: {describe(unsure)}; zero.offload is auto, and launch refuses a plan that offloads the optimizer",
            f"{_fix_for(unsure)}; or set zero.offload: none",
        )
    how = {"prebuilt": "prebuilt", "built": "built earlier in {dir}", "jit": "JIT-buildable ({tools})"}
    parts = [
        f"{answers[b].get('op', b)} {how[answers[b]['how']].format(**answers[b])}"
        for b in sure + maybe
        if answers.get(b, {}).get("how") in how
    ]
    return ok("deepspeed-ops", f"{where}: " + ", ".join(parts))


def _on_nvme(ds_config: dict) -> bool:
    zero = ds_config.get("zero_optimization") or {}
    return any(isinstance(s, dict) and s.get("device") == "nvme" for s in zero.values())


def require_ops(report, ds_config: dict, accelerator: str) -> None:
    """After the memory plan: every node can load the ops the chosen DeepSpeed config loads, or nothing starts."""
    offload_optimizer, _ = offload_of(ds_config)
    needed = ops_for(accelerator, offload_optimizer, _on_nvme(ds_config))
    found = {host: broken for host, answers in report.deepspeed_ops.items() if (broken := problems_of(answers, needed))}
    if found:
        listed = "; ".join(f"{host}: {describe(broken)}" for host, broken in found.items())
        raise RuntimeFailure(
            f"the memory plan's DeepSpeed config loads ops these nodes cannot load: {listed}; nothing was started",
            fix=f"{_fix_for(next(iter(found.values())))}; or set zero.offload: none if the model fits without it",
        )
