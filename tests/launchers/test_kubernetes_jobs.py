"""What a demanding Kubernetes user meets: secret variables, sidecar containers, time spent queued.

- A job's secret-named variables (``-e WANDB_API_KEY=...``) go in a Secret owned by the Job, which its
  manifest refers to (``valueFrom.secretKeyRef``): whoever may ``kubectl get job -o yaml`` does not
  read them, and the job still sees them.
- A template that adds a sidecar container (istio, a log shipper) makes the API server refuse a log
  read that names no container (400 "a container name must be specified"): openlab names the main
  one, and takes exit code, image and log from it, not from the sidecar.
- The time limit is the pod's ``activeDeadlineSeconds``, counted from when it is on a node: a job that
  waits to be scheduled does not lose its run time meanwhile (the Job's counts from the Job's start).

The emulated cluster runs pods as Docker containers where the engine is up (the session's cluster)
and as local processes otherwise; most tests use a process cluster of their own, which is quicker.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import handle_from_attempt, run_job
from orchestrator.launchers.kubernetes import DEFAULT_TEMPLATE
from orchestrator.lineage import LineageStore
from tests.launchers.k8s_emulator import UNSCHEDULABLE, EmulatedCluster


@pytest.fixture(scope="module")
def cluster(k8s_cluster: EmulatedCluster) -> Iterator[EmulatedCluster]:
    # The session's emulator first, always: emulators must stop in the reverse order they started
    # (see test_kubernetes_pods.process_cluster).
    cluster = EmulatedCluster(runtime="process").start()
    yield cluster
    cluster.uncordon()
    cluster.stop()
    assert not cluster.errors, cluster.errors


def _launcher(cluster: EmulatedCluster, **options: Any) -> Any:
    launcher = get_launcher("kubernetes", host=cluster.url, image=cluster.image, **options)
    launcher.poll_interval = 0.1
    return launcher


def _template(tmp_path: Path, edit: Any) -> str:
    manifest = yaml.safe_load(DEFAULT_TEMPLATE.read_text())
    edit(manifest)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def _until(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


#: Prints a digest of WANDB_API_KEY (never the value itself, which would be in the command) and PLAIN.
SHOWS_ENV = (
    "import hashlib, os, time\n"
    "print('key', hashlib.sha256(os.environ['WANDB_API_KEY'].encode()).hexdigest()[:16], flush=True)\n"
    "print('plain', os.environ['PLAIN'], flush=True)\n"
    "time.sleep(float(os.environ.get('HOLD', '0')))\n"
)


# -- 1. secret variables ---------------------------------------------------------------------


@pytest.mark.docker
def test_secret_variables_go_in_a_secret_the_job_owns_and_never_in_its_manifest(
    k8s_cluster: EmulatedCluster, store: LineageStore
) -> None:
    """The Job as stored (what was sent, what ``kubectl get job -o yaml`` shows) carries no secret
    value; a Secret ``<job>-openlab-env`` (Opaque, owned by the Job) holds it, and the container,
    a real one of the job image, gets it in its env. Cancel and cleanup delete the Secret."""
    from tests.services import require_docker

    require_docker()
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = _launcher(k8s_cluster)
    value = "wandb-" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:24]
    env = {"WANDB_API_KEY": value, "PLAIN": "shown", "HOLD": "300"}
    handle = launcher.submit(JobSpec(name="secret-env", command=["python3", "-c", SHOWS_ENV], env=env))
    namespace, name = handle.job_id.split("/", 1)
    try:
        _until("the job shows its env", lambda: f"key {_digest(value)}" in list(launcher.logs(handle)), 60)
        assert "plain shown" in list(launcher.logs(handle))
        job = k8s_cluster.jobs()[(namespace, name)]
        assert value not in json.dumps(job), "the secret value is in the Job's manifest"
        container = job["spec"]["template"]["spec"]["containers"][0]
        by_name = {e["name"]: e for e in container["env"]}
        assert by_name["WANDB_API_KEY"] == {
            "name": "WANDB_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": f"{name}-openlab-env", "key": "WANDB_API_KEY"}},
        }
        assert by_name["PLAIN"] == {"name": "PLAIN", "value": "shown"}, "a plain variable stays plain"
        secret = k8s_cluster.secret(namespace, f"{name}-openlab-env")
        assert secret is not None and secret["type"] == "Opaque"
        assert base64.b64decode(secret["data"]["WANDB_API_KEY"]).decode() == value
        assert set(secret["data"]) == {"WANDB_API_KEY"}
        (owner,) = secret["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", name, job["metadata"]["uid"])

        launcher.cancel(handle)
        assert k8s_cluster.secret(namespace, f"{name}-openlab-env") is None, "cancel deletes the Secret"
        assert launcher.status(handle).state is JobState.CANCELLED
    finally:
        launcher.cleanup(handle)

    attempt, status = run_job(
        store, launcher, JobSpec(name="secret-done", command=["python3", "-c", SHOWS_ENV], env=env | {"HOLD": "0"})
    )
    assert status.state is JobState.SUCCEEDED, status
    done = handle_from_attempt(attempt).job_id.split("/", 1)[1]
    assert k8s_cluster.secret(namespace, f"{done}-openlab-env") is None, "cleanup deletes the Secret"


def test_a_secret_in_the_jobs_command_is_warned_of_naming_the_argument(
    k8s_cluster: EmulatedCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A secret-named variable goes into a Secret; one typed as an argument (``--db-password X``) is in
    the Job's manifest, readable by whoever may read Jobs, while lineage shows it masked. The job runs
    (it needs the value), and the warning says which argument and where to put it instead."""
    import logging

    launcher = _launcher(k8s_cluster)
    with caplog.at_level(logging.WARNING, logger="orchestrator.launchers.base"):
        handle = launcher.submit(JobSpec(name="secret-arg", command=["true", "--db-password", "hunter2hunter2"]))
    try:
        (said,) = [r.getMessage() for r in caplog.records if "holds a secret" in r.getMessage()]
        assert "argument 3 (--db-password …)" in said and "the Job manifest" in said and "environment" in said
        assert "hunter2hunter2" not in said
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchestrator.launchers.base"):
            plain = launcher.submit(JobSpec(name="plain-arg", command=["true", "--lr", "0.1"]))
        launcher.cleanup(plain)
        assert not [r for r in caplog.records if "holds a secret" in r.getMessage()]
    finally:
        launcher.cleanup(handle)


