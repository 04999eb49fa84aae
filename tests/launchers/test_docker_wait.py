"""The docker backend notices a job's end when the engine does, not at its next status look.

Pipelines poll at each launcher's own cadence. For Docker that cadence is seconds, so that a
long job costs one status look every few seconds instead of several engine calls per 0.2 s;
this only costs nothing because the waiter blocks on the engine's ``wait`` endpoint between
looks. These tests pin both halves, against the real engine.
"""

from __future__ import annotations

import time

import pytest

from orchestrator.errors import ConfigError
from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.base import JobHandle
from tests.services import docker_image, require_docker

pytestmark = [pytest.mark.docker]


def test_wait_wakes_when_the_container_ends_not_at_the_next_look() -> None:
    require_docker()
    image = docker_image("base")
    launcher = get_launcher("docker", image=image, poll_interval=30)
    handle = launcher.submit(JobSpec(name="short", command=["sleep", "1.5"], image=image))
    try:
        looks = 0
        status = launcher.status

        def counted(h: JobHandle) -> object:
            nonlocal looks
            looks += 1
            return status(h)

        launcher.status = counted  # type: ignore[method-assign]
        start = time.monotonic()
        final = launcher.wait(handle, timeout=60)
        elapsed = time.monotonic() - start
        assert final.state is JobState.SUCCEEDED, final
        # polls back off 10, 20, 40 ... ms to 30 s: sleeping would look at ~2.6 s, then at ~5 s
        assert elapsed < 2.5, f"wait returned {elapsed:.2f}s after submit: it slept to the next look"
        assert looks < 15, f"{looks} status looks for a 1.5 s job"
    finally:
        launcher.cleanup(handle)


def test_a_container_that_never_started_does_not_make_the_waiter_spin() -> None:
    """The engine reports a created-but-not-started container as not running at once; after
    that answer, pauses sleep their full length instead of returning immediately."""
    client = require_docker()
    image = docker_image("base")
    container = client.containers.create(image, ["true"], labels={"openlab.io/managed": "1"})
    try:
        launcher = get_launcher("docker", image=image)
        handle = JobHandle(backend="docker", job_id=container.id)
        launcher.pause(handle, 0.3)  # the engine answers at once
        start = time.monotonic()
        launcher.pause(handle, 0.3)
        assert time.monotonic() - start >= 0.29
        assert launcher.status(handle).state is JobState.PENDING
    finally:
        container.remove(force=True)


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_poll_interval_must_be_positive_seconds(value: str) -> None:
    with pytest.raises(ConfigError, match=r"\[backends.docker\] poll_interval must be a positive number"):
        get_launcher("docker", poll_interval=value)
