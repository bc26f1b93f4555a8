"""Security promises that need no test hosts: secrets stay out of plans and output, containers stay unprivileged.

Issue 8: secrets (``launch.env`` names matching TOKEN|SECRET|PASSWORD|KEY, and
every value in ``launch.env_file``) never appear in argv (what ``ps`` shows on
a node), in ``dzctl launch --dry-run`` output (plain or ``--json``), in error
messages, or in the job files other than the 0600 ``env`` file; and the
containers dzctl starts are not privileged. Secret values are generated, hostile
characters included, and looked for in every form they could take in output
(raw, JSON-escaped, shell-quoted).
"""

from __future__ import annotations

import itertools
import json
import shlex
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.backends.jobfiles import SECRET_MODE, job_files
from orchestrator.backends.launcher import memory_choice
from orchestrator.planning.inputs import read_inputs
from orchestrator.planning.launchplan import MASK, make_plan
from orchestrator.planning.resolve import resolve_job
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job

REPO = Path(__file__).resolve().parent.parent
TINY_JOB = yaml.safe_load((REPO / "jobs" / "tiny-cpu.yaml").read_text(encoding="utf-8"))
HOSTS = "gpu-node-1 slots=4\ngpu-node-2 slots=4\n"

SETTINGS = settings(
    max_examples=25,
    deadline=None,  # each example writes files and runs the CLI in-process
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# A marker makes every secret long and unique, so "not in output" cannot pass by
# accident and cannot fail because a short value happens to occur in a path.
secret_values = st.builds(
    lambda middle: f"Zx9-{middle}-q7",
    st.lists(
        st.one_of(
            st.sampled_from(["$(id)", "`id`", ";", "'", '"', "\\", " ", "${HOME}", "&&", "|", "=", "#", "密钥", "ñ"]),
            st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=6),
        ),
        min_size=1,
        max_size=6,
    ).map("".join),
)


def forms(secret: str) -> list[str]:
    """Every way a value could show up in output: raw, JSON-escaped, shell-quoted, repr."""
    return list(dict.fromkeys([secret, json.dumps(secret)[1:-1], shlex.quote(secret), repr(secret)[1:-1]]))


def assert_no_secret(text: str, secrets: dict[str, str], where: str) -> None:
    for name, value in secrets.items():
        for form in forms(value):
            assert form not in text, f"secret {name} appears in {where}: {form!r}"


def write_job(folder: Path, env: dict[str, str], env_file: dict[str, str] | None, **extra) -> Path:
    data = json.loads(json.dumps(TINY_JOB))  # deep copy
    data.update(runtime="docker", accelerator="gpu", image="dzctl:cuda")
    data["launch"]["env"] = {**data["launch"].get("env", {}), **env}
    if env_file is not None:
        (folder / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in env_file.items()), encoding="utf-8")
        data["launch"]["env_file"] = "secrets.env"
    for dotted, value in extra.items():
        node = data
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    (folder / "hosts.txt").write_text(HOSTS, encoding="utf-8")
    if not Path(data["data"]["path"]).is_absolute():
        shipped = folder / data["data"]["path"]
        shipped.parent.mkdir(parents=True, exist_ok=True)
        shipped.write_text('{"instruction": "hi", "input": "", "output": "hello"}\n', encoding="utf-8")
    return job


def plan_for(job_path: Path, overrides: tuple[str, ...] = ()):
    inputs = read_inputs(load_job(job_path, overrides))
    nodes = load_nodes(job_path.parent / "hosts.txt")
    plan = make_plan(inputs.spec, nodes, "sec-20260101-0000-abcd", secret_names=inputs.secret_names)
    return inputs, nodes, plan, inputs.secrets


def _main():
    import click

    from orchestrator.cli import main

    # Commands load on first use: ask the group (which imports the module), not main.commands,
    # which stays empty until some earlier test happened to run a command.
    assert main.get_command(click.Context(main), "launch") is not None, "dzctl launch is not registered"
    return main


# ---------------------------------------------------------------------------
# Secrets
# ---------------------------------------------------------------------------