@pytest.mark.docker
def test_a_secret_the_job_prints_is_masked_in_what_openlab_streams_shows_and_keeps(
    k8s_cluster: EmulatedCluster, store: LineageStore, tmp_path: Path
) -> None:
    """A job that prints its W&B key (a traceback quoting its environment, a debug print): the lines
    ``run_job`` streams (the terminal, Prefect's logs), ``job logs`` in the same process and the log
    kept in ``logs/`` at cleanup show ``***``, as on the other backends; before, all three showed it."""
    from tests.services import require_docker

    require_docker()
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = _launcher(k8s_cluster)
    value = "wandb-" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:24]
    prints = "import os; print('the key is', os.environ['WANDB_API_KEY'], flush=True)"
    streamed: list[str] = []
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="prints-secret", command=["python3", "-c", prints], env={"WANDB_API_KEY": value}),
        on_log=streamed.append,
    )
    assert status.state is JobState.SUCCEEDED, status
    assert "the key is ***" in streamed, streamed
    handle = handle_from_attempt(attempt)
    shown = list(launcher.logs(handle))
    kept = Path(handle.log_path or "").read_text()
    assert "the key is ***" in shown and "the key is ***" in kept, (shown, kept)
    assert value not in "\n".join(streamed + shown) + kept


def test_a_job_without_secret_variables_makes_no_secret_and_a_deleted_job_takes_its_secret_along(
    cluster: EmulatedCluster, store: LineageStore
) -> None:
    """No secret-named variable, no Secret (and no request for one); a Job deleted by someone else
    (``kubectl delete job``, its TTL) takes its Secret with it, through ownerReferences."""
    from kubernetes import client

    launcher = _launcher(cluster)
    before = len(cluster.requests())
    _, status = run_job(
        store, launcher, JobSpec(name="no-secret", command=["sh", "-c", "echo $PLAIN"], env={"PLAIN": "x"})
    )
    assert status.state is JobState.SUCCEEDED, status
    assert not [path for _, path, _ in cluster.requests()[before:] if "/secrets" in path]

    handle = launcher.submit(
        JobSpec(name="orphaned", command=["sh", "-c", "sleep 300"], env={"MY_PASSWORD": "hunter2-long"})
    )
    namespace, name = handle.job_id.split("/", 1)
    assert cluster.secret(namespace, f"{name}-openlab-env") is not None
    body = client.V1DeleteOptions(propagation_policy="Background")
    launcher.batch.delete_namespaced_job(name, namespace, body=body)
    _until("the Secret is collected", lambda: cluster.secret(namespace, f"{name}-openlab-env") is None)
    _until("the pod is gone", lambda: not cluster.workload_alive(handle.job_id))


