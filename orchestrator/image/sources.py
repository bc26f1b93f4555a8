"""Where packages come from: pip's and apt's configured sources, read from this machine.

dzctl names no package registry of its own (a user behind a mirror or a proxy, or an air-gapped
cluster, has configured one already). ``dzctl build`` hands the build what pip is configured with:
- remote sources (``http(s)://`` index URLs, find-links pages) go in as build args;
- local ones (a find-links folder, a ``file://`` index) cannot be seen from inside the build, so
  the torch wheels they hold for the flavour are copied into the build context's wheelhouse;
- pip's CA bundle (``cert``) is trusted during the build, as ``--ca-bundle`` would be.
apt's configured sources give the Debian mirror for the test base image (tests/baseimage.py).

Pure parsers (``parse_pip_config``, ``parse_apt_sources``, ``torch_wheel_flavour``) are apart from the
few functions that read files or run ``pip config list``.
"""

from __future__ import annotations

import html.parser
import re
import shlex
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

# pip's precedence, highest first: environment (PIP_*), then the command's own section, then global.
_SECTION_ORDER = (":env:", "install", "download", "global")
_MULTI = ("extra-index-url", "find-links", "trusted-host")


@dataclass(frozen=True)
class PipSources:
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    trusted_hosts: tuple[str, ...] = ()
    cert: str | None = None

    @property
    def indexes(self) -> tuple[str, ...]:
        return ((self.index_url,) if self.index_url else ()) + self.extra_index_urls

    def remote(self, urls: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(url for url in urls if is_remote(url))

    def local(self, urls: tuple[str, ...]) -> tuple[Path, ...]:
        return tuple(local_path(url) for url in urls if not is_remote(url))


def is_remote(location: str) -> bool:
    return urllib.parse.urlsplit(location).scheme in ("http", "https")


def local_path(location: str) -> Path:
    parts = urllib.parse.urlsplit(location)
    if parts.scheme == "file":
        return Path(urllib.parse.unquote(parts.path))
    return Path(location)


def parse_pip_config(listing: str) -> PipSources:
    """``pip config list`` output (``section.key='value'`` lines) to the sources pip install uses (pure)."""
    values: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        match = re.match(r"^([^.=]*)\.([\w-]+)=(.*)$", line.strip())
        if not match:
            continue
        section, key, raw = match.groups()
        try:
            value = " ".join(shlex.split(raw))
        except ValueError:
            value = raw.strip("'\"")
        values.setdefault(key, {})[section] = value

    def pick(key: str) -> str | None:
        for section in _SECTION_ORDER:
            if section in values.get(key, {}):
                return values[key][section]
        return None

    def many(key: str) -> tuple[str, ...]:
        return tuple((pick(key) or "").split())

    return PipSources(
        index_url=pick("index-url"),
        extra_index_urls=many("extra-index-url"),
        find_links=many("find-links"),
        trusted_hosts=many("trusted-host"),
        cert=pick("cert"),
    )


def read_pip_config(python: str | None = None) -> PipSources:
    """This machine's pip configuration (files and ``PIP_*`` variables), as ``pip config list`` shows it."""
    argv = [python or sys.executable, "-m", "pip", "config", "list"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return PipSources()
    if done.returncode != 0:
        return PipSources()  # no pip here: nothing configured that the build could use
    return parse_pip_config(done.stdout)


# --- torch wheels in local sources ---------------------------------------------------------------

_TORCH_WHEEL = re.compile(r"^torch-(?P<version>[^-+]+)(?:\+(?P<local>[^-]+))?-[^-]+-[^-]+-[^-]+\.whl$")


def torch_wheel_flavour(filename: str, version: str) -> str | None:
    """``cpu`` / ``cuda`` for a torch wheel of ``version``; None for anything else (pure).

    PyTorch's own indexes label their builds (``+cpu``, ``+cu130``); PyPI's Linux wheel carries no
    label and is a CUDA build. macOS and Windows wheels are neither here.
    """
    match = _TORCH_WHEEL.match(filename)
    if not match or match["version"] != version or "linux" not in filename:
        return None
    local = match["local"] or ""
    if local == "cpu":
        return "cpu"
    if local.startswith("cu") or not local:
        return "cuda"
    return None


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "a":
            self.hrefs.extend(value for name, value in attrs if name == "href" and value)


def _files_in_local_index(index: Path, project: str) -> list[Path]:
    page = index / project / "index.html"
    if not page.is_file():
        return []
    parser = _Links()
    parser.feed(page.read_text(errors="replace"))
    found = []
    for href in parser.hrefs:
        target = urllib.parse.urljoin(page.as_uri(), href.split("#", 1)[0])
        if target.startswith("file:"):
            found.append(local_path(target))
    return found


def local_torch_wheels(sources: PipSources, version: str, flavour: str) -> list[Path]:
    """torch wheels of ``version`` and ``flavour`` in pip's local find-links folders and file:// indexes."""
    candidates: list[Path] = []
    for folder in sources.local(sources.find_links):
        if folder.is_dir():
            candidates.extend(sorted(folder.glob("torch-*.whl")))
        elif folder.is_file():
            candidates.append(folder)
    for index in sources.local(sources.indexes):
        candidates.extend(_files_in_local_index(index, "torch"))
    seen: dict[str, Path] = {}
    for path in candidates:
        if path.is_file() and torch_wheel_flavour(path.name, version) == flavour:
            seen.setdefault(path.name, path)
    return list(seen.values())


# --- apt -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AptSource:
    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...] = field(default=())


def parse_apt_sources(name: str, text: str) -> list[AptSource]:
    """``deb`` entries of one sources file: one-line ``.list`` or deb822 ``.sources`` (pure)."""
    found: list[AptSource] = []
    if name.endswith(".sources"):
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[:1].isspace():
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
                continue
            suites = tuple(fields.get("suites", "").split())
            components = tuple(fields.get("components", "").split())
            found.extend(AptSource(uri, suites, components) for uri in fields.get("uris", "").split())
        return found
    for line in text.splitlines():
        words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
        if len(words) >= 3 and words[0] == "deb":
            found.append(AptSource(words[1], (words[2],), tuple(words[3:])))
    return found


def read_apt_sources(root: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every enabled ``deb`` source apt is configured with (files apt itself reads, in its order)."""
    files = [root / "sources.list"] if (root / "sources.list").is_file() else []
    parts = root / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    sources: list[AptSource] = []
    for path in files:
        sources.extend(parse_apt_sources(path.name, path.read_text(errors="replace")))
    return sources


def apt_mirror_for(suite: str, sources: list[AptSource]) -> str | None:
    """The first configured mirror that serves ``suite`` itself (not -updates/-security) (pure)."""
    for source in sources:
        if suite in source.suites and "main" in (source.components or ("main",)):
            return source.uri
    return None
