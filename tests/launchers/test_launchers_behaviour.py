"""One behavioural suite, the same assertions for every backend (see conftest.Harness)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.launchers import JobHandle, JobSpec, JobState, JobStatus
from orchestrator.launchers.attempts import handle_from_attempt, run_job
from orchestrator.lineage.models import Attempt, StageRun
from orchestrator.lineage.store import LineageStore
from tests.launchers.harness import BACKENDS, Harness

TIME_LIMIT_BACKENDS = [
    p if p.id != "slurm" else pytest.param("slurm", id="slurm", marks=[pytest.mark.slurm, pytest.mark.slow])
    for p in BACKENDS
]

EXPECTED_JOB_ID = {
    "local": r"^local-[0-9a-f]{12}$",
    "docker": r"^openlab-[a-z0-9-]+-[0-9a-f]{8}$",
    "slurm": r"^\d+$",
    "kubernetes": r"^default/openlab-[a-z0-9-]+-[0-9a-f]{8}$",
}


#: Where each backend's test jobs run: the single-node Slurm cluster's ClusterName (infra/slurm),
#: the Docker engine's host, the Kubernetes emulator's API address, this machine.
EXPECTED_CLUSTER = {
    "local": lambda h: os.uname().nodename,
    "docker": lambda h: h.launcher.client.info()["Name"],  # type: ignore[attr-defined]
    "slurm": lambda h: "openlab",
    "kubernetes": lambda h: h.launcher.api_client.configuration.host.rstrip("/"),  # type: ignore[attr-defined]
}


def spec(h: Harness, name: str, command: list[str], **kwargs: object) -> JobSpec:
    options = {k: v for k, v in h.options.items() if k != "cluster"}
    return JobSpec(name=name, command=command, image=h.image, options=options, **kwargs)  # type: ignore[arg-type]


def stage_run(store: LineageStore) -> StageRun:
    with store.transaction() as tx:
        return tx.add(StageRun(stage="train", identity="ident-1"))


def test_success_streams_logs_and_records_the_attempt(harness: Harness, store: LineageStore) -> None:
    import re

    srun = stage_run(store)
    lines: list[str] = []
    attempt, status = run_job(
        store,
        harness.launcher,
        spec(harness, "hello", ["sh", "-c", "echo hello; echo world"]),
        stage_run_id=srun.id,
        on_log=lines.append,
        timeout=harness.wait_timeout,
    )
    assert status.state is JobState.SUCCEEDED, status
    assert status.exit_code == 0
    assert lines == ["hello", "world"]

    stored = store.get(Attempt, attempt.id)
    assert stored is not None
    assert stored.backend == harness.name
    assert stored.stage_run_id == srun.id and stored.number == 1
    assert stored.job_id and re.match(EXPECTED_JOB_ID[harness.name], stored.job_id), stored.job_id
    assert stored.state == "COMPLETED" and stored.exit_code == 0 and stored.reason is None
    assert stored.host, "the host/node is recorded"
    # and on which cluster, in the backend's own name for it: a job id means something only there
    assert stored.cluster and stored.cluster == EXPECTED_CLUSTER[harness.name](harness), stored.cluster
    assert stored.command == ["sh", "-c", "echo hello; echo world"]
    assert stored.started_at is not None and stored.ended_at is not None
    assert stored.submitted_at <= stored.ended_at
    assert stored.log_path
    if harness.name == "docker":
        assert stored.image == harness.image
        assert stored.image_digest and stored.image_digest.startswith(("sha256:", harness.image.split(":")[0]))

    # another process revives the handle from lineage alone and reads the same log
    assert list(harness.launcher.logs(handle_from_attempt(stored))) == ["hello", "world"]
    assert harness.launcher.status(handle_from_attempt(stored)).state is JobState.SUCCEEDED
    # every write went through the hash-chained event log
    assert [e.action for e in store.events(attempt.id)][:1] == ["create"]


def test_nonzero_exit_code(harness: Harness, store: LineageStore) -> None:
    """A failed job's attempt says why in its reason: the last line of its log that names an error
    (a Python exception's, ``error: ...``), secret values masked, where only the log said it."""
    lines: list[str] = []
    script = 'echo oops >&2; echo "RuntimeError: shard 3 of $API_TOKEN is empty" >&2; echo cleaning up; exit 3'
    attempt, status = run_job(
        store,
        harness.launcher,
        spec(harness, "fails", ["sh", "-c", script], env={"API_TOKEN": "tok-0123456789"}),
        on_log=lines.append,
        timeout=harness.wait_timeout,
    )
    assert status.state is JobState.FAILED
    assert status.exit_code == 3
    assert "exit code 3" in (status.reason or "")
    assert "oops" in lines, "stderr is part of the log"
    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "FAILED" and stored.exit_code == 3
    assert (stored.reason or "").endswith(": RuntimeError: shard 3 of *** is empty"), stored.reason
    # a log with no such line leaves the reason as the backend gave it
    _, plain = run_job(store, harness.launcher, spec(harness, "quiet", ["sh", "-c", "echo done; exit 4"]))
    assert plain.state is JobState.FAILED and "done" not in (plain.reason or ""), plain.reason


def test_a_job_starts_with_every_signal_at_its_default_as_a_shell_starts_it(
    harness: Harness, store: LineageStore
) -> None:
    """Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec: a job
    started by the local supervisor or under the usage wrapper (Docker, Slurm, Kubernetes) inherited
    both, so `yes | head -n 1` printed "yes: standard output: Broken pipe" where a shell's is silent."""
    lines: list[str] = []
    script = "yes | head -n 1; grep SigIgn /proc/self/status"
    _, status = run_job(
        store,
        harness.launcher,
        spec(harness, "sigpipe", ["sh", "-c", script]),
        on_log=lines.append,
        timeout=harness.wait_timeout,
    )
    assert status.state is JobState.SUCCEEDED, status
    (ignored,) = [int(line.split()[-1], 16) for line in lines if line.startswith("SigIgn")]
    assert not ignored & (1 << (13 - 1)) and not ignored & (1 << (25 - 1)), f"{ignored:x}: SIGPIPE or SIGXFSZ ignored"
    assert not any("Broken pipe" in line for line in lines), lines


#: How each backend names a program it could not start (the image's, the node's or this machine's).
NOT_THERE = {
    "local": "cannot run 'no-such-trainer': No such file or directory",
    "docker": "the image has no 'no-such-trainer'",
    "slurm": "the node has no 'no-such-trainer'",
    "kubernetes": "the image has no 'no-such-trainer'",
}


def test_a_program_that_is_not_there_is_named_and_one_that_exits_127_is_not(
    harness: Harness, store: LineageStore
) -> None:
    """Exit 127 is what every runtime gives a program it could not start, and only the job's log
    said which; the attempt's reason, where a user looks, now names it. A program that started
    and exited 127 itself is not blamed on a missing one."""
    missing = spec(harness, "missing", ["no-such-trainer", "--steps", "3"])
    attempt, status = run_job(store, harness.launcher, missing, timeout=harness.wait_timeout)
    assert status.state is JobState.FAILED, status
    stored = store.require(Attempt, attempt.id)
    assert NOT_THERE[harness.name] in (stored.reason or ""), stored.reason
    attempt, status = run_job(store, harness.launcher, spec(harness, "own127", ["sh", "-c", "exit 127"]))
    assert status.state is JobState.FAILED and status.exit_code == 127, status
    reason = store.require(Attempt, attempt.id).reason or ""
    assert reason.startswith("exit code 127") and "has no" not in reason and "cannot run" not in reason, reason


def test_a_job_that_stops_on_a_schedulers_signal_is_preempted_not_failed(harness: Harness, store: LineageStore) -> None:
    """A workload that catches SIGTERM (preemption, eviction), saves a checkpoint and exits
    128 + 15: every backend reports that exit, and the attempt says PREEMPTED, so the pipeline
    resumes it instead of counting a failure. A plain failure next to it stays FAILED."""
    attempt, status = run_job(
        store,
        harness.launcher,
        spec(harness, "stopped", ["sh", "-c", "echo checkpoint saved; exit 143"]),
        timeout=harness.wait_timeout,
    )
    assert status.state is JobState.PREEMPTED, status
    assert status.exit_code == 143 and "SIGTERM" in (status.reason or "")
    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "PREEMPTED" and stored.exit_code == 143
    assert harness.nothing_running(handle_from_attempt(stored)) == []
    # out of memory (SIGKILL, 137) is the job's own failure
    _, killed = run_job(
        store, harness.launcher, spec(harness, "oom", ["sh", "-c", "exit 137"]), timeout=harness.wait_timeout
    )
    assert killed.state is JobState.FAILED, killed


def test_cancel_while_running_leaves_nothing_running(harness: Harness, store: LineageStore) -> None:
    lines: list[str] = []
    attempt, status = run_job(
        store,
        harness.launcher,
        # a child in the background too: cancel must end the whole job, not just its main process
        spec(harness, "cancel-me", ["sh", "-c", "sleep 300 & echo started; sleep 300"]),
        on_log=lines.append,
        should_cancel=lambda: "started" in lines,
        timeout=harness.wait_timeout,
    )
    assert status.state is JobState.CANCELLED, status
    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "CANCELLED" and stored.reason
    assert harness.nothing_running(handle_from_attempt(stored)) == []


def test_a_job_recorded_on_another_cluster_is_neither_asked_nor_cancelled_here(
    harness: Harness, store: LineageStore
) -> None:
    """Job ids repeat across clusters (Slurm counts from 1 on each): an attempt that ran job 4711 on
    another cluster must not be asked about, or cancelled, as this cluster's job 4711, which is
    someone else's. The same id on this cluster is running here, and stays running."""
    from orchestrator.launchers import OtherCluster
    from orchestrator.launchers.attempts import submit_attempt

    attempt, handle = submit_attempt(store, harness.launcher, spec(harness, "here", ["sleep", "300"]))
    try:
        with store.transaction() as tx:  # the same backend and job id, recorded on another cluster
            elsewhere = tx.add(
                Attempt(backend=harness.name, job_id=attempt.job_id, log_path=attempt.log_path, cluster="west")
            )
        with pytest.raises(OtherCluster) as refused:
            harness.launcher.cancel(handle_from_attempt(elsewhere, harness.launcher))
        assert str(refused.value) == (
            f"attempt {elsewhere.id} (job {attempt.job_id}) ran on {harness.name} cluster 'west', and this "
            f"openlab's {harness.name} backend talks to {harness.launcher.cluster!r}: "
            f"ask from where [backends.{harness.name}] reaches 'west'"
        )
        assert harness.launcher.status(handle).state in (JobState.PENDING, JobState.RUNNING), "not cancelled"
        same = handle_from_attempt(store.get(Attempt, attempt.id), harness.launcher)  # type: ignore[arg-type]
        assert same.job_id == attempt.job_id, "the job's own cluster is asked as before"
        with store.transaction() as tx:  # recorded before clusters were: nothing to compare, so asked
            unknown = tx.add(Attempt(backend=harness.name, job_id=attempt.job_id, log_path=attempt.log_path))
        assert handle_from_attempt(unknown, harness.launcher).job_id == attempt.job_id
    finally:
        harness.launcher.cancel(handle)


def test_a_cancel_is_acted_on_between_gentle_status_looks(harness: Harness, store: LineageStore) -> None:
    """With status looks a minute apart (``[backends.X] poll_interval = 60``, kind to a busy Slurm
    controller), a cancel request still stops the job at once: ``run_job`` asks between looks.

    The request comes 6 s in, between looks backed off to ~5 s and ~10 s after the submit, so a
    waiter that only checked for cancels at its looks would act about 4 s late. The bound is 2 s:
    on a loaded two-core machine the emulated Kubernetes cancel took 1.09 s, over the 1 s this had.
    """
    harness.launcher.poll_interval = 60
    cancels: list[float] = []
    looks, caller = 0, threading.current_thread()
    cancel, status_of = harness.launcher.cancel, harness.launcher.status

    def counted_status(handle: JobHandle) -> JobStatus:
        nonlocal looks
        looks += threading.current_thread() is caller  # not a log follower's own looks
        return status_of(handle)

    def timed_cancel(handle: JobHandle) -> None:
        cancels.append(time.monotonic())
        cancel(handle)

    harness.launcher.status = counted_status  # type: ignore[method-assign]
    harness.launcher.cancel = timed_cancel  # type: ignore[method-assign]
    requested_at = time.monotonic() + 6.0
    attempt, status = run_job(
        store,
        harness.launcher,
        spec(harness, "gentle", ["sleep", "300"]),
        should_cancel=lambda: time.monotonic() >= requested_at,
        timeout=harness.wait_timeout,
    )
    assert status.state is JobState.CANCELLED, status
    assert cancels and cancels[0] - requested_at < 2.0, f"cancelled {cancels[0] - requested_at:.2f}s after the request"
    assert looks < 20, f"{looks} status looks in ~8 s at a 60 s cadence"
    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "CANCELLED"
    assert harness.nothing_running(handle_from_attempt(stored)) == []


@pytest.mark.parametrize("harness", TIME_LIMIT_BACKENDS, indirect=True)
def test_time_limit_exceeded(harness: Harness, store: LineageStore) -> None:
    attempt, status = run_job(
        store,
        harness.launcher,
        spec(harness, "too-long", ["sleep", "600"], time_limit=harness.time_limit),
        timeout=harness.wait_timeout + harness.time_limit,
    )
    assert status.state is JobState.FAILED, status
    assert "time limit" in (status.reason or ""), status.reason
    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "FAILED" and "time limit" in (stored.reason or "")
    assert harness.nothing_running(handle_from_attempt(stored)) == []


#: Saves and stops on SIGUSR1, the warning ahead of the time limit, as the MoE workload does.
SAVES_ON_WARNING = (
    "import signal, sys, time\n"
    "def save(signum, frame):\n"
    "    print('warned: saving', flush=True)\n"
    "    sys.exit(128 + signum)\n"
    "signal.signal(signal.SIGUSR1, save)\n"
    "time.sleep(120)\n"
)


@pytest.mark.parametrize("harness", [p for p in BACKENDS if p.id != "slurm"], indirect=True)
def test_a_job_is_warned_ahead_of_its_time_limit_and_saving_on_it_is_not_a_failure(
    harness: Harness, store: LineageStore
) -> None:
    """``warn_before_limit``: SIGUSR1 that many seconds before the limit, as Slurm's
    ``--signal=USR1@N`` (checked in its batch script; Slurm's limits take minutes to reach). A job
    that saves and stops on it was stopped from outside, not failed: its stage goes on from the
    save. On Docker a second ``timeout`` in the container sends it, on Kubernetes the pod's usage
    wrapper, ahead of ``activeDeadlineSeconds``."""
    python = sys.executable if harness.name == "local" else "python3"
    lines: list[str] = []
    attempt, status = run_job(
        store,
        harness.launcher,
        spec(harness, "warned", [python, "-c", SAVES_ON_WARNING], time_limit=60, warn_before_limit=55),
        on_log=lines.append,
        timeout=harness.wait_timeout + 60,
    )
    assert "warned: saving" in lines, lines
    assert status.state is JobState.PREEMPTED and "SIGUSR1" in (status.reason or ""), status
    ran = store.require(Attempt, attempt.id)
    assert ran.started_at and ran.ended_at and (ran.ended_at - ran.started_at).total_seconds() < 50, (
        "warned 55 s ahead of its 60 s limit, not stopped at it"
    )


def test_env_labels_and_artifact_root(harness: Harness, tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    labels = {"openlab.io/stage-run": "srun_abc123", "openlab.io/pipeline-run": "prun_def456"}
    job = spec(
        harness,
        "env-labels",
        ["sh", "-c", f'echo "FOO=$FOO"; echo "LABELS=$OPENLAB_LABELS"; echo result > {root}/out.txt'],
        env={"FOO": "bar baz"},
        labels=labels,
        artifact_root=root,
    )
    handle = harness.launcher.submit(job)
    try:
        status = harness.launcher.wait(handle, timeout=harness.wait_timeout)
        assert status.state is JobState.SUCCEEDED, status
        native = harness.native_labels(handle)
        assert {k: native.get(k) for k in labels} == labels
        lines = list(harness.launcher.logs(handle))
        assert "FOO=bar baz" in lines
        (label_line,) = [line for line in lines if line.startswith("LABELS=")]
        assert json.loads(label_line.removeprefix("LABELS=")) == labels
        assert (root / "out.txt").read_text() == "result\n"
    finally:
        harness.launcher.cleanup(handle)


def test_log_lines_arrive_while_the_job_runs_even_with_gentle_status_looks(
    harness: Harness, store: LineageStore
) -> None:
    """A line the job prints reaches ``on_log`` while the job still runs, not at the next status look:
    with ``poll_interval = 60`` the first line must arrive seconds before the job's last line."""
    harness.launcher.poll_interval = 60
    arrived: dict[str, float] = {}
    attempt, status = run_job(
        store,
        harness.launcher,
        spec(harness, "live-log", ["sh", "-c", "echo first; sleep 6; echo second"]),
        on_log=lambda line: arrived.setdefault(line, time.monotonic()),
        timeout=harness.wait_timeout + 60,
    )
    assert status.state is JobState.SUCCEEDED, status
    assert set(arrived) == {"first", "second"}, arrived
    lead = arrived["second"] - arrived["first"]
    assert lead > 3, f"'first' reached the log only {lead:.1f}s before 'second': streamed at a status look"


SAVES_ON_TERM = (
    "import signal, sys, time\n"
    "stop = []\n"
    "signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))\n"
    "print('training', flush=True)\n"
    "while not stop:\n"
    "    time.sleep(0.1)\n"
    "time.sleep(8)  # the rest of a long step, then the checkpoint\n"
    "print('saved', flush=True)\n"
    "sys.exit(143)\n"
)


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=[pytest.mark.docker])])
def test_a_cancel_gives_the_job_time_to_finish_its_step_and_save_by_default(
    backend: str, store: LineageStore, request: pytest.FixtureRequest
) -> None:
    """With no ``grace`` set, a cancelled job has as long as Slurm's KillWait and a Kubernetes pod's
    termination grace give it (30 s) before SIGKILL. At 5 s, a cancel from the Prefect UI killed a
    training step of 10 s mid-way, nothing was saved, and the retry started over from step 1."""
    from orchestrator.launchers import get_launcher
    from tests.launchers.harness import docker_image, make_harness

    if backend == "docker":
        make_harness("docker", request)  # skips (or fails under CI) without the engine and job image
        launcher, image = get_launcher("docker", image=docker_image()), docker_image()
    else:
        launcher, image = get_launcher("local"), None
    lines: list[str] = []
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="long-step", command=["python3", "-c", SAVES_ON_TERM], image=image),
        on_log=lines.append,
        should_cancel=lambda: "training" in lines,
        timeout=90,
    )
    assert status.state is JobState.CANCELLED, status
    assert "saved" in lines or "saved" in list(launcher.logs(handle_from_attempt(attempt))), lines
