"""A container job's attempt records what the job used, measured inside its container by the usage
wrapper (launchers/_usage.py, the job command's parent): the container's cgroup is gone once it
exits. Docker: the real engine; Kubernetes: the emulated cluster, whose pods are containers on it
and whose kubelet part returns the termination message. Both run the project's job image, which
names its interpreter in ``openlab.io/python``."""

from __future__ import annotations

import time

import pytest

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.base import JobHandle
from orchestrator.launchers.docker import USAGE_LABEL
from orchestrator.launchers.kubernetes import TERMINATION_MESSAGE_PATH
from orchestrator.lineage import Attempt, LineageStore
from tests.launchers.k8s_emulator import EmulatedCluster
from tests.launchers.test_local_usage import HUNGRY
from tests.services import docker_image

pytestmark = [pytest.mark.docker]


def test_a_docker_job_records_its_peak_memory_and_cpu_time(store: LineageStore) -> None:
    image = docker_image("job")
    launcher = get_launcher("docker", image=image)  # measure_usage = "auto": the image names its python
    attempt, status = run_job(store, launcher, JobSpec(name="hungry", command=["python", "-c", HUNGRY]), timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 0.6, used
    assert 256 * 2**20 <= used["max_rss_bytes"] < 2**30, used

    # the container is removed; the final status still says what it used
    assert attempt.job_id is not None
    assert launcher.status(JobHandle("docker", attempt.job_id)).usage == used

    # two tasks in one container: the wrapper waits for the task runner, which waits for both
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="hungry2", command=["python", "-c", HUNGRY], tasks_per_node=2),
        timeout=120,
    )
    assert status.state is JobState.SUCCEEDED, status
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 1.2 and used["max_rss_bytes"] >= 256 * 2**20, used


def test_a_job_run_as_another_user_still_records_what_it_used(store: LineageStore) -> None:
    """The helpers' folder is copied in writable by anyone: a job run as an unprivileged user
    (``user = "65534:65534"``, nobody) runs its two tasks and its wrapper writes its record."""
    launcher = get_launcher("docker", image=docker_image("job"), user="65534:65534")
    spec = JobSpec(name="nobody", command=["python", "-c", HUNGRY], tasks_per_node=2)
    attempt, status = run_job(store, launcher, spec, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 1.2, used


def test_cleanup_also_removes_the_folder_an_older_openlab_kept_for_the_job() -> None:
    """Before the task runner was mounted too, the per-job folder was ``usage/<job>``; a job that ran
    across the upgrade is cleaned up from there as well, not left behind for good (and the job's
    folder of today, ``mounted/<job>``, goes too)."""
    launcher = get_launcher("docker", image=docker_image("job"))
    handle = launcher.submit(JobSpec(name="upgraded", command=["true"]))
    old = launcher.state_dir / "usage" / handle.job_id
    old.mkdir(parents=True)
    (old / "usage.json").write_text("{}")
    assert (launcher.state_dir / "mounted" / handle.job_id / "usage.py").is_file()
    assert launcher.wait(handle, timeout=60).state is JobState.SUCCEEDED
    launcher.cleanup(handle)
    assert not old.exists() and not (launcher.state_dir / "mounted" / handle.job_id).exists()


def test_the_wrapper_keeps_the_jobs_exit_code_and_is_left_out_where_it_cannot_run(store: LineageStore) -> None:
    image = docker_image("job")
    launcher = get_launcher("docker", image=image)
    attempt, status = run_job(store, launcher, JobSpec(name="fails", command=["sh", "-c", "exit 3"]), timeout=120)
    assert (status.state, status.exit_code, status.reason) == (JobState.FAILED, 3, "exit code 3"), status
    assert store.require(Attempt, attempt.id).used is not None  # a failed job's use is kept too

    # an image that names no interpreter (the small base image) runs the command as it is
    base = docker_image("base")
    plain = get_launcher("docker", image=base)
    handle = plain.submit(JobSpec(name="plain", command=["sh", "-c", "exit 0"], image=base))
    try:
        assert USAGE_LABEL not in plain.client.containers.get(handle.job_id).labels
        assert plain.wait(handle, timeout=60).state is JobState.SUCCEEDED
    finally:
        plain.cleanup(handle)
    # and measure_usage = false turns it off for an image that could run it
    off = get_launcher("docker", image=image, measure_usage=False)
    attempt, status = run_job(store, off, JobSpec(name="off", command=["true"]), timeout=120)
    assert status.state is JobState.SUCCEEDED and store.require(Attempt, attempt.id).used is None


def test_a_cancelled_job_under_the_wrapper_is_told_to_stop_and_may_save_first(store: LineageStore) -> None:
    """docker stop's SIGTERM reaches the job's own process through the wrapper, so a workload
    saves its checkpoint before it ends, as it does without the wrapper."""
    image = docker_image("job")
    launcher = get_launcher("docker", image=image, grace=10)
    lines: list[str] = []
    script = 'trap "echo saving; sleep 1; echo saved; exit 143" TERM; echo started; while :; do sleep 0.1; done'
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="saver", command=["sh", "-c", script]),
        on_log=lines.append,
        should_cancel=lambda: "started" in lines,
        timeout=120,
    )
    assert status.state is JobState.CANCELLED, status
    assert attempt.job_id is not None
    log = "\n".join(launcher.logs(JobHandle("docker", attempt.job_id)))
    assert "saved" in log, log
    assert store.require(Attempt, attempt.id).used is not None  # the wrapper outlived its job and wrote