def test_a_secret_the_template_names_that_does_not_exist_keeps_the_job_pending_with_the_reason(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """A template's own ``secretKeyRef`` (the cluster's Secrets, as the README advises for secrets
    openlab should not hold) to a Secret not made yet: the container waits in
    CreateContainerConfigError, which the job says, and its log reads empty meanwhile (the kubelet
    answers 400 "waiting to start"); once the Secret exists it runs."""
    from kubernetes import client

    def db_password(manifest: dict[str, Any]) -> None:
        ref = {"secretKeyRef": {"name": "lab-db", "key": "password"}}
        manifest["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "DB_PASSWORD", "valueFrom": ref}]

    launcher = _launcher(cluster, template=_template(tmp_path, db_password))
    handle = launcher.submit(JobSpec(name="needs-db", command=["sh", "-c", 'echo "db ${#DB_PASSWORD}"']))
    try:
        status = _until("pending", lambda: (s := launcher.status(handle)).reason and s)
        assert (status.state, status.reason) == (
            JobState.PENDING,
            'CreateContainerConfigError: secret "lab-db" not found',
        )
        assert list(launcher.logs(handle)) == []
        namespace = handle.job_id.split("/", 1)[0]
        secret = client.V1Secret(metadata=client.V1ObjectMeta(name="lab-db"), string_data={"password": "12345678"})
        launcher.core.create_namespaced_secret(namespace, secret)
        assert launcher.wait(handle, timeout=30).state is JobState.SUCCEEDED
        assert list(launcher.logs(handle)) == ["db 8"]
    finally:
        launcher.cleanup(handle)


# -- 2. a sidecar container --------------------------------------------------------------------


def _with_sidecar(tmp_path: Path) -> str:
    def sidecar(manifest: dict[str, Any]) -> None:
        manifest["spec"]["template"]["spec"]["containers"].append(
            {
                "name": "log-shipper",  # sorts after "job", as the kubelet sorts container statuses
                "image": "openlab/job:latest",
                "command": ["sh", "-c", "echo shipping; sleep 1; echo shipped"],
            }
        )

    return _template(tmp_path, sidecar)


def test_a_job_whose_pods_have_a_sidecar_reads_the_main_containers_log_and_exit(
    cluster: EmulatedCluster, store: LineageStore, tmp_path: Path
) -> None:
    """Followed, saved, tailed and read back: the main container's lines, never the sidecar's; a
    failure is the main container's exit code and last error line."""
    launcher = _launcher(cluster, template=_with_sidecar(tmp_path))
    lines: list[str] = []
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="sidecar", command=["sh", "-c", "echo main one; sleep 1; echo main two"]),
        on_log=lines.append,
        timeout=60,
    )
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0, status
    assert lines == ["main one", "main two"], lines
    handle = handle_from_attempt(attempt)
    assert list(launcher.logs(handle)) == ["main one", "main two"], "the log kept at cleanup"

    lines.clear()
    failing = "echo 'error: lr must be positive'; sleep 2; exit 3"  # ends after the sidecar, whose exit is 0
    _, failed = run_job(
        store, launcher, JobSpec(name="sidecar-fails", command=["sh", "-c", failing]), on_log=lines.append, timeout=60
    )
    assert failed.state is JobState.FAILED and failed.exit_code == 3, failed
    assert failed.reason == "exit code 3 (BackoffLimitExceeded): error: lr must be positive", failed.reason
    assert lines == ["error: lr must be positive"], lines

    handle = launcher.submit(JobSpec(name="sidecar-tail", command=["sh", "-c", "echo a; echo b; echo c; sleep 300"]))
    try:
        _until("the job runs", lambda: list(launcher.logs(handle)) == ["a", "b", "c"])
        assert list(launcher.logs(handle, tail=1)) == ["c"]
        followed: list[str] = []

        def follow() -> None:
            for line in launcher.logs(handle, follow=True, tail=2):
                followed.append(line)

        threading.Thread(target=follow, daemon=True).start()
        _until("followed", lambda: followed == ["b", "c"])
    finally:
        launcher.cancel(handle)
        launcher.cleanup(handle)