@SETTINGS
@given(token=secret_values, password=secret_values, from_file=secret_values, api_key=secret_values)
def test_secrets_stay_out_of_the_plan_argv_and_dry_run(tmp_path_factory, token, password, from_file, api_key):
    folder = tmp_path_factory.mktemp("sec")
    env = {"HF_TOKEN": token, "DB_PASSWORD": password, "HF_HOME": "/data/hf"}
    # env_file names are secret whatever they are called: that file is for secrets.
    job_path = write_job(folder, env, {"PLAIN_NAME_FROM_FILE": from_file})
    overrides = (f"launch.env.WANDB_API_KEY={api_key}",)
    secrets = {"HF_TOKEN": token, "DB_PASSWORD": password, "PLAIN_NAME_FROM_FILE": from_file, "WANDB_API_KEY": api_key}

    _, _, plan, found = plan_for(job_path, overrides)
    assert set(found) == set(secrets), "every secret-named or env_file variable is treated as secret"
    assert_no_secret(json.dumps(plan.to_dict()), secrets, "the plan")
    for node in plan.nodes:
        assert_no_secret("\0".join(node.argv), secrets, f"node {node.node_rank}'s argv")
        assert_no_secret("\0".join(node.command), secrets, f"node {node.node_rank}'s command")
        for name in secrets:
            assert node.env[name] == MASK, f"{name} shown as {node.env[name]!r}, not {MASK}"
        # The ranks still get the secrets: through the env file named in argv.
        assert "--env-file" in node.argv
        assert node.argv[node.argv.index("--env-file") + 1] == f"{node.job_dir}/env"
    assert plan.nodes[0].env["HF_HOME"] == "/data/hf", "non-secret variables are shown as they are"

    main = _main()
    base = ["launch", str(job_path), "--hosts", str(folder / "hosts.txt"), "--dry-run", "--gpu-mem-gib", "140"]
    base += ["--set", overrides[0]]
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 0, (result.output, result.exception)
        assert_no_secret(result.output, secrets, f"`dzctl {' '.join(base + extra)}` output")
    assert "HF_TOKEN" in result.output, "the secret's name (not its value) is listed"


@SETTINGS
@given(token=secret_values, from_file=secret_values)
def test_job_files_hold_secrets_only_in_the_0600_env_file(tmp_path_factory, token, from_file):
    folder = tmp_path_factory.mktemp("sec")
    job_path = write_job(folder, {"HF_TOKEN": token, "HF_HOME": "/data/hf"}, {"S3_CREDENTIALS": from_file})
    inputs, nodes, plan, secrets = plan_for(job_path)
    memory, ds_config = memory_choice(inputs, nodes, 140.0, None)
    resolved = resolve_job(inputs, nodes, memory, ds_config, plan, None)
    for node in plan.nodes:
        files = {f.name: f for f in job_files(resolved, node)}
        env_file = files.pop("env")
        assert env_file.mode == SECRET_MODE == 0o600
        text = env_file.content.decode("utf-8")
        assert f"HF_TOKEN={token}\n" in text and f"S3_CREDENTIALS={from_file}\n" in text
        for name, file in files.items():
            assert_no_secret(file.content.decode("utf-8", "replace"), secrets, f"job file {name}")


