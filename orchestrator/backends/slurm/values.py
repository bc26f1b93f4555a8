"""What the user gives the batch script, checked before it is written: the ``slurm:`` keys or their
``launch --slurm`` options, and the shared job directory.

The ``#SBATCH`` lines are read by sbatch, not a shell: it splits a line at blanks,
takes quotes and an unquoted ``#`` as its own syntax, and a line break ends the
directive, so what follows it is a line of the script. A value that could change
the script's meaning is refused here (exit 2, naming the option or the spec's key
and the allowed form), from the command line and the spec alike; the script then
quotes what is left (``script.directive``).
"""

from __future__ import annotations

from pydantic import ValidationError

from ...errors import InputError, SpecError
from ...spec.job import LoadedJob, SlurmSpec, printable

# The command line's name for each slurm: key (commands/options.py::slurm_options).
OPTIONS = {
    "partition": "--partition",
    "nodes": "--nodes",
    "gpus_per_node": "--gpus-per-node",
    "time": "--time",
    "account": "--account",
}
# sbatch's own quoting ('"', '\\') and Slurm's file name patterns ('%j', and '\\' turns them all off)
# cannot be carried inside the --output path: the batch log would land where `logs` does not look.
JOB_DIR_REFUSED = '"\\%'


def checked_request_values(job: LoadedJob, given: dict) -> dict:
    """The spec's ``slurm:`` section with ``given`` (the options set, None = not given) on top,
    validated as one ``slurm:`` section: a bad option is refused by the same rule as the key."""
    section = job.spec.slurm.model_dump(exclude_unset=True) if job.spec.slurm else {}
    chosen = {k: v for k, v in given.items() if v is not None}
    try:
        return SlurmSpec.model_validate({**section, **chosen}).model_dump()
    except ValidationError as exc:
        error = exc.errors()[0]
        key = str(error["loc"][0])
        problem = error["msg"].removeprefix("Value error, ")
        shown = printable(repr(error.get("input")))
        if key in chosen and key in OPTIONS:
            raise InputError(f"{OPTIONS[key]} {shown}: {problem}", fix=f"give {OPTIONS[key]} in that form") from None
        raise SpecError(f"{job.where(f'slurm.{key}')}: slurm.{key} {shown}: {problem}") from None


def check_job_paths(job: LoadedJob) -> None:
    """The shared job directory (``launch.remote_dir``) must be one path every node sees, and one
    sbatch can carry on its ``--output`` line."""
    remote_dir = job.spec.launch.remote_dir
    if "{host}" in remote_dir or "{host}" in (job.spec.train.output_dir or ""):
        raise SpecError(
            f"{job.where('launch.remote_dir')}: with Slurm the job directory is one path every node shares; "
            "'{host}' cannot be filled in before Slurm picks the nodes",
            fix="set launch.remote_dir (and train.output_dir) to a shared path without {host}",
        )
    refused = sorted({ch for ch in remote_dir if ch in JOB_DIR_REFUSED or not ch.isprintable()})
    if refused:
        shown = " ".join(printable(ch) for ch in refused)
        raise SpecError(
            f"{job.where('launch.remote_dir')}: launch.remote_dir {printable(repr(remote_dir))}: with Slurm the "
            f"job directory is written on the batch script's #SBATCH --output line, which cannot hold {shown}",
            fix="use one line of letters, digits, blanks and / _ . - + @ = , : (a shared path on every node)",
        )


def unshared_defaults(job: LoadedJob, python: str, container: str) -> list[str]:
    """What the batch script would take from a default that need not hold on a cluster: one warning each.

    Under Slurm the job directory is read by every node and the allocation's steps run one
    Python path on each; the defaults (a node-local folder, the submitting Python) are right on
    one machine and silently wrong on most clusters. ``python``: the request's (the default's
    value, when ``slurm.python`` is not set).
    """
    warnings = []
    launch = job.spec.launch
    if "remote_dir" not in launch.model_fields_set:
        warnings.append(
            f"launch.remote_dir is not set: the batch script uses the default {launch.remote_dir}, a folder local "
            "to each node, but under Slurm the job directory must be one the submit host and every node share "
            "(set launch.remote_dir to a shared path: home, scratch, NFS)"
        )
    if container != "pyxis" and (job.spec.slurm is None or job.spec.slurm.python is None):
        # pyxis runs the image's own python3: the submitting Python is not written into the script.
        warnings.append(
            f"slurm.python is not set: the batch script runs this machine's Python, {python}, on every node; "
            "it must exist at that path there, with dzctl installed (set slurm.python to the nodes' Python)"
        )
    return warnings