def test_a_kubernetes_job_reports_what_it_used_in_its_termination_message(
    k8s_cluster: EmulatedCluster, store: LineageStore
) -> None:
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image)
    launcher.poll_interval = 0.1
    spec = JobSpec(name="hungry", command=["python", "-c", HUNGRY])
    command = launcher.manifest(spec, "probe")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:6] == ["python", "-I", "-S", "/.openlab/usage.py", TERMINATION_MESSAGE_PATH, "--"]
    attempt, status = run_job(store, launcher, spec, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 0.6, used
    assert 256 * 2**20 <= used["max_rss_bytes"] < 2**30, used
    assert attempt.job_id is not None
    assert launcher.status(JobHandle("kubernetes", attempt.job_id)).usage == used  # kept once the Job is gone

    # a failing job's use is kept too, and its exit code is the command's
    attempt, status = run_job(store, launcher, JobSpec(name="fails", command=["sh", "-c", "exit 3"]), timeout=120)
    assert status.state is JobState.FAILED and status.exit_code == 3, status
    assert store.require(Attempt, attempt.id).used is not None

    off = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=False)
    assert off.manifest(spec, "probe")["spec"]["template"]["spec"]["containers"][0]["command"] == spec.command

    # without the helpers ConfigMap, the image's own copy of the wrapper
    own = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, helpers_configmap=False)
    pod = own.manifest(spec, "probe")["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][:5] == [
        "python",
        "-m",
        "orchestrator.launchers._usage",
        TERMINATION_MESSAGE_PATH,
        "--",
    ]
    assert "volumes" not in pod and own.helpers_manifest(own.manifest(spec, "probe")) is None
    attempt, status = run_job(store, own, spec, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    assert store.require(Attempt, attempt.id).used is not None


def test_the_pods_of_an_indexed_job_add_up_their_cpu_and_keep_the_largest_peak() -> None:
    from types import SimpleNamespace as NS

    from orchestrator.launchers.kubernetes import _pods_usage

    def pod(message: str | None) -> NS:
        terminated = NS(message=message)
        return NS(status=NS(container_statuses=[NS(state=NS(terminated=terminated))]))

    pods = [
        pod('{"cpu_seconds": 1.25, "max_rss_bytes": 100}'),
        pod('{"cpu_seconds": 2.5, "max_rss_bytes": 300}'),
        pod(None),  # killed with its job: no message
        pod("not json: a message the job wrote itself"),
    ]
    assert _pods_usage(pods) == {"cpu_seconds": 3.75, "max_rss_bytes": 300}
    assert _pods_usage([pod(None)]) is None


#: Counts the SIGTERMs it is sent while it runs 3 s, then says how many.
COUNTS_TERMS = (
    "import signal, time\n"
    "n = [0]\n"
    "signal.signal(signal.SIGTERM, lambda s, f: n.__setitem__(0, n[0] + 1))\n"
    "print('started', flush=True)\n"
    "t = time.time()\n"
    "while time.time() - t < 3: time.sleep(0.01)\n"
    "print('TERMs', n[0], flush=True)\n"
)


@pytest.mark.parametrize("measure_usage", [True, False], ids=["wrapper", "no-wrapper"])
@pytest.mark.parametrize("how", ["cancel", "time-limit"])
def test_a_docker_job_is_told_to_stop_once(how: str, measure_usage: bool) -> None:
    """A workload that saves on the first SIGTERM and quits on the second (a common pattern) must
    get one. GNU timeout signals its child and then its whole process group, so the job heard a
    cancel or its time limit twice (and three times under a wrapper that passes signals on);
    timeout --foreground, with the usage wrapper outside it, tells the job once."""
    image = docker_image("job")
    launcher = get_launcher("docker", image=image, grace=5, measure_usage=measure_usage)
    limit = 30 if how == "cancel" else 1
    handle = launcher.submit(JobSpec(name="counts", command=["python", "-c", COUNTS_TERMS], time_limit=limit))
    try:
        if how == "cancel":
            deadline = time.monotonic() + 60
            while "started" not in list(launcher.logs(handle)) and time.monotonic() < deadline:
                time.sleep(0.1)
            launcher.cancel(handle)
        status = launcher.wait(handle, timeout=60)
        assert status.state is (JobState.CANCELLED if how == "cancel" else JobState.FAILED), status
        assert "TERMs 1" in list(launcher.logs(handle)), list(launcher.logs(handle))
    finally:
        launcher.cleanup(handle)


def test_an_evicted_kubernetes_pod_under_the_wrapper_tells_its_job_once(k8s_cluster: EmulatedCluster) -> None:
    """The kubelet's SIGTERM goes to the container's first process, the usage wrapper, which passes
    it on to the job once."""
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image)
    launcher.poll_interval = 0.1
    handle = launcher.submit(JobSpec(name="counts", command=["python", "-c", COUNTS_TERMS]))
    try:
        deadline = time.monotonic() + 60
        while "started" not in list(launcher.logs(handle)) and time.monotonic() < deadline:
            time.sleep(0.1)
        k8s_cluster.evict(handle.job_id, grace=10.0)
        status = launcher.wait(handle, timeout=60)
        assert status.state.terminal, status
        assert "TERMs 1" in list(launcher.logs(handle)), list(launcher.logs(handle))
    finally:
        launcher.cleanup(handle)


