"""Multi-task jobs: N nodes × M tasks under srun (or M processes on one machine, container or pod),
each told its place, one outcome.

A distributed training job is several processes that must find each other (torch.distributed's
``env://``: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), die together when one crashes, and leave
one record that says which process failed. Against the real single-node cluster (two tasks on
its node) with real ``torch.distributed`` over gloo.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from orchestrator.errors import ConfigError
from orchestrator.launchers import JobHandle, JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.lineage.models import Attempt
from orchestrator.lineage.store import LineageStore
from tests.launchers.harness import Harness

#: Every task adds its rank + 1 into one all-reduce: 3 on two tasks, only if they found each other.
ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} of {world} local {os.environ['LOCAL_RANK']} of {os.environ['LOCAL_WORLD_SIZE']} "
      f"node {os.environ['NODE_RANK']} sum {total.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slurm
def test_tasks_find_each_other_and_all_reduce(slurm_harness: Harness, store: LineageStore) -> None:
    lines: list[str] = []
    attempt, status = run_job(
        store,
        slurm_harness.launcher,
        JobSpec(name="ddp", command=[sys.executable, "-c", ALL_REDUCE], cpus=1, tasks_per_node=2),
        on_log=lines.append,
        timeout=120,
    )
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0, (status, lines)
    # srun --label: each line says which task wrote it
    assert sorted(line for line in lines if " sum " in line) == [
        "0: rank 0 of 2 local 0 of 2 node 0 sum 3",
        "1: rank 1 of 2 local 1 of 2 node 0 sum 3",
    ], lines
    stored = store.require(Attempt, attempt.id)
    assert stored.resources is not None
    assert (stored.resources["nodes"], stored.resources["tasks_per_node"]) == (1, 2)
    script = slurm_harness.launcher.batch_script(JobSpec(name="x", command=["t"], tasks_per_node=2), "slurm-%j.log")
    assert "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=2" in script, script


@pytest.mark.slurm
def test_one_task_failing_ends_the_job_with_its_own_code_and_names_it(
    slurm_harness: Harness, store: LineageStore
) -> None:
    """Task 1 crashes while task 0 waits in what would be a collective: task 0 is stopped (not left
    holding the node until its time limit), and the job fails with task 1's exit code, not the 143
    of the task srun stopped, so it is not mistaken for a preemption."""
    crash = "import os, sys, time\nif os.environ['RANK'] == '1':\n    time.sleep(0.5); sys.exit(3)\ntime.sleep(300)"
    attempt, status = run_job(
        store,
        slurm_harness.launcher,
        JobSpec(name="crash", command=[sys.executable, "-c", crash], tasks_per_node=2),
        timeout=90,
    )
    assert status.state is JobState.FAILED and status.exit_code == 3, status
    assert status.reason and "task 1 of 2 on " in status.reason and "failed first (exit 3)" in status.reason
    stored = store.require(Attempt, attempt.id)
    assert stored.state == "FAILED" and stored.exit_code == 3 and "task 1 of 2" in (stored.reason or "")
    assert slurm_harness.nothing_running(JobHandle("slurm", str(attempt.job_id))) == []


@pytest.mark.slurm
def test_every_task_stopped_from_outside_is_a_preemption(slurm_harness: Harness, store: LineageStore) -> None:
    """Slurm's preemption (or a spot reclaim) signals every task: the job exits 143 and the attempt is
    PREEMPTED, as for a one-task job, so the stage is resumed rather than failed."""
    started = threading.Event()

    def on_log(line: str) -> None:
        if "waiting" in line and not started.is_set():
            started.set()
            job_id = _job_named("stop-me")
            subprocess.run(["scancel", "--signal=TERM", job_id], check=True)  # every step, as preemption does

    wait = "import signal, sys, time\nprint('waiting', flush=True)\ntime.sleep(300)"
    attempt, status = run_job(
        store,
        slurm_harness.launcher,
        JobSpec(name="stop-me", command=[sys.executable, "-c", wait], tasks_per_node=2),
        on_log=lambda line: threading.Thread(target=on_log, args=(line,)).start(),
        timeout=90,
    )
    assert status.state is JobState.PREEMPTED and status.exit_code == 143, status
    assert store.require(Attempt, attempt.id).state == "PREEMPTED"


def _run_then_scancel(harness: Harness, store: LineageStore, spec: JobSpec, *scancel: str) -> tuple[list[str], Any]:
    """Run ``spec`` on Slurm and, once every task has said "waiting", ``scancel ARGS JOB`` (from a
    thread of its own: the log pump must not wait for it). The log lines and the end status."""
    lines: list[str] = []
    sent = threading.Event()

    def on_log() -> None:
        if sum(line.endswith("waiting") for line in lines) == spec.tasks and not sent.is_set():
            sent.set()
            subprocess.run(["scancel", *scancel, _job_named(spec.name)], check=True)

    def record(line: str) -> None:
        lines.append(line)
        threading.Thread(target=on_log).start()

    _, status = run_job(store, harness.launcher, spec, on_log=record, timeout=90)
    return lines, status


@pytest.mark.slurm
def test_a_signal_to_the_batch_script_reaches_every_task(slurm_harness: Harness, store: LineageStore) -> None:
    """`--signal=B:USR1@300` (Slurm's warning ahead of the time limit) signals the batch script
    only: it goes on to srun and from there to every task, which saves and stops; the attempt is
    PREEMPTED (a stop from outside), not left to run into the limit."""
    wait = (
        "import os, signal, sys, time\n"
        "def stop(signum, frame):\n"
        "    print('rank', os.environ['RANK'], 'got', signal.Signals(signum).name, flush=True)\n"
        "    sys.exit(128 + signum)\n"
        "signal.signal(signal.SIGUSR1, stop)\nprint('waiting', flush=True)\ntime.sleep(300)"
    )
    spec = JobSpec(name="warned", command=[sys.executable, "-c", wait], tasks_per_node=2)
    lines, status = _run_then_scancel(slurm_harness, store, spec, "--batch", "--signal=USR1")
    assert sorted(line for line in lines if " got " in line) == ["0: rank 0 got SIGUSR1", "1: rank 1 got SIGUSR1"]
    assert status.state is JobState.PREEMPTED and status.exit_code == 138, status


@pytest.mark.slurm
def test_an_interrupt_reaches_every_task_with_pythons_default_handling(
    slurm_harness: Harness, store: LineageStore
) -> None:
    """`scancel --signal=INT` signals the job's steps. Each task ran in the background of a bash,
    which starts it with SIGINT ignored: Python then sets up no KeyboardInterrupt, and the tasks
    slept on. Not measured here, so no wrapper stands between (it resets SIGINT for its command)."""
    wait = (
        "import os, sys, time\nprint('waiting', flush=True)\n"
        "try:\n    time.sleep(120)\n"
        "except KeyboardInterrupt:\n    print('rank', os.environ['RANK'], 'interrupted', flush=True)\n    sys.exit(130)"
    )
    spec = JobSpec(
        name="interrupted",
        command=[sys.executable, "-c", wait],
        tasks_per_node=2,
        options={"measure_usage": False},
    )
    lines, status = _run_then_scancel(slurm_harness, store, spec, "--signal=INT")
    assert sorted(x for x in lines if "interrupted" in x) == ["0: rank 0 interrupted", "1: rank 1 interrupted"], lines
    assert status.exit_code == 130, status


def _job_named(name: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, check=False)
        if out.stdout.split():
            return out.stdout.split()[0]
        time.sleep(0.1)
    raise AssertionError(f"no job named {name} in the queue")


IN_CONTAINERS = [pytest.param(b, marks=pytest.mark.docker) for b in ("docker", "kubernetes")]


@pytest.mark.parametrize("backend", ["local", *IN_CONTAINERS])
def test_one_machine_tasks_find_each_other_and_a_failure_names_its_task(
    backend: str, store: LineageStore, request: pytest.FixtureRequest
) -> None:
    """Local processes, or processes in one container or one pod, run a job's tasks with srun's
    contract: the same program all-reduces across them, and the task that fails first gives the
    job its exit code and is named in the attempt."""
    from orchestrator.settings import load_settings
    from tests.conftest import REPO_ROOT

    overrides: dict = {}
    if backend != "local":
        from tests.services import require_docker

        require_docker()
    if backend == "kubernetes":  # pods as containers of the job image, on the emulated cluster
        cluster = request.getfixturevalue("k8s_cluster")
        assert cluster.runtime == "docker", cluster.runtime_reason
        overrides = {"host": cluster.url}
    launcher = get_launcher(backend, **overrides)
    launcher.poll_interval = min(launcher.poll_interval, 0.5)
    python = sys.executable if backend == "local" else "python"  # the image's, with torch and openlab
    where = {"workdir": str(REPO_ROOT), "artifact_root": load_settings().artifacts_dir}  # as `openlab job run`
    lines: list[str] = []
    spec = JobSpec(name="ddp", command=[python, "-c", ALL_REDUCE], tasks_per_node=2, **where)
    _, status = run_job(store, launcher, spec, on_log=lines.append, timeout=180)
    assert status.state is JobState.SUCCEEDED, (status, lines)
    assert sorted(line for line in lines if " sum " in line) == [
        "0: rank 0 of 2 local 0 of 2 node 0 sum 3",
        "1: rank 1 of 2 local 1 of 2 node 0 sum 3",
    ], lines
    crash = "import os, sys, time\nif os.environ['RANK'] == '1':\n    time.sleep(0.5); sys.exit(3)\ntime.sleep(300)"
    spec = JobSpec(name="crash", command=[python, "-c", crash], tasks_per_node=2, **where)
    attempt, status = run_job(store, launcher, spec, timeout=90)
    assert status.state is JobState.FAILED and status.exit_code == 3, status
    assert "task 1 of 2 on " in (attempt.reason or "") and "failed first (exit 3)" in (attempt.reason or "")


@pytest.mark.docker
def test_a_docker_job_of_several_tasks_runs_in_an_image_without_openlab(store: LineageStore) -> None:
    """The launcher copies its own task runner (stdlib only) into the container, so a lab's own image
    (here the bare Python base image, which has no openlab) runs a job of two tasks; before, the
    container ran `python -m orchestrator.launchers._tasks` and failed with no such module."""
    from tests.services import docker_image

    base = docker_image("base")
    launcher = get_launcher("docker", image=base)
    launcher.poll_interval = 0.2
    lines: list[str] = []
    tell = (
        "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'] != '')"
    )
    spec = JobSpec(name="two", command=["python", "-c", tell], image=base, tasks_per_node=2)
    _, status = run_job(store, launcher, spec, on_log=lines.append, timeout=120)
    assert status.state is JobState.SUCCEEDED, (status, lines)
    assert sorted(line for line in lines if "rank" in line) == ["0: rank 0 of 2 True", "1: rank 1 of 2 True"], lines


#: Each task burns 0.3 s of CPU (so the job's usage has something to add up), then says where it is.
BURN_AND_TELL = (
    "import os, time; t = time.process_time()\n"
    "while time.process_time() - t < 0.3: pass\n"
    "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'] != '', flush=True)"
)


@pytest.mark.docker
def test_a_kubernetes_job_of_several_tasks_runs_in_an_image_without_openlab(
    k8s_cluster: Any, store: LineageStore
) -> None:
    """A pod cannot mount a folder of this host, so the launcher sends its own copies of the task
    runner and the usage wrapper in a ConfigMap owned by the Job, mounted read-only at /.openlab:
    two tasks in the bare Python base image (no openlab) find their ranks and the job's usage is
    measured. Before, the pod ran `python -m orchestrator.launchers._tasks` (no such module there).
    The ConfigMap goes when the Job goes."""
    from orchestrator.launchers.kubernetes import helpers_name
    from tests.services import docker_image

    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    base = docker_image("base")
    launcher = get_launcher("kubernetes", host=k8s_cluster.url, image=base, measure_usage=True)
    launcher.poll_interval = 0.2
    spec = JobSpec(name="two", command=["python", "-c", BURN_AND_TELL], image=base, tasks_per_node=2)
    lines: list[str] = []
    running: list[tuple[dict[str, str], dict[str, list[str]]]] = []

    def seen(line: str) -> None:
        lines.append(line)
        if not running:  # while the Job runs: its ConfigMap, owned by it
            jobs = {name: job["metadata"]["uid"] for (_, name), job in k8s_cluster.jobs().items() if "-two-" in name}
            owned = {
                name: [ref["uid"] for ref in (k8s_cluster.configmap(ns, name) or {})["metadata"]["ownerReferences"]]
                for ns, name in k8s_cluster.configmaps()
                if "-two-" in name
            }
            running.append((jobs, owned))

    attempt, status = run_job(store, launcher, spec, on_log=seen, timeout=120)
    assert status.state is JobState.SUCCEEDED, (status, lines)
    assert sorted(line for line in lines if "rank" in line) == ["0: rank 0 of 2 True", "1: rank 1 of 2 True"], lines
    jobs, owned = running[0]
    assert owned == {helpers_name(name): [uid] for name, uid in jobs.items()} and len(jobs) == 1, running
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 0.6, used  # both tasks', under the mounted wrapper
    assert not [n for _, n in k8s_cluster.configmaps() if "-two-" in n], "deleted with the Job"


#: Each task counts the SIGTERMs it gets, says so, and ends a moment after the first (time for a second).
COUNT_STOPS = """
import os, signal, sys, time
got = []
def on_term(signum, frame):
    got.append(signum)
    print(f"rank {os.environ['RANK']} got SIGTERM {len(got)}", flush=True)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
start = time.time()
while not got and time.time() - start < 60:
    time.sleep(0.05)
time.sleep(1.5 if os.environ["RANK"] == "0" else 0)  # rank 0 saves a checkpoint; rank 1 stops at once
sys.exit(143)
"""


BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker), pytest.param("slurm", marks=pytest.mark.slurm)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_multi_task_job_that_is_cancelled_tells_each_task_once(backend: str, store: LineageStore) -> None:
    """A cancel (or a time limit) of a job of several tasks on one machine reaches each task once, as
    srun delivers it: the supervisor (local) or the container's stop, through the usage wrapper and
    `timeout` (Docker), signals the task runner, which passes it on; on Slurm, where every process
    of the step is signalled, the batch script's task wrappers and usage wrappers pass nothing on.
    A task told twice could have its checkpoint save cut short by the second: rank 1 ends (143) while
    rank 0 still saves, and the runner must not take that for a failure and stop rank 0 again."""
    if backend == "docker":
        from tests.services import docker_image

        launcher = get_launcher("docker", image=docker_image("job"), grace=10)
        python, limit = "python", 120  # a time limit: the job runs under `timeout` too
    elif backend == "slurm":  # srun's tasks, each under the usage wrapper, which passes nothing on
        from tests.services import require_slurm

        require_slurm()
        launcher, python, limit = get_launcher("slurm"), sys.executable, None
    else:
        launcher, python, limit = get_launcher("local"), sys.executable, None
    handle = launcher.submit(
        JobSpec(name="stops", command=[python, "-c", COUNT_STOPS], tasks_per_node=2, time_limit=limit)
    )
    try:
        deadline = time.monotonic() + 60
        while sum("ready" in line for line in launcher.logs(handle)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher.cancel(handle)
    finally:
        launcher.cleanup(handle)
    told = sorted(line for line in launcher.logs(handle) if "got SIGTERM" in line)
    assert told == ["0: rank 0 got SIGTERM 1", "1: rank 1 got SIGTERM 1"], list(launcher.logs(handle))
    assert launcher.status(handle).state is JobState.CANCELLED


@pytest.mark.docker
def test_kubernetes_runs_several_nodes_as_an_indexed_job_whose_pods_find_each_other(
    store: LineageStore, request: pytest.FixtureRequest
) -> None:
    """Two nodes × two tasks: an indexed Job of two pods and a headless Service naming them. The
    pods' tasks meet at pod 0 by its DNS name and all-reduce as one world of 4, their lines labelled
    with global ranks arrive in the attempt's log, and the Service goes with the Job. A task that
    crashes on node 1 fails the Job with its own exit code and name; node 0's pod is stopped."""
    from orchestrator.settings import load_settings
    from tests.conftest import REPO_ROOT
    from tests.services import require_docker

    require_docker()
    cluster = request.getfixturevalue("k8s_cluster")
    assert cluster.runtime == "docker", cluster.runtime_reason
    launcher = get_launcher("kubernetes", host=cluster.url)
    launcher.poll_interval = 0.5
    where = {"workdir": str(REPO_ROOT), "artifact_root": load_settings().artifacts_dir}
    shape = {"nodes": 2, "tasks_per_node": 2, "cpus": 0.5}

    manifest = launcher.manifest(JobSpec(name="ddp", command=["python", "-c", "pass"], **shape, **where), "j")
    assert (manifest["spec"]["completionMode"], manifest["spec"]["completions"]) == ("Indexed", 2)
    assert manifest["spec"]["template"]["spec"]["subdomain"] == "j"
    assert manifest["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "1", "per pod"

    lines: list[str] = []
    seen_services: list[list] = []
    spec = JobSpec(name="ddp", command=["python", "-c", ALL_REDUCE], **shape, **where)
    attempt, status = run_job(
        store,
        launcher,
        spec,
        on_log=lambda line: (lines.append(line), seen_services.append(cluster.services())),
        timeout=180,
    )
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0, (status, lines)
    assert sorted(line for line in lines if " sum " in line) == [
        "0: rank 0 of 4 local 0 of 2 node 0 sum 10",
        "1: rank 1 of 4 local 1 of 2 node 0 sum 10",
        "2: rank 2 of 4 local 0 of 2 node 1 sum 10",
        "3: rank 3 of 4 local 1 of 2 node 1 sum 10",
    ], lines
    namespace, name = attempt.job_id.split("/", 1)
    assert (namespace, name) in seen_services[0], "the Service named the pods while they ran"
    assert (namespace, name) not in cluster.services(), "and went with the Job"
    stored = store.require(Attempt, attempt.id)
    assert stored.resources is not None and (stored.resources["nodes"], stored.resources["tasks_per_node"]) == (2, 2)
    # what the four tasks used, from both pods' termination messages (summed by the launcher)
    assert stored.used is not None and stored.used["cpu_seconds"] > 0 and stored.used["max_rss_bytes"] > 0

    crash = "import os, sys, time\nif os.environ['RANK'] == '3':\n    time.sleep(0.5); sys.exit(3)\ntime.sleep(300)"
    attempt, status = run_job(
        store, launcher, JobSpec(name="crash", command=["python", "-c", crash], **shape, **where), timeout=120
    )
    assert status.state is JobState.FAILED and status.exit_code == 3, status
    reason = attempt.reason or ""
    assert "task 3 of 4 on " in reason and "failed first (exit 3)" in reason, reason
    assert "-1-" in reason.split("pod ", 1)[1].split(" ", 1)[0], f"the pod of index 1 ended the job: {reason}"
    assert not cluster.workload_alive(attempt.job_id), "node 0's pod was stopped, not left sleeping"

    sleep = JobSpec(name="sleep", command=["python", "-c", "import time; time.sleep(300)"], **shape, **where)
    # Kubernetes evicts node 1's pod (a drained node, a preempting higher-priority pod): the Job
    # fails, node 0's pod is stopped with it, and the attempt is a preemption, not a failure.
    handle = launcher.submit(sleep)
    try:
        deadline = time.monotonic() + 60
        while launcher.status(handle).state is not JobState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.evict(handle.job_id, index=1, grace=5.0)
        deadline = time.monotonic() + 60
        while not (status := launcher.status(handle)).state.terminal and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status.state is JobState.PREEMPTED, status
        assert (status.reason or "").startswith("pod stopped by Kubernetes: EvictionByEvictionAPI"), status.reason
        assert not cluster.workload_alive(handle.job_id), "node 0's pod went with the evicted one"
    finally:
        launcher.cleanup(handle)

    handle = launcher.submit(sleep)
    try:
        deadline = time.monotonic() + 60
        while launcher.status(handle).state is not JobState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.workload_alive(handle.job_id) and tuple(handle.job_id.split("/")) in cluster.services()
    finally:
        launcher.cancel(handle)
    assert launcher.status(handle).state is JobState.CANCELLED
    assert not cluster.workload_alive(handle.job_id), "cancel stops every node's pod"
    assert tuple(handle.job_id.split("/")) not in cluster.services(), "and deletes the Service"

    # The Service is owned by the Job, so Kubernetes deletes it with the Job even when openlab does
    # not (a TTL, `kubectl delete job`): the garbage collector follows ownerReferences by uid.
    handle = launcher.submit(sleep)
    namespace, name = handle.job_id.split("/", 1)
    try:
        uid = cluster.jobs()[(namespace, name)]["metadata"]["uid"]
        service = cluster.service(namespace, name)
        assert service is not None and service["metadata"]["ownerReferences"] == [
            {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "blockOwnerDeletion": False}
        ], service
        launcher.batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        deadline = time.monotonic() + 30
        while cluster.service(namespace, name) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.service(namespace, name) is None, "the Service went with its owner"
    finally:
        launcher.cancel(handle)


@pytest.mark.parametrize(
    ("backend", "ask", "message"),
    [
        ("local", {"nodes": 2}, "the local backend runs a job on one machine, and this job asks for 2 nodes"),
        ("docker", {"nodes": 2}, "the docker backend runs a job on one machine, and this job asks for 2 nodes"),
    ],
)
def test_backends_refuse_what_they_cannot_run_before_recording_anything(
    backend: str, ask: dict, message: str, store: LineageStore
) -> None:
    launcher = get_launcher(backend)
    with pytest.raises(ConfigError, match=message):
        run_job(store, launcher, JobSpec(name="x", command=["true"], **ask))
    assert store.list(Attempt) == [], "a job that cannot run as asked leaves no attempt"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"nodes": 0}, "nodes must be a whole number of at least 1"),
        ({"tasks_per_node": -1}, "tasks per node must be a whole number of at least 1"),
        ({"nodes": 1.5}, "nodes must be a whole number of at least 1"),
        ({"tasks_per_node": True}, "tasks per node must be a whole number of at least 1"),
        ({"cpus": -1}, "cpus must be a positive number, got -1"),  # was accepted and ran as if unset
        ({"cpus": 0}, "cpus must be a positive number"),
        ({"gpus": -1}, "gpus must be a whole number of 0 or more"),
        ({"gpus": 0.5}, "gpus must be a whole number of 0 or more"),
    ],
)
def test_task_counts_and_resources_are_checked(bad: dict, message: str) -> None:
    from orchestrator.errors import OpenlabError

    with pytest.raises(OpenlabError, match=message):
        JobSpec(name="x", command=["true"], **bad)
