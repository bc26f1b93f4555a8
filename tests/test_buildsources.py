"""Package sources: pip's and apt's configuration read from the machine, never named in the repo.

Pure parsers are tested on recorded shapes; the reader of pip's configuration runs the real pip
with a configuration file written here (``PIP_CONFIG_FILE``); the registry-host check greps the
repository for the hosts this machine's own configuration names.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

from orchestrator.image.build import TORCH_VERSION, BuildRequest, build_args, plan_inputs
from orchestrator.image.sources import (
    AptSource,
    PipSources,
    apt_mirror_for,
    local_torch_wheels,
    parse_apt_sources,
    parse_pip_config,
    read_apt_sources,
    read_pip_config,
    torch_wheel_flavour,
)

ROOT = Path(__file__).resolve().parent.parent
V = TORCH_VERSION

# -- pip --------------------------------------------------------------------------------------------


def test_pip_config_listing_precedence_and_lists():
    # `pip config list` as printed on a machine like this one (paths made up), plus an install section.
    listing = "\n".join(
        [
            "global.cert='/etc/ssl/proxy.pem'",
            "global.extra-index-url='file:///srv/pypi/simple https://mirror.invalid/simple'",
            "global.find-links='/srv/wheels'",
            "global.index-url='https://global.invalid/simple'",
            "install.index-url='https://install.invalid/simple'",
            ":env:.find-links='/env/wheels /env/more'",
            ":env:.trusted-host='mirror.invalid'",
        ]
    )
    sources = parse_pip_config(listing)
    assert sources.index_url == "https://install.invalid/simple"  # install section beats global
    assert sources.find_links == ("/env/wheels", "/env/more")  # PIP_FIND_LINKS beats the files
    assert sources.extra_index_urls == ("file:///srv/pypi/simple", "https://mirror.invalid/simple")
    assert sources.trusted_hosts == ("mirror.invalid",)
    assert sources.cert == "/etc/ssl/proxy.pem"
    assert sources.remote(sources.indexes) == ("https://install.invalid/simple", "https://mirror.invalid/simple")
    assert sources.local(sources.extra_index_urls) == (Path("/srv/pypi/simple"),)


def test_read_pip_config_runs_the_real_pip(tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nfind-links = /somewhere/wheels\nindex-url = https://index.invalid/simple\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = str(config)
    code = (
        "from orchestrator.image.sources import read_pip_config; s = read_pip_config();"
        "print(s.index_url, ' '.join(s.find_links))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == ["https://index.invalid/simple", "/somewhere/wheels"]


def test_torch_wheel_flavours():
    assert torch_wheel_flavour(f"torch-{V}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", V) == "cpu"
    assert torch_wheel_flavour(f"torch-{V}+cu130-cp312-cp312-manylinux_2_28_x86_64.whl", V) == "cuda"
    # PyPI's Linux wheel carries no label and is a CUDA build.
    assert torch_wheel_flavour(f"torch-{V}-cp312-cp312-manylinux_2_28_x86_64.whl", V) == "cuda"
    assert torch_wheel_flavour(f"torch-{V}-cp312-none-macosx_11_0_arm64.whl", V) is None
    assert torch_wheel_flavour("torch-2.0.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", V) is None
    assert torch_wheel_flavour(f"torch-{V}+rocm7.0-cp311-cp311-manylinux_2_28_x86_64.whl", V) is None


def fake_wheel(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"not really a wheel")
    return folder / name


def test_local_torch_wheels_from_find_links_and_file_index(tmp_path):
    cpu = fake_wheel(tmp_path / "links", f"torch-{V}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    fake_wheel(tmp_path / "links", f"torch-{V}-cp311-cp311-macosx_11_0_arm64.whl")
    # A PEP 503 index on disk, as `file://` index URLs point at: files linked from simple/torch/.
    cuda = fake_wheel(tmp_path / "pypi" / "files", f"torch-{V}+cu130-cp311-cp311-manylinux_2_28_x86_64.whl")
    page = tmp_path / "pypi" / "simple" / "torch"
    page.mkdir(parents=True)
    href = urllib.parse.quote(f"../../files/{cuda.name}")
    page.joinpath("index.html").write_text(f'<html><body><a href="{href}#sha256=00">{cuda.name}</a></body></html>')
    sources = PipSources(find_links=(str(tmp_path / "links"),), extra_index_urls=((tmp_path / "pypi/simple").as_uri(),))
    assert local_torch_wheels(sources, V, "cpu") == [cpu]
    assert [w.resolve() for w in local_torch_wheels(sources, V, "cuda")] == [cuda.resolve()]
    assert local_torch_wheels(PipSources(find_links=("https://x.invalid/links",)), V, "cpu") == []


def test_plan_inputs_brings_the_flavours_torch_and_pips_cert(tmp_path):
    cpu = fake_wheel(tmp_path / "links", f"torch-{V}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    cert = tmp_path / "proxy.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    sources = PipSources(find_links=(str(tmp_path / "links"),), cert=str(cert))
    for_cpu = plan_inputs(BuildRequest(flavour="cpu", pip_sources=sources))
    assert for_cpu.wheels == (cpu,) and for_cpu.ca_bundle == cert
    assert any(cpu.name in note and str(cpu.parent) in note for note in for_cpu.notes)
    # The cuda flavour never gets the CPU wheel: its build looks elsewhere and says so.
    for_cuda = plan_inputs(BuildRequest(flavour="cuda", pip_sources=sources))
    assert for_cuda.wheels == ()
    assert any("no cuda torch" in note for note in for_cuda.notes)
    # An explicit --ca-bundle wins over pip's cert.
    other = tmp_path / "other.pem"
    other.write_text("x")
    assert plan_inputs(BuildRequest(flavour="cpu", pip_sources=sources, ca_bundle=other)).ca_bundle == other


def test_remote_sources_become_build_args_local_ones_do_not():
    sources = PipSources(
        index_url="https://index.invalid/simple",
        extra_index_urls=("file:///srv/pypi/simple", "https://extra.invalid/simple"),
        find_links=("/srv/wheels", "https://links.invalid/"),
        trusted_hosts=("index.invalid",),
    )
    args = build_args(BuildRequest(flavour="cpu", pip_sources=sources, torch_index_url="https://torch.invalid/cpu"))
    assert args["DZCTL_PIP_INDEX_URL"] == "https://index.invalid/simple"
    assert args["DZCTL_PIP_EXTRA_INDEX_URL"] == "https://extra.invalid/simple"
    assert args["DZCTL_PIP_FIND_LINKS"] == "https://links.invalid/"
    assert args["DZCTL_PIP_TRUSTED_HOST"] == "index.invalid"
    assert args["TORCH_INDEX_URL"] == "https://torch.invalid/cpu"
    assert args["DZCTL_FLAVOUR"] == "cpu" and args["TORCH_VERSION"] == V


# -- apt --------------------------------------------------------------------------------------------


def test_apt_sources_both_formats():
    one_line = (
        "# a comment\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.invalid/debian bookworm main contrib\n"
        "deb-src http://mirror.invalid/debian bookworm main\n"
        "deb http://mirror.invalid/debian-security bookworm-security main\n"
    )
    assert parse_apt_sources("sources.list", one_line) == [
        AptSource("http://mirror.invalid/debian", ("bookworm",), ("main", "contrib")),
        AptSource("http://mirror.invalid/debian-security", ("bookworm-security",), ("main",)),
    ]
    deb822 = (
        "Types: deb\n# http://snapshot.invalid/\nURIs: http://a.invalid/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://b.invalid/debian\nSuites: bookworm\nEnabled: no\n"
    )
    found = parse_apt_sources("debian.sources", deb822)
    assert found == [AptSource("http://a.invalid/debian", ("bookworm", "bookworm-updates"), ("main",))]
    assert apt_mirror_for("bookworm", found) == "http://a.invalid/debian"
    assert apt_mirror_for("trixie", found) is None


def test_read_apt_sources_skips_files_apt_does_not_read(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "main.sources").write_text(
        "Types: deb\nURIs: http://a.invalid/debian\nSuites: bookworm\nComponents: main\n"
    )
    (tmp_path / "sources.list.d" / "old.list.disabled").write_text("deb http://z.invalid/debian bookworm main\n")
    assert [s.uri for s in read_apt_sources(tmp_path)] == ["http://a.invalid/debian"]


# -- no registry host in the repository --------------------------------------------------------------


def configured_hosts() -> set[str]:
    """Registry hosts this machine's configuration names: apt's sources, pip's sources, pip's default index."""
    urls = [source.uri for source in read_apt_sources()]
    sources = read_pip_config()
    urls += [*sources.remote(sources.indexes), *sources.remote(sources.find_links)]
    # pip's built-in default index, as pip itself documents it (so this file names no host).
    helped = subprocess.run([sys.executable, "-m", "pip", "download", "--help"], capture_output=True, text=True)
    urls += re.findall(r"\(default\s+(https?://\S+?)\)", helped.stdout)
    return {urllib.parse.urlsplit(url).hostname for url in urls if urllib.parse.urlsplit(url).hostname}


def test_no_configured_registry_host_is_named_in_the_repo():
    hosts = configured_hosts()
    assert hosts, "found no configured registry host to look for (apt sources, pip config, pip's default)"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = []
    for rel in files:
        path = ROOT / rel
        if not path.is_file() or path.suffix in (".whl", ".png", ".gz"):
            continue
        text = path.read_text(errors="replace")
        named += [f"{rel}: {host}" for host in hosts if host in text]
    assert not named, (
        "registry hosts named in the repository (read the machine's configuration instead):\n" + "\n".join(named)
    )
