"""Where the emulated cluster runs pods: Docker containers when the engine is up, local processes otherwise.

Running the pod as a container of its image makes the Kubernetes tests exercise what a
cluster would do with the manifest (image, command, env, hostPath mounts, memory limit),
not only what the API accepts; the launcher's watch/poll, logs and cancel still go over
HTTP to the emulator. The process fallback keeps the suite useful on machines without an
engine, so it is tested too, even where the engine is up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launchers import JobSpec, JobState, get_launcher
from tests.launchers.k8s_emulator import EmulatedCluster
from tests.services import require_docker


def _launcher(cluster: EmulatedCluster) -> Any:
    launcher = get_launcher("kubernetes", host=cluster.url)
    launcher.poll_interval = 0.1
    return launcher


def _wait_for_line(launcher: Any, handle: Any, wanted: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if wanted in list(launcher.logs(handle)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{wanted!r} never appeared in the log of {handle.job_id}")


@pytest.fixture(scope="module")
def process_cluster(k8s_cluster: EmulatedCluster) -> Iterator[EmulatedCluster]:
    # The session's emulator first, always: kmock swaps a process-wide resolver in and out, so
    # emulators must stop in the reverse order they started. Without this, a worker that ran a
    # test of this module before its first test of the session's cluster stopped them out of order.
    cluster = EmulatedCluster(runtime="process").start()
    yield cluster
    cluster.stop()
    assert not cluster.errors, cluster.errors


@pytest.mark.docker
def test_pods_are_containers_of_their_image_when_the_engine_is_up(k8s_cluster: EmulatedCluster, tmp_path: Path) -> None:
    client = require_docker()
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = _launcher(k8s_cluster)
    root = tmp_path / "artifacts"
    handle = launcher.submit(
        JobSpec(
            name="in-a-container",
            command=[
                "sh",
                "-c",
                f'test -f /.dockerenv && echo "in a container as $WHO"; echo out > {root}/x; echo started; sleep 300',
            ],
            image=k8s_cluster.image,
            env={"WHO": "the pod"},
            artifact_root=root,
        )
    )
    try:
        _wait_for_line(launcher, handle, "started")
        assert list(launcher.logs(handle))[:1] == ["in a container as the pod"]
        assert (root / "x").read_text() == "out\n"  # the hostPath volume is a real bind mount
        (container,) = k8s_cluster.containers(handle.job_id)
        assert container.status == "running" and container.image.id == client.images.get(k8s_cluster.image).id

        launcher.cancel(handle)  # over HTTP: delete the Job; the controller kills the container
        assert not k8s_cluster.workload_alive(handle.job_id)
        assert k8s_cluster.containers(handle.job_id) == []
        assert launcher.status(handle).state is JobState.CANCELLED
    finally:
        launcher.cleanup(handle)


@pytest.mark.docker
def test_the_image_digest_and_an_oom_kill_come_from_the_engine(k8s_cluster: EmulatedCluster) -> None:
    client = require_docker()
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = _launcher(k8s_cluster)
    handle = launcher.submit(
        JobSpec(
            name="oom",
            command=["python3", "-c", "x = bytearray(400 * 1024 * 1024); print(len(x))"],
            image=k8s_cluster.image,
            memory="64M",
        )
    )
    try:
        status = launcher.wait(handle, timeout=60)
        assert status.state is JobState.FAILED and status.reason == "out of memory", status
        assert status.exit_code == 137
        assert status.image_digest == f"docker://{client.images.get(k8s_cluster.image).id}"
    finally:
        launcher.cleanup(handle)


def test_without_the_engine_pods_are_local_processes(process_cluster: EmulatedCluster, tmp_path: Path) -> None:
    assert process_cluster.runtime == "process" and process_cluster.containers() == []
    launcher = _launcher(process_cluster)
    ok = launcher.submit(JobSpec(name="proc", command=["sh", "-c", "echo $$ > /dev/null; echo hello"]))
    try:
        assert launcher.wait(ok, timeout=20).state is JobState.SUCCEEDED
        assert list(launcher.logs(ok)) == ["hello"]
    finally:
        launcher.cleanup(ok)
    running = launcher.submit(JobSpec(name="proc-cancel", command=["sh", "-c", "sleep 300 & echo started; sleep 300"]))
    try:
        _wait_for_line(launcher, running, "started", timeout=20)
        assert process_cluster.workload_alive(running.job_id)
        launcher.cancel(running)
        assert not process_cluster.workload_alive(running.job_id)  # the whole process group, background child too
    finally:
        launcher.cleanup(running)


@pytest.mark.parametrize(
    "runtime",
    [pytest.param("docker", marks=pytest.mark.docker), "process"],  # the clusters' start order above
)
def test_an_evicted_pod_is_preempted_and_a_plain_failure_is_not(runtime: str, request: pytest.FixtureRequest) -> None:
    """Kubernetes evicts a running pod (DisruptionTarget, SIGTERM, SIGKILL after the grace period):
    the attempt is PREEMPTED with Kubernetes' reason, whether the workload caught SIGTERM or was
    killed; a pod that fails by itself is FAILED."""
    from orchestrator.launchers.attempts import run_job
    from orchestrator.lineage.store import LineageStore

    if runtime == "docker":
        require_docker()
        cluster = request.getfixturevalue("k8s_cluster")
        assert cluster.runtime == "docker", cluster.runtime_reason
    else:
        cluster = request.getfixturevalue("process_cluster")
    launcher = _launcher(cluster)
    # sh as a container's PID 1 ignores SIGTERM, so there the grace period's SIGKILL ends it
    spec = JobSpec(name="evicted", command=["sh", "-c", "echo started; sleep 300"], image=cluster.image)

    def evict_once_started(line: str) -> None:
        if line == "started":
            threading.Thread(target=cluster.evict, args=(handles[0],), kwargs={"grace": 1.0}).start()

    handles: list[str] = []
    original_submit = launcher.submit

    def submit(job: JobSpec) -> Any:
        handle = original_submit(job)
        handles.append(handle.job_id)
        return handle

    launcher.submit = submit
    with LineageStore.open() as store:
        attempt, status = run_job(store, launcher, spec, on_log=evict_once_started, timeout=60)
        assert status.state is JobState.PREEMPTED, status
        assert status.reason == "pod stopped by Kubernetes: EvictionByEvictionAPI (Eviction API: evicting)"
        assert attempt.state == "PREEMPTED"
        _, failed = run_job(
            store, launcher, JobSpec(name="fails", command=["sh", "-c", "exit 3"], image=cluster.image), timeout=60
        )
        assert failed.state is JobState.FAILED and failed.exit_code == 3
    assert not cluster.workload_alive(handles[0])


def test_job_controller_pod_retries_are_followed_and_named(process_cluster: EmulatedCluster, tmp_path: Path) -> None:
    """With backoffLimit above 0 the Job controller replaces a failed pod with a new one (a new name,
    a log of its own): the log goes on into the new pod from its first line, saying so, and the
    attempt names the pods that failed before the last, as it names Slurm's requeues."""
    from orchestrator.launchers.attempts import run_job
    from orchestrator.lineage.store import LineageStore

    launcher = _launcher(process_cluster)
    marker = tmp_path / "failed-once"
    flaky = f"if [ -e {marker} ]; then echo second; exit 0; fi; touch {marker}; echo first; exit 4"
    lines: list[str] = []
    with LineageStore.open() as store:
        attempt, status = run_job(
            store,
            launcher,
            JobSpec(name="flaky", command=["sh", "-c", flaky], options={"backoff_limit": 2}),
            on_log=lines.append,
            timeout=60,
        )
        assert status.state is JobState.SUCCEEDED and status.exit_code == 0, status
        assert lines[0] == "first" and lines[-1] == "second", lines
        (announce,) = [line for line in lines if line.startswith("[openlab] pod ")]
        assert " exit 4; Kubernetes started pod openlab-flaky-" in announce, announce
        assert attempt.reason and attempt.reason.startswith("Kubernetes ran 2 pods (backoffLimit); before the last:")
        assert attempt.reason.endswith("exit 4"), attempt.reason

        _, failed = run_job(
            store,
            launcher,
            JobSpec(name="fails-twice", command=["sh", "-c", "echo try; exit 5"], options={"backoff_limit": 1}),
            on_log=lines.append,
            timeout=60,
        )
        assert failed.state is JobState.FAILED and failed.exit_code == 5, failed
        assert failed.reason and "Kubernetes ran 2 pods (backoffLimit)" in failed.reason, failed.reason


