"""The docker backend notices a job's end when the engine does, not at its next status look.

Pipelines poll at each launcher's own cadence. For Docker that cadence is seconds, so that a
long job costs one status look every few seconds instead of several engine calls per 0.2 s;
this only costs nothing because the waiter blocks on the engine's ``wait`` endpoint between
looks. These tests pin both halves, against the real engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from pathlib import Path

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


def _engine_proxy() -> tuple[int, threading.Event]:
    """A TCP port that relays to the local engine's socket until the event is set (then it refuses),
    as a Docker engine restarting looks to a client."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    down = threading.Event()
    live: list[socket.socket] = []

    def pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        server.settimeout(0.2)
        while not down.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            engine = socket.socket(socket.AF_UNIX)
            engine.connect("/var/run/docker.sock")
            live.extend((client, engine))
            for a, b in ((client, engine), (engine, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()
        server.close()
        for s in live:  # the engine went away: its open connections too
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    threading.Thread(target=serve, daemon=True).start()
    return port, down


def test_an_engine_that_cannot_be_reached_is_an_outage_to_wait_out_not_the_jobs_failure() -> None:
    """The engine restarting mid-job: the status look raised requests' ConnectionError, which
    run_job took for the job's failure (FAILED, a cancel that could not reach the engine either),
    while the container ran on; it is now BackendUnavailable, which run_job waits out."""
    from orchestrator.launchers import BackendUnavailable

    require_docker()
    port, down = _engine_proxy()
    launcher = get_launcher("docker", base_url=f"tcp://127.0.0.1:{port}", timeout=5)
    assert launcher.status(JobHandle("docker", "openlab-nosuch-0000")).state is JobState.LOST  # reached
    down.set()
    time.sleep(0.5)
    with pytest.raises(BackendUnavailable, match=rf"docker engine not reachable at tcp://127.0.0.1:{port}"):
        launcher.status(JobHandle("docker", "openlab-nosuch-0000"))


def test_a_child_killed_for_memory_is_not_the_jobs_failure_when_the_job_exits_0() -> None:
    """Docker says OOMKilled when any process of the container was; a job whose worker died of
    it and which went on to exit 0 was FAILED "exit 0 (out of memory)", and `job run` exited 1."""
    require_docker()
    image = docker_image("base")
    launcher = get_launcher("docker", image=image)
    child = "python3 -c 'x = bytearray(400 * 1024 * 1024)' || true"
    handle = launcher.submit(JobSpec(name="oomchild", command=["sh", "-c", child], image=image, memory="64M"))
    try:
        status = launcher.wait(handle, timeout=120)
        assert status.state is JobState.SUCCEEDED and status.exit_code == 0, status
    finally:
        launcher.cleanup(handle)


def test_a_jobs_own_secret_is_masked_in_the_log_openlab_keeps_and_shows_later() -> None:
    """`-e MY_TOKEN=...`: masked in the live stream, but the saved log and `openlab job logs` from
    another process (which knows only its own environment's secrets) printed it."""
    require_docker()
    image = docker_image("base")
    launcher = get_launcher("docker", image=image)
    secret = "s3cr3t-value-of-the-job-42"
    spec = JobSpec(name="talks", command=["sh", "-c", 'echo "token is $MY_TOKEN"'], image=image)
    handle = launcher.submit(dataclasses.replace(spec, env={"MY_TOKEN": secret}))
    try:
        assert launcher.wait(handle, timeout=60).state is JobState.SUCCEEDED
        assert list(launcher.logs(handle)) == ["token is ***"], "while the container is there"
    finally:
        launcher.cleanup(handle)
    fresh = get_launcher("docker", image=image)  # `job logs` later: the container is gone, the saved log read
    assert list(fresh.logs(handle)) == ["token is ***"]
    assert secret not in Path(str(handle.log_path)).read_text()


def test_cancelling_a_container_that_never_started_removes_it_and_ends_the_job() -> None:
    """A submit cut short between create and start left a `created` container: cancel's stop did
    nothing to it, cleanup keeps what has not ended, so it stayed PENDING and was never removed."""
    require_docker()
    image = docker_image("base")
    launcher = get_launcher("docker", image=image)
    created = launcher.client.containers.create(image, ["sleep", "60"], labels={"openlab.io/managed": "true"})
    handle = JobHandle("docker", created.name)
    try:
        launcher.cancel(handle)
        status = launcher.status(handle)
        assert status.state is JobState.CANCELLED and status.reason == "cancelled before it started", status
        assert launcher._get(created.name) is None, "the container is gone"
    finally:
        with contextlib.suppress(Exception):
            created.remove(force=True)


def test_a_job_saving_at_its_time_limit_has_its_grace_before_the_backstop_kills_it() -> None:
    """At its time limit a job is told (SIGTERM) and has `grace` seconds to save before SIGKILL. The
    status look's backstop killed any container 10 s past its limit, so a training that needed more
    than 10 s of a 30 s grace to write its checkpoint lost it whenever someone was watching."""
    require_docker()
    image = docker_image("base")
    launcher = get_launcher("docker", image=image, grace=25)
    saves = 'trap "sleep 14; echo saved; exit 0" TERM; sleep 600 & wait'
    handle = launcher.submit(JobSpec(name="saves", command=["sh", "-c", saves], image=image, time_limit=1))
    try:
        status = launcher.wait(handle, timeout=120)  # looks every poll_interval, 2 s: many looks past limit + 10
        assert status.state is JobState.FAILED and "time limit" in (status.reason or ""), status
        assert status.exit_code != 137, status  # not killed: timeout's own exit, once the job ended
        log = "\n".join(launcher.logs(handle))
        assert "saved" in log, log
    finally:
        launcher.cleanup(handle)