@pytest.mark.parametrize(
    "how",
    ["file-newline", "set-newline", "set-nul"],
)
def test_invalid_secret_values_are_not_echoed_in_errors(tmp_path, how):
    """A secret rejected by validation must not be printed in the error that rejects it."""
    secret = "Zx9-do-not-print-me-q7"
    main = _main()
    if how == "file-newline":
        job_path = write_job(tmp_path, {"HF_TOKEN": secret + "\nsecond-line"}, None)
        overrides = []
    else:
        job_path = write_job(tmp_path, {}, None)
        # A double-quoted YAML value, so the newline survives (a plain one folds to a space).
        value = f'"{secret}\\ntail"' if how == "set-newline" else f"{secret}\0tail"
        overrides = ["--set", f"launch.env.HF_TOKEN={value}"]
    result = CliRunner().invoke(
        main, ["launch", str(job_path), "--hosts", str(tmp_path / "hosts.txt"), "--dry-run", *overrides]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert "HF_TOKEN" in result.output, "the error names the variable"
    assert secret not in result.output, f"the rejected secret is echoed: {result.output!r}"


# ---------------------------------------------------------------------------
# Unprivileged containers
# ---------------------------------------------------------------------------

# Flags that give a container the host: full privileges, all or dangerous
# capabilities, no seccomp/AppArmor, the host's PID or user namespace, raw devices.
FORBIDDEN_FLAGS = (
    "--privileged",
    "--cap-add",
    "--security-opt",
    "--pid",
    "--userns",
    "--cgroupns",
    "--device-cgroup-rule",
)
# Host paths whose mount hands a container the host (docker's socket, the root, /proc, /sys, /dev).
FORBIDDEN_MOUNT_SOURCES = ("/", "/var/run/docker.sock", "/run/docker.sock", "/proc", "/sys", "/dev")


def assert_unprivileged(argv: tuple[str, ...], image: str) -> None:
    assert argv[:2] == ("docker", "run")
    # Options end at the image: split there, so values after it (the launcher's own
    # arguments) are not mistaken for docker options.
    assert image in argv, f"image {image!r} not in argv"
    options = argv[2 : argv.index(image)]
    for word in options:
        name = word.split("=", 1)[0]
        assert name not in FORBIDDEN_FLAGS, f"container started with {word}: {shlex.join(argv)}"
    for flag, value in itertools.pairwise(options):
        if flag in ("--volume", "-v", "--mount"):
            source = value.split(":", 1)[0].rstrip("/") or "/"
            assert source not in FORBIDDEN_MOUNT_SOURCES, f"host {source} mounted into the container"
        if flag == "--device":
            assert value.startswith("/dev/infiniband"), f"raw device {value} passed to the container"


@pytest.mark.parametrize("accelerator", ["gpu", "cpu"])
def test_planned_containers_are_not_privileged(tmp_path, accelerator):
    job_path = write_job(
        tmp_path, {"HF_TOKEN": "x" * 12}, None, accelerator=accelerator, launch__mounts=["/data:/data:ro"]
    )
    job, _, plan, _ = plan_for(job_path)
    assert plan.runtime == "docker" and len(plan.nodes) == 2
    for node in plan.nodes:
        assert_unprivileged(node.argv, job.spec.image)


def test_the_privilege_check_can_fail():
    argv = ("docker", "run", "--detach", "--privileged", "img", "torchrun")
    with pytest.raises(AssertionError):
        assert_unprivileged(argv, "img")
    with pytest.raises(AssertionError):
        assert_unprivileged(("docker", "run", "--cap-add=ALL", "img"), "img")
    with pytest.raises(AssertionError):
        assert_unprivileged(("docker", "run", "--volume", "/var/run/docker.sock:/s", "img"), "img")


hostile_words = st.sampled_from(
    ["--privileged", "--cap-add=ALL", "--pid=host", "-v/:/host", "$(id)", "`id`", "a b", "x;y", "--", "-e", "'", '"']
)


@SETTINGS
@given(env_value=hostile_words, mount_dir=st.sampled_from(["/data", "/data dir", "/d;rm", "/$(id)"]))
def test_hostile_spec_values_stay_values(tmp_path_factory, env_value, mount_dir):
    """Env values and mount paths land inside one argv element each: never a docker option of their own."""
    folder = tmp_path_factory.mktemp("hostile")
    job_path = write_job(folder, {"SOME_SETTING": env_value}, None, launch__mounts=[f"{mount_dir}:/mnt/x:ro"])
    job, _, plan, _ = plan_for(job_path)
    for node in plan.nodes:
        assert_unprivileged(node.argv, job.spec.image)
        assert f"SOME_SETTING={env_value}" in node.argv, "an env value is one --env element"
        assert f"{mount_dir}:/mnt/x:ro" in node.argv, "a mount is one --volume element"


@pytest.mark.parametrize("image", ["--privileged", "--cap-add=ALL", "-v/:/host"])
def test_hostile_image_cannot_inject_docker_options(tmp_path, image):
    """The image name sits where docker stops reading options; one that starts with '-' would become one.

    It must be refused at load (exit 2, naming the key) or placed where docker cannot
    read it as an option; either way no planned container gets the flag.
    """
    job_path = write_job(tmp_path, {}, None)
    main = _main()
    args = ["launch", str(job_path), "--hosts", str(tmp_path / "hosts.txt"), "--dry-run", "--json", "--set"]
    result = CliRunner().invoke(main, [*args, f"image={image}"])
    if result.exit_code == 2:
        assert "image" in result.output and "Traceback" not in result.output
        return
    assert result.exit_code == 0, (result.output, result.exception)
    plan = json.loads(result.stdout)
    for node in plan["nodes"]:
        argv = tuple(node["argv"])
        position = argv.index(image)
        assert argv[position - 1] == "--", f"image {image!r} is read by docker as an option: {shlex.join(argv)}"