def test_a_several_node_job_with_a_sidecar_reads_every_pods_main_container(
    cluster: EmulatedCluster, store: LineageStore, tmp_path: Path
) -> None:
    launcher = _launcher(cluster, template=_with_sidecar(tmp_path), measure_usage=False)
    lines: list[str] = []
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="nodes-sidecar", command=["sh", "-c", "echo node $NODE_RANK"], nodes=2),
        on_log=lines.append,
        timeout=60,
    )
    assert status.state is JobState.SUCCEEDED, (status, lines)
    assert sorted(lines) == ["0: node 0", "1: node 1"], lines
    assert sorted(launcher.logs(handle_from_attempt(attempt))) == ["0: node 0", "1: node 1"]


def test_the_apis_answers_about_a_pod_with_a_sidecar_are_the_kubelets(cluster: EmulatedCluster, tmp_path: Path) -> None:
    """The emulator as the API server: no container named and two in the pod is 400, as is a name
    the pod has not; each named container's own log."""
    from kubernetes.client.exceptions import ApiException

    launcher = _launcher(cluster, template=_with_sidecar(tmp_path))
    handle = launcher.submit(JobSpec(name="sidecar-api", command=["sh", "-c", "echo main; sleep 300"]))
    try:
        _until("both containers wrote", lambda: list(launcher.logs(handle)) == ["main"])
        pod = launcher.pods(handle.job_id)[-1].metadata.name
        namespace = handle.job_id.split("/", 1)[0]
        with pytest.raises(ApiException) as refused:
            launcher.core.read_namespaced_pod_log(pod, namespace)
        assert refused.value.status == 400
        message = json.loads(refused.value.body)["message"]
        assert message == f"a container name must be specified for pod {pod}, choose one of: [job log-shipper]"
        with pytest.raises(ApiException, match="container nope is not valid for pod"):
            launcher.core.read_namespaced_pod_log(pod, namespace, container="nope")
        shipper = _until(
            "the sidecar's log",
            lambda: (
                (text := launcher.core.read_namespaced_pod_log(pod, namespace, container="log-shipper"))
                == "shipping\nshipped\n"
                and text
            ),
        )
        assert shipper == "shipping\nshipped\n"
    finally:
        launcher.cancel(handle)
        launcher.cleanup(handle)


# -- 3. the time limit counts from when the pod runs -------------------------------------------


def test_time_a_job_waits_to_be_scheduled_does_not_count_against_its_time_limit(cluster: EmulatedCluster) -> None:
    """The node cordoned: the job is PENDING with the scheduler's reason for longer than its time
    limit, and once scheduled it still has all of it (the Job-level limit failed it while it waited);
    its start is when it ran."""
    launcher = _launcher(cluster)
    cluster.cordon()
    try:
        handle = launcher.submit(JobSpec(name="queued", command=["sh", "-c", "sleep 1; echo done"], time_limit=2))
        status = _until("pending", lambda: (s := launcher.status(handle)).reason and s)
        assert (status.state, status.reason) == (JobState.PENDING, f"not scheduled: Unschedulable: {UNSCHEDULABLE}")
        time.sleep(3)  # longer than its time limit
        status = launcher.status(handle)
        assert status.state is JobState.PENDING, status
    finally:
        cluster.uncordon()
    try:
        status = launcher.wait(handle, timeout=30)
        assert status.state is JobState.SUCCEEDED, status
        assert list(launcher.logs(handle)) == ["done"]
        assert status.started_at and status.ended_at
        assert (status.ended_at - status.started_at).total_seconds() < 3, "its start is when it ran"
        job = cluster.jobs()[tuple(handle.job_id.split("/", 1))]  # type: ignore[index]
        assert "activeDeadlineSeconds" not in job["spec"]
        assert job["spec"]["template"]["spec"]["activeDeadlineSeconds"] == 2
    finally:
        launcher.cleanup(handle)