def _pending_job_and_pod(**pod_status: Any) -> tuple[Any, Any]:
    """A Job the controller counts as active, and its one pod, Pending with ``pod_status``."""
    from kubernetes.client import V1Job, V1JobStatus, V1ObjectMeta, V1Pod, V1PodSpec, V1PodStatus

    job = V1Job(metadata=V1ObjectMeta(name="openlab-x-1", annotations={}), status=V1JobStatus(active=1))
    pod = V1Pod(
        metadata=V1ObjectMeta(name="openlab-x-1-abcde", labels={}),
        spec=V1PodSpec(containers=[], node_name=None),
        status=V1PodStatus(phase="Pending", **pod_status),
    )
    return job, pod


def test_a_pod_that_cannot_be_scheduled_or_pulled_is_pending_with_the_reason_not_running() -> None:
    """Insufficient GPUs or a wrong image tag: the Job is active to its controller, so it read
    RUNNING with no reason for as long as it waited (its GPU-hours counting), and a time limit
    that ended it blamed the job."""
    from kubernetes.client import (
        V1ContainerState,
        V1ContainerStateWaiting,
        V1ContainerStatus,
        V1PodCondition,
    )

    from orchestrator.launchers import JobHandle

    launcher = get_launcher("kubernetes", host="http://127.0.0.1:9", measure_usage=False)
    handle = JobHandle("kubernetes", "default/openlab-x-1")
    unschedulable = V1PodCondition(
        type="PodScheduled",
        status="False",
        reason="Unschedulable",
        message="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
    )
    job, pod = _pending_job_and_pod(conditions=[unschedulable])
    status = launcher._status_of(handle, job, [pod])
    assert status.state is JobState.PENDING and status.started_at is None, status
    assert status.reason == "not scheduled: Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    pulling = V1ContainerStatus(
        name="job",
        image="openlab/job:nosuch",
        image_id="",
        ready=False,
        restart_count=0,
        state=V1ContainerState(
            waiting=V1ContainerStateWaiting(reason="ImagePullBackOff", message='Back-off pulling "openlab/job:nosuch"')
        ),
    )
    job, pod = _pending_job_and_pod(container_statuses=[pulling])
    status = launcher._status_of(handle, job, [pod])
    assert (status.state, status.reason) == (
        JobState.PENDING,
        'ImagePullBackOff: Back-off pulling "openlab/job:nosuch"',
    )
    # an image reference that does not parse, or one the node lacks that may not be pulled: the kubelet
    # retries for ever, so the job waited for good (or failed as "time limit exceeded" without running)
    for never, said in (
        ("InvalidImageName", 'Failed to apply default image tag "openlab/Job:x": invalid reference format'),
        ("ErrImageNeverPull", 'Container image "openlab/job:nosuch" is not present with pull policy of Never'),
    ):
        pulling.state = V1ContainerState(waiting=V1ContainerStateWaiting(reason=never, message=said))
        job, pod = _pending_job_and_pod(container_statuses=[pulling])
        status = launcher._status_of(handle, job, [pod])
        assert (status.state, status.reason) == (JobState.FAILED, f"the container cannot start: {never}: {said}")
    creating = V1ContainerStateWaiting(reason="ContainerCreating")  # on its way: no reason to tell
    pulling.state = V1ContainerState(waiting=creating)
    job, pod = _pending_job_and_pod(container_statuses=[pulling])
    assert launcher._status_of(handle, job, [pod]).state is JobState.RUNNING
