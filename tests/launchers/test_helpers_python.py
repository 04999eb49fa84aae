"""The Python the container backends run their helper scripts with (option ``python``), in an image
as a lab builds it on Debian's or Ubuntu's ``python3`` package: ``python3`` and no plain ``python``.

A job of several tasks, or a measured one, starts one of this launcher's helper scripts first. With
``python`` as the default that image ended "exit code 127" and only the job's log (docker-init's
"exec python failed") said why. The default is ``python3`` now, and a program the image lacks, the
helpers' Python or the job's own command, is named in the attempt's reason, with the option to set
when it is the helpers'.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.launchers import JobSpec, JobState, Launcher, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.lineage.models import Attempt
from orchestrator.lineage.store import LineageStore
from tests.launchers.test_tasks import BURN_AND_TELL

BACKENDS = ["docker", "kubernetes"]


def _launcher(backend: str, request: pytest.FixtureRequest, image: str, **options: Any) -> Launcher:
    if backend == "kubernetes":  # pods as containers of their image, on the emulated cluster
        cluster = request.getfixturevalue("k8s_cluster")
        assert cluster.runtime == "docker", cluster.runtime_reason
        options["host"] = cluster.url
    launcher = get_launcher(backend, image=image, **options)
    launcher.poll_interval = 0.2
    return launcher


@pytest.fixture
def image() -> str:
    from tests.services import python3_only_image

    return python3_only_image()


@pytest.mark.docker
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_measured_tasks_run_in_an_image_with_python3_and_no_python(
    backend: str, image: str, store: LineageStore, request: pytest.FixtureRequest
) -> None:
    """The defaults run both helper scripts (the task runner and the usage wrapper) in that image."""
    launcher = _launcher(backend, request, image, measure_usage=True)
    spec = JobSpec(name="py3", command=["python3", "-c", BURN_AND_TELL], image=image, tasks_per_node=2)
    lines: list[str] = []
    attempt, status = run_job(store, launcher, spec, on_log=lines.append, timeout=120)
    assert status.state is JobState.SUCCEEDED, (status, lines)
    assert sorted(line for line in lines if "rank" in line) == ["0: rank 0 of 2 True", "1: rank 1 of 2 True"], lines
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 0.6, used  # both tasks', measured by the wrapper


@pytest.mark.docker
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("tasks", "measure_usage"),
    [(1, True), (2, False), (2, True)],
    ids=["wrapper", "tasks", "tasks-under-wrapper"],
)
def test_an_image_without_the_helpers_python_names_it_and_the_option(
    backend: str, tasks: int, measure_usage: bool, image: str, store: LineageStore, request: pytest.FixtureRequest
) -> None:
    """Whichever helper starts first (the wrapper, or the task runner in a pod whose pause container
    is PID 1), its missing Python is named with the backend's option to set; the failure is kept."""
    launcher = _launcher(backend, request, image, python="python3.99", measure_usage=measure_usage)
    spec = JobSpec(name="nopy", command=["python3", "-c", "print('never')"], image=image, tasks_per_node=tasks)
    lines: list[str] = []
    attempt, status = run_job(store, launcher, spec, on_log=lines.append, timeout=120)
    assert status.state is JobState.FAILED, (status, lines)
    reason = store.require(Attempt, attempt.id).reason or ""
    want = f"the image has no 'python3.99' to run openlab's helper scripts with: set the {backend} backend's python"
    assert want in reason, reason
    assert "never" not in "\n".join(lines), lines


@pytest.mark.docker
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tasks", [1, 2])
def test_a_command_the_image_lacks_is_named_without_blaming_the_helpers(
    backend: str, tasks: int, image: str, store: LineageStore, request: pytest.FixtureRequest
) -> None:
    """Under the wrapper (and, for two tasks, the task runner) the job's own program is missing:
    the reason names it, exit 127, and says nothing of the helpers' Python, which did start."""
    launcher = _launcher(backend, request, image, measure_usage=True)
    spec = JobSpec(name="noprog", command=["no-such-trainer", "--steps", "3"], image=image, tasks_per_node=tasks)
    attempt, status = run_job(store, launcher, spec, timeout=120)
    assert status.state is JobState.FAILED and status.exit_code == 127, status
    reason = store.require(Attempt, attempt.id).reason or ""
    assert "the image has no 'no-such-trainer'" in reason and "python option" not in reason, reason
