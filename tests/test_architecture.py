"""The import rules of docs/architecture.md, enforced on the tree (issue 32).

The rules are read from the document itself, so the document and the code cannot drift:
a package missing from its table, an import its table does not allow, an outside
package imported away from its one home, or a circle of imports fails here.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = "orchestrator"
MAX_TOP_LEVEL_MODULES = 12  # "no package's top level holds more than about 12 modules"


@dataclass
class Rules:
    may_import: dict[str, set[str]]
    only_importer: dict[str, str]  # outside package -> the one package that may import it
    never: dict[str, set[str]] = field(default_factory=dict)  # package -> outside modules it must not import


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def read_rules(doc: Path) -> Rules:
    text = doc.read_text(encoding="utf-8")
    may = {}
    for package, allowed in _table(text, "| package | may import |"):
        may[package.strip("`")] = {a.strip() for a in allowed.split(",") if a.strip()}
    only = {}
    for outside, home in _table(text, "| outside package | imported only by |"):
        for name in outside.split(","):
            only[name.strip()] = home.strip()
    never = {
        "planning": {"subprocess", "socket"},
        "spec": {"subprocess", "socket"},
        "train": {f"{PACKAGE}.{p}" for p in ("transport", "image", "preflight", "backends", "observe", "commands")},
    }
    assert "never, not even lazily: `planning` and `spec` import neither `subprocess` nor `socket`" in text
    return Rules(may, only, never)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports (a module, or the package a name comes from)
    line: int


def modules_of(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(root: Path) -> list[Import]:
    """Every import statement of the package, module-level or inside a function, resolved to absolute names."""
    modules = modules_of(root)
    out = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out += [Import(module, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    out.append(Import(module, full if full in modules else source, node.lineno))
    return out


def stage_of(module: str) -> str:
    """``orchestrator.planning.memory.search`` -> ``planning``; top-level modules are their own stage."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def violations(root: Path, rules: Rules) -> list[str]:
    found = []
    modules = modules_of(root)
    stages = {stage_of(m) for m in modules} - {PACKAGE}
    for missing in sorted(stages - set(rules.may_import)):
        found.append(f"{PACKAGE}/{missing}: a package without a row in docs/architecture.md's import table")
    for imp in imports_of(root):
        where = f"{modules[imp.module].relative_to(root)}:{imp.line}"
        mine = stage_of(imp.module)
        top = imp.target.split(".")[0]
        if top == PACKAGE:
            theirs = stage_of(imp.target)
            if theirs != mine and theirs not in rules.may_import.get(mine, set()):
                found.append(f"{where}: {mine} imports {imp.target} ({theirs} is not in {mine}'s row)")
            if any(imp.target == bad or imp.target.startswith(bad + ".") for bad in rules.never.get(mine, ())):
                found.append(f"{where}: {mine} must never import {imp.target}")
        else:
            home = rules.only_importer.get(top)
            if home is not None and home != mine:
                found.append(f"{where}: {mine} imports {top}, which only {home} may import")
            if top in rules.never.get(mine, ()):
                found.append(f"{where}: {mine} must never import {top}")
    found += [f"import cycle between modules: {' -> '.join(c)}" for c in cycles(_module_graph(root))]
    found += [f"import cycle between packages: {' -> '.join(c)}" for c in cycles(_stage_graph(root))]
    for package, count in top_level_counts(root).items():
        if count > MAX_TOP_LEVEL_MODULES:
            found.append(f"{package}/: {count} modules at its top level (more than {MAX_TOP_LEVEL_MODULES})")
    return found


def _module_graph(root: Path) -> dict[str, set[str]]:
    modules = modules_of(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports_of(root):
        # Importing a package runs its __init__.py: an edge to the package itself, unless it is an ancestor
        # of the importer (already being imported when the importer runs).
        if imp.target in modules and imp.target != imp.module and not imp.module.startswith(imp.target + "."):
            graph[imp.module].add(imp.target)
    return graph


def _stage_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports_of(root):
        mine, theirs = stage_of(imp.module), stage_of(imp.target)
        graph.setdefault(mine, set())
        if imp.target.split(".")[0] == PACKAGE and theirs not in (mine, PACKAGE):
            graph[mine].add(theirs)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append([*sorted(component), sorted(component)[0]])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def top_level_counts(root: Path) -> dict[str, int]:
    """Modules directly in each package folder (``__init__``/``__main__`` not counted)."""
    counts = {}
    for folder in [root / PACKAGE, *sorted(p.parent for p in (root / PACKAGE).rglob("__init__.py"))]:
        modules = [p for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
        counts[str(folder.relative_to(root))] = len(modules)
    return counts


def test_the_tree_keeps_every_import_rule_of_the_architecture_document():
    assert violations(ROOT, read_rules(DOC)) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


BROKEN = {
    "paramiko": ({"planning/shape.py": "import paramiko\n"}, "planning imports paramiko, which only transport"),
    "upward": ({"planning/plan.py": "from ..transport import pool\n"}, "planning imports orchestrator.transport"),
    "lazy-subprocess": ({"spec/job.py": "def f():\n    import subprocess\n"}, "spec must never import subprocess"),
    "train-controller": (
        {"train/run.py": "from ..observe import status\n"},
        "train must never import orchestrator.observe",
    ),
    "docker": ({"train/run.py": "import docker\n"}, "train imports docker, which only image may import"),
    "module-cycle": ({"spec/a.py": "from . import b\n", "spec/b.py": "from . import a\n"}, "cycle between modules"),
    "undocumented-package": ({"newstage/x.py": ""}, "newstage: a package without a row"),
    "too-many": ({f"spec/m{i}.py": "" for i in range(13)}, "orchestrator/spec/: 13 modules at its top level"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_rule_is_reported(tmp_path, case):
    """The checker is not vacuous: each kind of break, planted in a small tree, is named."""
    files, expected = BROKEN[case]
    _write(tmp_path, {"__init__.py": "", "errors.py": "", "spec/__init__.py": "", **files})
    rules = read_rules(DOC)
    found = violations(tmp_path, rules)
    assert any(expected in line for line in found), found


def test_a_cycle_between_packages_is_reported_even_where_each_row_allows_it(tmp_path):
    _write(
        tmp_path,
        {"__init__.py": "", "spec/__init__.py": "", "spec/a.py": "from ..planning import b\n", "planning/b.py": ""},
    )
    _write(tmp_path, {"planning/c.py": "from ..spec import a\n"})
    rules = read_rules(DOC)
    rules.may_import["spec"] = {"planning"}  # a row that allows it: the cycle is still found
    assert any("cycle between packages: planning -> spec -> planning" in v for v in violations(tmp_path, rules))


def test_the_documented_rows_form_no_cycle_themselves():
    rules = read_rules(DOC)
    graph = {p: {a for a in allowed if a in rules.may_import and a != p} for p, allowed in rules.may_import.items()}
    assert cycles(graph) == []
    assert re.search(r"`tests/test_architecture.py`", DOC.read_text(encoding="utf-8"))
