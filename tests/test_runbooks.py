"""Every dzctl command the runbooks and the README tell people to type must exist.

An operator at 3 a.m. copies a command from a runbook; if the command or one
of its options was renamed, the runbook fails them when they need it most. This
test reads every fenced code block and every inline ``dzctl ...`` span in
docs/runbooks/*.md and README.md, and checks each command against the real CLI
(``orchestrator.cli.main``) by click's introspection: the subcommand is
registered, and every ``--option`` it uses is defined for that subcommand (or
for the ``dzctl`` group, before the subcommand). Placeholders such as JOB or
FILE are fine: only command and option names are checked.

The pages themselves are checked too: at least the 16 symptoms of issue 8 each
have a page with the four parts (symptom, diagnose, fix, confirm), and the
README links to the runbook index.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import get_args, get_origin

import click
import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parent.parent
RUNBOOKS = REPO / "docs" / "runbooks"
DOC_FILES = [*sorted(RUNBOOKS.glob("*.md")), REPO / "README.md"]

FENCE = re.compile(r"^(```|~~~)")
INLINE = re.compile(r"(?<!`)`(dzctl\s[^`]+)`(?!`)")
# A shell would end the dzctl command at these; what follows is another program.
SHELL_BREAK = re.compile(r"\s(?:\||\|\||&&|;|>|>>|2>|2>&1|<)\s|\s(?:\||&&|;)$")


@dataclass(frozen=True)
class DocCommand:
    path: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}: {self.text}"


def extract_commands(path: Path) -> list[DocCommand]:
    """dzctl invocations in fenced blocks (with ``$`` prompts and ``\\`` continuations) and inline spans."""
    found: list[DocCommand] = []
    in_fence = False
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(raw.strip()):
            in_fence = not in_fence
            pending = None
            continue
        if in_fence:
            line = raw.strip()
            if pending is not None:
                start, text = pending
                text += " " + line.rstrip("\\").strip()
                pending = (start, text) if line.endswith("\\") else None
                if pending is None:
                    found.append(DocCommand(path, start, text))
                continue
            line = re.sub(r"^(\$|>)\s+", "", line)  # prompts; "#" lines are comments
            if re.match(r"^(sudo\s+)?dzctl(\s|$)", line):
                line = re.sub(r"^sudo\s+", "", line)
                if line.endswith("\\"):
                    pending = (number, line.rstrip("\\").strip())
                else:
                    found.append(DocCommand(path, number, line))
            continue
        for match in INLINE.finditer(raw):
            found.append(DocCommand(path, number, match.group(1).strip()))
    return found


def tokens_of(text: str) -> list[str]:
    """The dzctl part of a shell line, split like a shell would, with doc decorations removed."""
    text = SHELL_BREAK.split(text, maxsplit=1)[0]
    words = shlex.split(text, comments=True)
    cleaned = []
    for word in words:
        # README synopses write optional parts as [--json] and repeats as ...
        word = word.strip("[]").removesuffix("...")
        if word:
            cleaned.append(word)
    return cleaned


def check_command(group: click.Group, text: str) -> list[str]:
    """Problems with one documented command line; an empty list when it is valid."""
    words = tokens_of(text)
    if not words or words[0] != "dzctl":
        return [f"not a dzctl command: {text!r}"]
    ctx = click.Context(group)
    index = 1
    # Options of the group itself (e.g. --debug) may come before the subcommand.
    while index < len(words) and words[index].startswith("-"):
        problem = _option_problem(group, words[index])
        if problem:
            return [f"dzctl: {problem}"]
        index += 1
    if index >= len(words):
        return []  # plain `dzctl` or `dzctl --help`
    name = words[index]
    command = group.get_command(ctx, name)
    if command is None:
        known = ", ".join(sorted(group.list_commands(ctx)))
        return [f"no such command 'dzctl {name}' (registered: {known})"]
    problems = []
    rest = words[index + 1 :]
    skip = False
    for word in rest:
        if skip:
            skip = False
            continue
        if word == "--":
            break
        if not word.startswith("-") or word == "-" or re.fullmatch(r"-\d+(\.\d+)?", word):
            continue  # an argument, a placeholder, or a negative number
        if re.fullmatch(r"--[\w-]+(/--[\w-]+)+", word):
            # A synopsis's on/off pair, as click's help writes it: --follow/--detach.
            problems.extend(f"dzctl {name}: {p}" for part in word.split("/") if (p := _option_problem(command, part)))
            continue
        problem = _option_problem(command, word)
        if problem:
            problems.append(f"dzctl {name}: {problem}")
            continue
        param = _find_option(command, word.split("=", 1)[0])
        if param is not None and not param.is_flag and not param.count and "=" not in word:
            skip = True  # the next word is this option's value
    if _find_option(command, "--set") is not None:
        problems.extend(f"dzctl {name}: {p}" for p in _set_problems(rest, "--set"))
    return problems


def _set_problems(rest: list[str], flag: str) -> list[str]:
    """The keys of every ``--set KEY=VALUE`` must be keys of the job spec (values may be placeholders)."""
    problems = []
    for index, word in enumerate(rest[:-1]):
        if word == flag:
            key = rest[index + 1].split("=", 1)[0]
            if key.isupper():
                continue  # the synopsis placeholder KEY=VALUE
            problem = spec_key_problem(key)
            if problem:
                problems.append(f"--set {rest[index + 1]}: {problem}")
    return problems


def spec_key_problem(dotted: str) -> str | None:
    """None when ``dotted`` names a key of the job spec (or a free-form mapping under one)."""
    from orchestrator.spec.job import JobSpec

    model: type[BaseModel] = JobSpec
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the job spec"
        if part not in model.model_fields:
            return f"{part!r} is not a key of {where} (keys: {', '.join(model.model_fields)})"
        annotation = model.model_fields[part].annotation
        sub = _model_in(annotation)
        if sub is None:
            if depth < len(parts) - 1 and not _is_mapping(annotation):
                return f"{'.'.join(parts[: depth + 1])} is a value, not a section"
            return None  # a value, or a free-form mapping (launch.env, zero.overrides, model.config)
        model = sub
    return None


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _is_mapping(annotation) -> bool:
    if annotation is dict or get_origin(annotation) is dict:
        return True
    return any(_is_mapping(arg) for arg in get_args(annotation))


def _find_option(command: click.Command, name: str) -> click.Option | None:
    for param in command.params:
        if isinstance(param, click.Option) and name in (*param.opts, *param.secondary_opts):
            return param
    if name in ("-h", "--help"):
        return click.Option(["--help"], is_flag=True)
    return None


def _option_problem(command: click.Command, word: str) -> str | None:
    name = word.split("=", 1)[0]
    if _find_option(command, name) is not None:
        return None
    if name == "--version" and any(getattr(p, "name", None) == "version" for p in command.params):
        return None
    known = sorted(o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts))
    return f"no such option {name!r} (defined: {', '.join(known) or 'none'})"


def _all_commands() -> list[DocCommand]:
    commands = []
    for path in DOC_FILES:
        if path.exists():
            commands.extend(extract_commands(path))
    return commands


ALL_COMMANDS = _all_commands()


@pytest.fixture(scope="module")
def cli_group() -> click.Group:
    from orchestrator.cli import main

    return main


def loaded_commands(group: click.Group) -> dict[str, click.Command]:
    """Every subcommand, loaded: lazy loading leaves ``group.commands`` empty until a command is used,
    so a test that read it would pass or fail depending on which tests ran before it."""
    ctx = click.Context(group)
    return {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}


@pytest.mark.parametrize("doc", ALL_COMMANDS, ids=[str(c) for c in ALL_COMMANDS])
def test_documented_command_exists_with_its_options(cli_group, doc):
    problems = check_command(cli_group, doc.text)
    assert not problems, f"{doc}\n  " + "\n  ".join(problems)


def test_the_docs_name_commands_at_all():
    # If extraction broke (or the runbooks vanished), the parametrized test above
    # would silently check nothing.
    assert len(ALL_COMMANDS) >= 40, f"only {len(ALL_COMMANDS)} dzctl commands found in {len(DOC_FILES)} files"
    used = {tokens_of(c.text)[1] for c in ALL_COMMANDS if len(tokens_of(c.text)) > 1}
    assert {"preflight", "status", "logs", "plan", "launch"} <= used, used


# ---------------------------------------------------------------------------
# The checker itself must be able to fail
# ---------------------------------------------------------------------------


def test_checker_rejects_unknown_command(cli_group):
    assert check_command(cli_group, "dzctl frobnicate JOB")


def test_checker_rejects_unknown_option(cli_group):
    name = sorted(loaded_commands(cli_group))[0]
    assert check_command(cli_group, f"dzctl {name} JOB --no-such-option-anywhere")
    assert check_command(cli_group, f"dzctl {name} JOB --no-such-option-anywhere=3")
    assert check_command(cli_group, "dzctl --no-such-global status")


def test_checker_rejects_set_keys_the_spec_does_not_have(cli_group):
    name = next(n for n, c in sorted(loaded_commands(cli_group).items()) if any("--set" in p.opts for p in c.params))
    assert check_command(cli_group, f"dzctl {name} JOB --set train.lerning_rate=1e-5")
    assert check_command(cli_group, f"dzctl {name} JOB --set train.max_steps.x=1")
    assert not check_command(cli_group, f"dzctl {name} JOB --set launch.env.ANY_NAME=1 --set zero.overrides.a.b=c")
    assert not check_command(cli_group, f"dzctl {name} JOB --set KEY=VALUE --set train.save_steps=N")


def test_checker_accepts_real_options_and_values(cli_group):
    commands = loaded_commands(cli_group)
    command = commands[sorted(commands)[0]]
    valued = next(
        (o for o in command.params if isinstance(o, click.Option) and not o.is_flag and o.opts[0].startswith("--")),
        None,
    )
    if valued is None:
        pytest.skip("no option with a value to try")
    # A value that looks like an option must be taken as the value, not checked as an option.
    text = f"dzctl --debug {command.name} JOB {valued.opts[0]} VALUE {valued.opts[0]}=X --help"
    assert check_command(cli_group, text) == []


def test_extraction_handles_prompts_continuations_pipes_and_inline(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `dzctl status JOB --json` first.\n"
        "```console\n"
        "$ dzctl logs JOB --rank 3 \\\n"
        "    --tail 200 | grep -i nccl\n"
        "dzctl launch JOB --hosts FILE  # comment --not-an-option\n"
        "nvidia-smi\n"
        "```\n"
        "Not a command: ``dzctl`` alone, or `kubectl get pods`.\n",
        encoding="utf-8",
    )
    got = [(c.line, tokens_of(c.text)) for c in extract_commands(page)]
    assert got == [
        (1, ["dzctl", "status", "JOB", "--json"]),
        (3, ["dzctl", "logs", "JOB", "--rank", "3", "--tail", "200"]),
        (5, ["dzctl", "launch", "JOB", "--hosts", "FILE"]),
    ]


# ---------------------------------------------------------------------------
# The pages
# ---------------------------------------------------------------------------

# Issue 8's list: each symptom needs a page. Keyed by a phrase the page's text must hold.
REQUIRED_SYMPTOMS = {
    "watchdog": "Watchdog caught collective operation timeout",
    "wrong interface": "socketStartConnect",
    "ib unused": "NET/IB : No device found",
    "toolkit missing": 'could not select device driver "" with capabilities: [[gpu]]',
    "toolkit init": "nvidia-container-cli: initialization error",
    "driver too old": "CUDA driver version is insufficient",
    "nvml lost": "Failed to initialize NVML: Unknown Error",
    "shm": "/dev/shm",
    "memlock": "ibv_reg_mr",
    "gpu oom": "CUDA out of memory",
    "host oom": "exitcode: -9",
    "empty weights": "torch.Size([0])",
    "world size": "The checkpoint being loaded used a DP world size of",
    "loss scale": "Current loss scale already at minimum",
    "node lost": "remote process exited or there was a network error",
    "image skew": "image ID",
}
SECTIONS = ("## Symptom", "## Diagnose", "## Fix", "## Confirm")


def _pages() -> list[Path]:
    return [p for p in sorted(RUNBOOKS.glob("*.md")) if p.name != "README.md"]


def test_every_required_symptom_has_a_page():
    pages = _pages()
    assert len(pages) >= 16, f"{len(pages)} runbook pages; issue 8 lists 16 symptoms"
    texts = {p.name: p.read_text(encoding="utf-8") for p in pages}
    missing = [key for key, phrase in REQUIRED_SYMPTOMS.items() if not any(phrase in t for t in texts.values())]
    assert not missing, f"no runbook quotes the error text for: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_page_has_symptom_diagnosis_fix_and_confirmation(page):
    text = page.read_text(encoding="utf-8")
    positions = [text.find(section) for section in SECTIONS]
    assert all(pos >= 0 for pos in positions), f"{page.name} lacks one of {SECTIONS}"
    assert positions == sorted(positions), f"{page.name}: sections out of order"
    diagnose = text[positions[1] : positions[2]]
    assert "dzctl " in diagnose, f"{page.name}: the Diagnose section names no dzctl command"
    assert re.search(r"^Source", text, re.MULTILINE) or "github.com/" in text, f"{page.name} cites no source"


def test_index_links_every_page_and_readme_links_index():
    index = (RUNBOOKS / "README.md").read_text(encoding="utf-8")
    for page in _pages():
        assert f"({page.name})" in index, f"docs/runbooks/README.md does not link {page.name}"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "docs/runbooks" in readme, "README.md does not link the runbooks"


def test_reliability_table_names_tests_that_exist():
    """docs/reliability.md claims tests prove promises: each test it names must exist."""
    text = (REPO / "docs" / "reliability.md").read_text(encoding="utf-8")
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", text)
    assert len(named) >= 30, f"only {len(named)} tests named in docs/reliability.md"
    missing = []
    for file, name in sorted(set(named)):
        path = REPO / "tests" / file
        source = path.read_text(encoding="utf-8") if path.exists() else ""
        if not re.search(rf"^\s*def {name}\(", source, re.MULTILINE):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
