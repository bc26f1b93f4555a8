"""Load YAML while remembering the line of every key, so errors can say ``file:line``.

PyYAML's ``safe_load`` forgets where values came from and silently keeps the
last of two equal keys. We compose the node tree once to record lines and
reject duplicates, then construct plain Python values from the same tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import SpecError, located

KeyPath = tuple[str | int, ...]


class LineMap:
    """Line numbers (1-based) of the keys of one YAML document, by key path."""

    def __init__(self, source: str, lines: dict[KeyPath, int]) -> None:
        self.source = source
        self._lines = lines

    def line_of(self, path: KeyPath) -> int | None:
        """The line of ``path``, or of its nearest ancestor that the file has."""
        path = tuple(path)
        while path:
            if path in self._lines:
                return self._lines[path]
            path = path[:-1]
        return self._lines.get((), None)

    def where(self, path: KeyPath) -> str:
        line = self.line_of(path)
        return f"{self.source}:{line}" if line else self.source


def load_yaml_with_lines(path: Path, *, display: str | None = None) -> tuple[Any, LineMap]:
    """Read ``path``; return its data and a LineMap. Errors are SpecErrors naming file:line."""
    source = display or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{source}: job file not found", fix="check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{source}: cannot read job file: {exc}") from None
    return parse_yaml_with_lines(text, source)


def parse_yaml_with_lines(text: str, source: str) -> tuple[Any, LineMap]:
    try:
        return _parse(text, source)
    except RecursionError:
        # PyYAML composes and constructs recursively: thousands of nested [ or
        # indented keys exhaust Python's stack. No job file nests that deep.
        raise SpecError(located(source, 1, "values nested too deeply to read")) from None


def _parse(text: str, source: str) -> tuple[Any, LineMap]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        if line is None and isinstance(exc, yaml.reader.ReaderError):
            # Bad characters (NUL, control codes) carry an offset, not a mark.
            line = text.count("\n", 0, exc.position) + 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(located(source, line, f"not valid YAML: {problem}")) from None
    if node is None:
        return None, LineMap(source, {})
    lines: dict[KeyPath, int] = {(): node.start_mark.line + 1}
    _walk(node, (), lines, source, [0], frozenset())
    try:
        data = yaml.SafeLoader(text).get_single_data()
    except yaml.YAMLError as exc:  # e.g. a bad tag that composes but does not construct
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise SpecError(located(source, line, f"not valid YAML: {exc}")) from None
    return data, LineMap(source, lines)


# Aliases make the node tree a graph: a self-referencing alias would recurse
# forever and nested aliases ("billion laughs") expand exponentially. A job file
# has a few hundred values; refuse anything that expands past this.
MAX_EXPANDED_NODES = 100_000


def _walk(
    node: yaml.Node,
    path: KeyPath,
    lines: dict[KeyPath, int],
    source: str,
    count: list[int],
    ancestors: frozenset[int],
) -> None:
    line_here = node.start_mark.line + 1
    if id(node) in ancestors:
        dotted = ".".join(str(p) for p in path)
        raise SpecError(located(source, line_here, f"{dotted}: an alias refers to a value that contains it"))
    count[0] += 1
    if count[0] > MAX_EXPANDED_NODES:
        raise SpecError(
            located(source, line_here, f"aliases expand to more than {MAX_EXPANDED_NODES} values"),
            fix="write the values out instead of nesting YAML aliases",
        )
    ancestors = ancestors | {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                dotted = ".".join(str(p) for p in (*path, key))
                raise SpecError(
                    located(source, line, f"{dotted}: duplicate key (first at line {seen[key]})"),
                    fix="keep one of the two",
                )
            seen[key] = line
            lines[(*path, key)] = line
            _walk(value_node, (*path, key), lines, source, count, ancestors)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            _walk(item, (*path, index), lines, source, count, ancestors)