#: Leaves an orphan that burns 0.5 s of CPU and ends, waits until it is gone (reaped: a zombie stays
#: in /proc), then counts the zombies in the container.
ORPHAN = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        start = time.process_time()
        while time.process_time() - start < 0.5:
            pass
        os._exit(0)
    os._exit(0)
os.wait()
orphan = int(os.read(r, 32))
deadline = time.monotonic() + 60  # until it has used its 0.5 s and is reaped, however loaded the machine
while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
    time.sleep(0.05)
def state(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]
print("zombies", sum(state(p) == "Z" for p in os.listdir("/proc") if p.isdigit()), flush=True)
"""


def test_a_kubernetes_pods_wrapper_reaps_orphans_and_counts_them(
    k8s_cluster: EmulatedCluster, store: LineageStore
) -> None:
    """A pod has no docker-init: the wrapper is its first process, so every orphan in the
    container becomes its child. Left unreaped they stay zombies until the pod ends (a job that
    keeps starting daemonised helpers fills the process table); reaped, what they used counts."""
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image)
    launcher.poll_interval = 0.1
    lines: list[str] = []
    spec = JobSpec(name="orphans", command=["python", "-c", ORPHAN])
    attempt, status = run_job(store, launcher, spec, on_log=lines.append, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    assert "zombies 0" in lines, lines
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 0.5, used  # the orphan's, which the job never waited for


#: Leaves an orphan, counts the zombies, then waits with no SIGTERM handler of its own.
UNHANDLED = (
    ORPHAN
    + """
print("started", flush=True)
time.sleep(120)
"""
)


def test_a_kubernetes_pod_without_the_wrapper_is_not_its_own_init(k8s_cluster: EmulatedCluster) -> None:
    """Without the usage wrapper the command would be the pod's PID 1: the kernel gives PID 1 no
    default action for SIGTERM, so a job without a handler of its own would ignore an eviction or
    a cancel until SIGKILL at the end of the grace period (137, no chance to end cleanly), and its
    orphans would stay zombies. The pod shares its process namespace instead: the pause container
    is PID 1 and reaps, and SIGTERM ends the job (143)."""
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=False)
    launcher.poll_interval = 0.1
    spec = JobSpec(name="plain", command=["python", "-c", UNHANDLED])
    assert launcher.manifest(spec, "probe")["spec"]["template"]["spec"]["shareProcessNamespace"] is True
    handle = launcher.submit(spec)
    try:
        deadline = time.monotonic() + 60
        while "started" not in list(launcher.logs(handle)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "zombies 0" in list(launcher.logs(handle)), list(launcher.logs(handle))
        k8s_cluster.evict(handle.job_id, grace=20.0)
        status = launcher.wait(handle, timeout=60)
        assert status.state is JobState.PREEMPTED and status.exit_code == 143, status
    finally:
        launcher.cleanup(handle)

    measured = get_launcher("kubernetes", host=k8s_cluster.url, image=k8s_cluster.image, measure_usage=True)
    assert "shareProcessNamespace" not in measured.manifest(spec, "probe")["spec"]["template"]["spec"]
