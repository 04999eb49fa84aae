"""A Docker engine on another host (``[backends.docker] base_url = "tcp://gpu-box:2375"`` or
``DOCKER_HOST``) cannot mount a folder of this host, so the launcher copies its helper scripts (the
task runner, the usage wrapper) into the container between its creation and its start, and reads
the usage record back out of the ended container. The engine here is the real local one, reached
over TCP through a forwarder, so the launcher deals with it as with a remote one."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.lineage import Attempt, LineageStore
from tests.launchers.test_tasks import BURN_AND_TELL
from tests.services import docker_image

pytestmark = [pytest.mark.docker]
SOCKET = "/var/run/docker.sock"


class _Pipe(socketserver.BaseRequestHandler):
    """One TCP connection, relayed both ways to the engine's socket (attach and log streams too)."""

    def handle(self) -> None:
        engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        engine.connect(SOCKET)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for sock in (src, dst):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pump, args=(engine, self.request), daemon=True)
        back.start()
        pump(self.request, engine)
        back.join(5)
        engine.close()


@pytest.fixture(scope="module")
def engine_over_tcp() -> Iterator[str]:
    docker_image("base")  # the engine is up (or the test is skipped/failed as the suite decides)
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Pipe)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"tcp://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_remote_engine_runs_tasks_under_the_wrapper_in_an_image_without_openlab(
    engine_over_tcp: str, store: LineageStore
) -> None:
    """Before, ``measure_usage = true`` was refused with such an engine and several tasks ran the
    image's own ``python -m orchestrator.launchers._tasks`` (no such module in a lab's image)."""
    base = docker_image("base")
    launcher = get_launcher("docker", base_url=engine_over_tcp, image=base, measure_usage=True)
    launcher.poll_interval = 0.2
    spec = JobSpec(name="remote", command=["python", "-c", BURN_AND_TELL], image=base, tasks_per_node=2)
    mounts: list[Any] = []
    lines: list[str] = []

    def seen(line: str) -> None:
        lines.append(line)
        if not mounts:  # while it runs: what the container has mounted
            (container,) = launcher.client.containers.list(all=True, filters={"name": "openlab-remote-"})
            mounts.append([m.get("Destination") for m in container.attrs.get("Mounts") or []])

    attempt, status = run_job(store, launcher, spec, on_log=seen, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    assert sorted(line for line in lines if "rank" in line) == ["0: rank 0 of 2 True", "1: rank 1 of 2 True"], lines
    assert mounts and "/.openlab" not in mounts[0], mounts
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 0.6, used  # both tasks', read out of the container
