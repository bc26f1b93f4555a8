"""``dzctl build`` then ``dzctl launch jobs/…``: the image a shipped job names is one a build of its flavour tags."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator import __version__
from orchestrator.image.build import BuildRequest, add_tags, image_tags

ROOT = Path(__file__).resolve().parent.parent
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))


def flavour_of(job: dict) -> str:
    """The image flavour a job runs on: the CPU one for CPU jobs, CUDA for GPU jobs (the spec's default)."""
    return "cpu" if job.get("accelerator") == "cpu" else "cuda"


def test_a_build_tags_the_versioned_name_and_the_flavour_name():
    assert image_tags(BuildRequest(flavour="cpu")) == (f"dzctl:{__version__}-cpu", "dzctl:cpu")
    assert image_tags(BuildRequest(flavour="cuda")) == (f"dzctl:{__version__}-cuda", "dzctl:cuda")


def test_a_tag_given_is_the_only_tag():
    # The user named the image: no other name of theirs (or the shipped one) is moved.
    assert image_tags(BuildRequest(flavour="cpu", tag="team/dz:exp")) == ("team/dz:exp",)


def test_a_stage_build_does_not_take_the_name_jobs_run():
    # A --target stage is not what nodes run: `dzctl:cpu` must keep naming a finished image.
    assert image_tags(BuildRequest(flavour="cpu", target="python")) == (f"dzctl:{__version__}-cpu",)


@pytest.mark.parametrize("job_file", JOBS, ids=[p.name for p in JOBS])
def test_every_shipped_job_names_an_image_that_build_tags(job_file):
    job = yaml.safe_load(job_file.read_text())
    made = image_tags(BuildRequest(flavour=flavour_of(job)))
    assert job["image"] in made, f"{job_file.name}: image {job['image']} is not among `dzctl build`'s tags {made}"


def test_shipped_jobs_exist():
    assert len(JOBS) >= 4


@pytest.mark.integration
def test_the_extra_tags_name_the_built_image_on_a_real_daemon(local_docker_url, base_image):
    import docker

    client = docker.DockerClient(base_url=local_docker_url, version="auto")
    image = client.images.get(base_image)
    # Test-only names (the real `dzctl:cpu` on this daemon may be another checkout's image).
    names = ("dzctl-test-tags:alias-a", "dzctl-test-tags/b:alias-b")
    try:
        add_tags(client, image.id, names)
        for name in names:
            assert client.images.get(name).id == image.id
    finally:
        for name in names:
            client.images.remove(name, noprune=True)