def test_a_pod_stopped_at_its_time_limit_is_the_jobs_time_limit(cluster: EmulatedCluster) -> None:
    """The kubelet fails the pod (reason DeadlineExceeded) and stops its containers: the job is
    FAILED with the time-limit reason, as for the Job-level limit, and nothing of it runs on."""
    launcher = _launcher(cluster)
    handle = launcher.submit(JobSpec(name="limited", command=["sh", "-c", "echo started; sleep 600"], time_limit=1))
    try:
        status = launcher.wait(handle, timeout=30)
        assert (status.state, status.reason) == (JobState.FAILED, "time limit exceeded (1s)"), status
        (pod,) = launcher.pods(handle.job_id)
        assert (pod.status.phase, pod.status.reason) == ("Failed", "DeadlineExceeded")
        assert not cluster.workload_alive(handle.job_id)
        assert list(launcher.logs(handle)) == ["started"]
    finally:
        launcher.cleanup(handle)


#: Saves for a second on SIGTERM, then exits 128+15, as openlab's training stages do.
SAVES_ON_SIGTERM = (
    "import signal, sys, time\n"
    "def save(signum, frame):\n"
    "    print('saving', flush=True)\n"
    "    time.sleep(1)\n"
    "    print('saved', flush=True)\n"
    "    sys.exit(128 + signum)\n"
    "signal.signal(signal.SIGTERM, save)\n"
    "print('started', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_pod_past_its_time_limit_is_waited_for_while_it_saves(
    cluster: EmulatedCluster, store: LineageStore, tmp_path: Path
) -> None:
    """The kubelet marks the pod Failed at once and gives its containers the grace period: the job
    is not over (nor its log read for the last time, nor its Job deleted) until the workload has
    saved and exited. With ``backoffLimit`` the Job controller would replace the pod: openlab does not
    count that (a rerun stops at the same point) and deletes the Job, whatever ``delete_finished``."""
    import sys

    # no usage wrapper: under the process runtime SIGTERM reaches the process group, wrapper and command
    launcher = _launcher(cluster, backoff_limit=2, delete_finished=False, measure_usage=False)
    lines: list[str] = []
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="saves", command=[sys.executable, "-c", SAVES_ON_SIGTERM], time_limit=2),
        on_log=lines.append,
        timeout=60,
    )
    assert lines == ["started", "saving", "saved"], lines
    assert (status.state, status.exit_code) == (JobState.FAILED, 143), status
    assert status.reason == "time limit exceeded (2s)", status.reason
    assert attempt.state == "FAILED"
    job_id = handle_from_attempt(attempt).job_id
    assert tuple(job_id.split("/", 1)) not in cluster.jobs(), "deleted: Kubernetes would have gone on with it"
    time.sleep(1.5)  # the emulated Job controller's back-off before a new pod: none comes, or it is stopped
    assert not cluster.workload_alive(job_id)

    _, failed = run_job(
        store, launcher, JobSpec(name="kept", command=["sh", "-c", "exit 4"], options={"backoff_limit": 0})
    )
    assert failed.exit_code == 4, failed
    assert [n for _, n in cluster.jobs() if "-kept-" in n], "a Job Kubernetes finished is kept (delete_finished)"


def test_a_several_node_job_stops_at_its_time_limit(cluster: EmulatedCluster, store: LineageStore) -> None:
    launcher = _launcher(cluster, measure_usage=False)
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="nodes-limited", command=["sh", "-c", "echo up; sleep 600"], nodes=2, time_limit=2),
        timeout=60,
    )
    assert status.state is JobState.FAILED, status
    assert status.reason and status.reason.startswith("time limit exceeded (2s)"), status.reason
    assert not cluster.workload_alive(handle_from_attempt(attempt).job_id)


def _pod(name: str, *, phase: str, reason: str | None = None, containers: dict[str, Any], created: int) -> Any:
    """A pod of Job ``openlab-x-1`` as the API returns it: ``containers`` maps a name to its state
    (``("running",)``, ``("terminated", exit code)``), the first being the main one."""
    import datetime as dt

    from kubernetes.client import (
        V1Container,
        V1ContainerState,
        V1ContainerStateRunning,
        V1ContainerStateTerminated,
        V1ContainerStatus,
        V1ObjectMeta,
        V1Pod,
        V1PodSpec,
        V1PodStatus,
    )

    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(minutes=created)
    statuses = []
    for cname, state in sorted(containers.items()):
        if state[0] == "running":
            st = V1ContainerState(running=V1ContainerStateRunning(started_at=start))
        else:
            end = start + dt.timedelta(seconds=5)
            st = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=state[1], finished_at=end))
        image = f"docker-pullable://{cname}@sha256:{cname[0] * 64}"
        statuses.append(
            V1ContainerStatus(name=cname, image=cname, image_id=image, ready=False, restart_count=0, state=st)
        )
    main = next(iter(containers))
    return V1Pod(
        metadata=V1ObjectMeta(
            name=name,
            labels={"job-name": "openlab-x-1"},
            annotations={"kubectl.kubernetes.io/default-container": main},
            creation_timestamp=start,
        ),
        spec=V1PodSpec(containers=[V1Container(name=c) for c in containers], active_deadline_seconds=5),
        status=V1PodStatus(phase=phase, reason=reason, start_time=start, container_statuses=statuses),
    )


def test_status_is_the_main_containers_and_ends_at_the_first_pod_past_its_time_limit() -> None:
    """Read from the pods alone: a pod past its deadline whose main container still runs (saving,
    within the grace period) is RUNNING; once it has ended the job is at its time limit, even while
    the Job controller (backoffLimit) runs a new pod, which is not counted; a sidecar's exit code and
    image are never the job's, whatever order the kubelet lists the containers in."""
    from kubernetes.client import V1Job, V1JobCondition, V1JobSpec, V1JobStatus, V1ObjectMeta, V1PodTemplateSpec

    from orchestrator.launchers import JobHandle

    launcher = get_launcher("kubernetes", host="http://127.0.0.1:9", measure_usage=False)
    handle = JobHandle("kubernetes", "default/openlab-x-1")
    job = V1Job(
        metadata=V1ObjectMeta(name="openlab-x-1", annotations={}),
        spec=V1JobSpec(template=V1PodTemplateSpec(), backoff_limit=2),
        status=V1JobStatus(active=1, failed=1),
    )
    saving = _pod(
        "a",
        phase="Failed",
        reason="DeadlineExceeded",
        containers={"job": ("running",), "istio-proxy": ("running",)},
        created=0,
    )
    assert launcher._status_of(handle, job, [saving]).state is JobState.RUNNING
    stopped = _pod(
        "a",
        phase="Failed",
        reason="DeadlineExceeded",
        containers={"job": ("terminated", 143), "istio-proxy": ("terminated", 0)},
        created=0,
    )
    again = _pod("b", phase="Running", containers={"job": ("running",), "istio-proxy": ("running",)}, created=1)
    status = launcher._status_of(handle, job, [stopped, again])
    assert (status.state, status.exit_code, status.reason) == (JobState.FAILED, 143, "time limit exceeded (5s)")
    assert status.image_digest == f"docker-pullable://job@sha256:{'j' * 64}", "the main container's image"
    assert status.started_at == stopped.status.start_time

    failed = _pod(
        "c", phase="Failed", containers={"job": ("terminated", 3), "log-shipper": ("terminated", 0)}, created=0
    )
    job.status = V1JobStatus(
        failed=1, conditions=[V1JobCondition(type="Failed", status="True", reason="BackoffLimitExceeded")]
    )
    status = launcher._status_of(handle, job, [failed])
    assert (status.state, status.exit_code) == (JobState.FAILED, 3), status
    assert status.reason == "exit code 3 (BackoffLimitExceeded)"
    assert status.image_digest == f"docker-pullable://job@sha256:{'j' * 64}", "not the log shipper's, listed last"
