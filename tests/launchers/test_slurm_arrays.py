"""Slurm job arrays: one handle, per-task status, per-task logs, cancel of every task.

A user who shards a stage into N array tasks needs to know which shard failed, read that
shard's log, and cancel all of them — pending ones included — with one cancel. Against the
real single-node cluster (``require_slurm``), plus the parsing that needs no cluster.
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launchers import JobHandle, JobSpec, JobState, JobStatus, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.base import stopped_from_outside
from orchestrator.launchers.slurm import SlurmLauncher, aggregate_tasks, expand_task_ids
from orchestrator.lineage.models import Attempt
from orchestrator.lineage.store import LineageStore
from tests.launchers.harness import Harness, jobcomp_only_slurm

SHARD = 'echo "shard $SLURM_ARRAY_TASK_ID of $SLURM_ARRAY_TASK_COUNT"; '
#: 0.3 s of CPU in each shard, which the usage wrapper counts.
BURN = 'python3 -c "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass"'


def _queue(job_id: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if line.strip()]


# -- against the real cluster ------------------------------------------------------------------


@pytest.mark.slurm
def test_a_requeued_job_is_followed_through_its_restart(slurm_harness: Harness, store: LineageStore) -> None:
    """Slurm requeues a running job (PreemptMode=REQUEUE, a node failure, `scontrol requeue`): same
    job id, its script started again. Its log keeps the run before the requeue (Slurm empties it by
    default, and how far that run got was lost), the restart is said in it, the log follower goes on
    into the new run, and the attempt says it was requeued."""
    import threading

    lines: list[str] = []

    def on_log(line: str) -> None:  # in order; the requeue on its own thread, not to hold the log pump
        lines.append(line)
        if line == "run 0":
            threading.Thread(target=requeue).start()

    def requeue() -> None:
        job_id = next(iter(_queue_named("requeue-me")))
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        # Slurm holds a requeued job back (BeginTime, 2 min) once it is pending again; skip the wait,
        # but not within the second of the requeue: slurmd revokes the job's credential at the requeue,
        # in whole seconds, and refuses a restart whose credential is from that same second ("Job
        # credential revoked", exit 1: seen once in CI when the restart came 0.4 s after the requeue)
        deadline = time.monotonic() + 30
        while _queue(job_id) != [f"{job_id} PENDING"] and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.5)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)

    script = 'echo "run ${SLURM_RESTART_COUNT:-0}"; [ "${SLURM_RESTART_COUNT:-0}" = 1 ] || sleep 60; echo end'
    attempt, status = run_job(
        store,
        slurm_harness.launcher,
        JobSpec(name="requeue-me", command=["bash", "-c", script]),
        on_log=on_log,
        timeout=180,
    )
    assert status.state is JobState.SUCCEEDED, status
    assert attempt.reason == "requeued 1 time by Slurm and restarted from its script"
    assert lines[0] == "run 0" and lines[-2:] == ["run 1", "end"], lines
    said = "[openlab] Slurm requeued the job and started it again (restart 1); the log of its earlier run is above"
    assert said in lines, lines
    kept = Path(str(attempt.log_path)).read_text().splitlines()
    assert [line for line in kept if line in ("run 0", said, "run 1", "end")] == ["run 0", said, "run 1", "end"], kept


def _queue_named(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, check=False)
    return out.stdout.split()


@pytest.mark.slurm
def test_array_that_succeeds_reports_every_task_and_keeps_each_log(slurm_harness: Harness, store: LineageStore) -> None:
    launcher = slurm_harness.launcher
    assert isinstance(launcher, SlurmLauncher)
    lines: list[str] = []
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="shards", command=["sh", "-c", SHARD + BURN], options={"array": "0-2"}),
        on_log=lines.append,
        timeout=slurm_harness.wait_timeout,
    )
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0, status
    assert status.tasks is not None and list(status.tasks) == ["0", "1", "2"]
    assert all(t.state is JobState.SUCCEEDED and t.exit_code == 0 and t.host for t in status.tasks.values())
    assert sorted(lines) == ["[0] shard 0 of 3", "[1] shard 1 of 3", "[2] shard 2 of 3"]

    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "COMPLETED" and stored.job_id == attempt.job_id
    assert stored.tasks is not None and list(stored.tasks) == ["0", "1", "2"]
    assert all(t["state"] == "COMPLETED" and t["exit_code"] == 0 and t["host"] for t in stored.tasks.values())
    handle = JobHandle("slurm", str(stored.job_id), stored.log_path)  # revived from lineage alone
    assert list(launcher.logs(handle)) == ["[0] shard 0 of 3", "[1] shard 1 of 3", "[2] shard 2 of 3"]
    one = launcher.task_handle(handle, 1)
    assert one.job_id == f"{stored.job_id}_1"
    assert list(launcher.logs(one)) == ["shard 1 of 3"]
    # `openlab job logs 123_1 --backend slurm`: nothing but Slurm's own task id
    assert list(launcher.logs(JobHandle("slurm", f"{stored.job_id}_1"))) == ["shard 1 of 3"]
    assert launcher.status(one).state is JobState.SUCCEEDED and launcher.status(one).tasks is None
    assert status.to_dict()["tasks"]["2"]["state"] == "SUCCEEDED"
    # what the array used is every shard's, each measured by its own wrapper; one shard's is its own
    assert stored.used is not None and stored.used["cpu_seconds"] >= 0.9, stored.used
    one_used = launcher.status(one).usage
    assert one_used is not None and 0.3 <= one_used["cpu_seconds"] < stored.used["cpu_seconds"], one_used


@pytest.mark.slurm
def test_array_with_a_failed_task_is_failed_and_names_it(
    slurm_harness: Harness, store: LineageStore, run_cli: Any
) -> None:
    launcher = slurm_harness.launcher
    assert isinstance(launcher, SlurmLauncher)
    command = ["sh", "-c", SHARD + '[ "$SLURM_ARRAY_TASK_ID" = 3 ] && { echo broken >&2; exit 7; }; exit 0']
    attempt, status = run_job(
        store,
        launcher,
        JobSpec(name="shards-fail", command=command, options={"array": "1-4"}),
        timeout=slurm_harness.wait_timeout,
    )
    assert status.state is JobState.FAILED, status
    assert status.exit_code == 7
    assert status.reason == "1 of 4 tasks failed: task 3 (exit code 7)"
    assert status.tasks is not None
    assert {t: s.state for t, s in status.tasks.items()} == {
        "1": JobState.SUCCEEDED,
        "2": JobState.SUCCEEDED,
        "3": JobState.FAILED,
        "4": JobState.SUCCEEDED,
    }
    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "FAILED" and stored.exit_code == 7
    assert "task 3" in (stored.reason or "")
    # lineage keeps every task's end, so the failed shard is known after the cluster forgets the job
    assert stored.tasks is not None
    assert {t: (e["state"], e["exit_code"]) for t, e in stored.tasks.items()} == {
        "1": ("COMPLETED", 0),
        "2": ("COMPLETED", 0),
        "3": ("FAILED", 7),
        "4": ("COMPLETED", 0),
    }
    shown = run_cli("lineage", "show", attempt.id)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^\s+3\s+FAILED exit 7 on \S+", shown.stdout, re.M), shown.stdout
    live = run_cli("job", "status", attempt.id)  # the same line, asked of the cluster
    assert live.returncode == 0, live.stderr
    assert re.search(r"^\s+3\s+FAILED exit 7 on \S+", live.stdout, re.M), live.stdout
    assert re.search(r"^\s+2\s+SUCCEEDED exit 0 on \S+", live.stdout, re.M), live.stdout
    failed = launcher.task_handle(JobHandle("slurm", str(stored.job_id), stored.log_path), 3)
    assert list(launcher.logs(failed)) == ["shard 3 of 4", "broken"]

    # slurmctld forgets each task MinJobAge after it ended, while later ones may still run: with failed
    # task 3 forgotten, the array read SUCCEEDED from the three left. The handle a pipeline holds, and
    # the one revived from the attempt (the reaper, `job status`), know the array's tasks: the forgotten
    # one comes from sacct, and is LOST where nothing knows it, never a success
    from orchestrator.launchers.attempts import handle_from_attempt

    forgetting = SlurmLauncher.__dict__["_scontrol"]

    def forgot_task_3(self: SlurmLauncher, job_id: str) -> list[dict[str, str]] | None:
        rows = forgetting(self, job_id)
        return [r for r in rows or () if r.get("ArrayTaskId") != "3"] or None

    deadline = time.monotonic() + 30  # sacct has a job a moment after its end; a forgotten task ended long ago
    while "3" not in (launcher._tasks(str(stored.job_id), launcher._sacct(str(stored.job_id)) or []) or {}):
        assert time.monotonic() < deadline, "sacct never recorded task 3"
        time.sleep(0.5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SlurmLauncher, "_scontrol", forgot_task_3)
        revived = handle_from_attempt(stored, launcher)
        assert revived.extra == {"array": True, "array_tasks": "1-4"}
        again = launcher.status(revived)
        assert (again.state, again.reason) == (JobState.FAILED, "1 of 4 tasks failed: task 3 (exit code 7)"), again
        mp.setattr(SlurmLauncher, "_sacct", lambda self, job_id: None)
        mp.setattr(SlurmLauncher, "_jobcomp", lambda self, job_id: None)
        unknown = launcher.status(revived)
        assert (unknown.state, unknown.reason) == (JobState.LOST, "1 of 4 tasks lost: task 3"), unknown
        assert unknown.tasks is not None and unknown.tasks["3"].reason == (
            "slurmctld forgot task 3 (MinJobAge) and neither sacct nor the jobcomp log knows it"
        )


@pytest.mark.slurm
@pytest.mark.slow
def test_cancel_of_the_array_cancels_running_and_pending_tasks(slurm_harness: Harness) -> None:
    launcher = slurm_harness.launcher
    # %1: one task at a time, so tasks 1-3 are still pending (one compressed record) when we cancel
    handle = launcher.submit(
        JobSpec(name="shards-cancel", command=["sh", "-c", SHARD + "sleep 300"], options={"array": "0-3%1"})
    )
    try:
        deadline = time.monotonic() + slurm_harness.wait_timeout
        status = launcher.status(handle)
        while status.state is not JobState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.2)
            status = launcher.status(handle)
        assert status.state is JobState.RUNNING, status
        assert status.tasks is not None and list(status.tasks) == ["0", "1", "2", "3"]
        assert status.tasks["0"].state is JobState.RUNNING
        assert {status.tasks[t].state for t in ("1", "2", "3")} == {JobState.PENDING}
        assert status.reason == "0 of 4 tasks ended"

        launcher.cancel(handle)
        assert _queue(handle.job_id) == []  # nothing of the array is left, pending tasks included
        final = launcher.status(handle)
        assert final.state is JobState.CANCELLED, final
        assert final.tasks is not None
        assert {t: s.state for t, s in final.tasks.items()} == dict.fromkeys("0123", JobState.CANCELLED)
    finally:
        subprocess.run(["scancel", handle.job_id], capture_output=True, check=False)


@pytest.mark.slurm
def test_an_interrupted_array_keeps_each_tasks_end(slurm_harness: Harness, store: LineageStore) -> None:
    """A run stopped from outside (here: its timeout) cancels the array and still records, per
    task, what the cluster saw, so `lineage show` says which shards were cut short."""
    from orchestrator.launchers.base import JobTimeout

    launcher = slurm_harness.launcher
    spec = JobSpec(name="shards-stopped", command=["sh", "-c", SHARD + "sleep 300"], options={"array": "0-2%1"})
    with pytest.raises(JobTimeout):
        run_job(store, launcher, spec, timeout=3)
    [attempt] = [a for a in store.list(Attempt) if a.job_name == "shards-stopped"]
    assert _queue(str(attempt.job_id)) == []
    assert attempt.state == "CANCELLED" and "did not finish within 3s" in (attempt.reason or "")
    assert attempt.tasks is not None, "an interrupted array lost its per-task ends"
    assert {t: e["state"] for t, e in attempt.tasks.items()} == dict.fromkeys("012", "CANCELLED")


@pytest.mark.slurm
def test_an_array_cancelled_after_a_task_failed_is_cancelled_and_keeps_the_failure(
    slurm_harness: Harness, store: LineageStore
) -> None:
    """The user's cancel ended the job, so the attempt is CANCELLED, not FAILED (which would read as
    "the array failed on its own"); the failed shard stays named in the reason and its task record."""
    launcher = slurm_harness.launcher
    command = ["sh", "-c", SHARD + '[ "$SLURM_ARRAY_TASK_ID" = 0 ] && exit 7; sleep 300']
    spec = JobSpec(name="shards-fail-cancel", command=command, options={"array": "0-1"})

    def task_0_failed() -> bool:
        [attempt] = [a for a in store.list(Attempt) if a.job_name == spec.name]
        tasks = launcher.status(JobHandle("slurm", str(attempt.job_id))).tasks or {}
        return "0" in tasks and tasks["0"].state is JobState.FAILED

    attempt, status = run_job(store, launcher, spec, should_cancel=task_0_failed, timeout=slurm_harness.wait_timeout)
    assert status.state is JobState.CANCELLED, status
    assert status.reason == "cancelled by request after 1 of 2 tasks failed: task 0 (exit code 7)"
    stored = store.get(Attempt, attempt.id)
    assert stored is not None and stored.state == "CANCELLED" and "task 0 (exit code 7)" in (stored.reason or "")
    assert stored.tasks is not None
    assert {t: (e["state"], e["exit_code"]) for t, e in stored.tasks.items()} == {
        "0": ("FAILED", 7),
        "1": ("CANCELLED", stored.tasks["1"]["exit_code"]),
    }


# -- no cluster needed ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("0-3", ["0", "1", "2", "3"]),
        ("2,4%1", ["2", "4"]),  # scontrol's pending record, with the throttle
        ("[5-7%2]", ["5", "6", "7"]),  # sacct's 123_[5-7%2]
        ("1-7:3", ["1", "4", "7"]),
        ("0,3-4", ["0", "3", "4"]),
        ("", []),
        ("N/A", []),
    ],
)
def test_task_lists_expand_like_slurm_writes_them(text: str, ids: list[str]) -> None:
    assert expand_task_ids(text) == ids


def _at(minute: int) -> dt.datetime:
    return dt.datetime(2026, 12, 2, 18, minute, tzinfo=dt.UTC)


def test_an_array_is_not_finished_while_any_task_runs_even_after_a_failure() -> None:
    """A FAILED aggregate before the end would make callers record the end while tasks still run."""
    tasks = {
        "0": JobStatus(JobState.FAILED, 2, "exit code 2", "n1", _at(0), _at(1)),
        "1": JobStatus(JobState.RUNNING, None, None, "n2", _at(0)),
        "10": JobStatus(JobState.PENDING, reason="JobArrayTaskLimit"),
    }
    status = aggregate_tasks(tasks)
    assert status.state is JobState.RUNNING and status.exit_code is None and status.ended_at is None
    assert status.reason == "1 of 3 tasks ended; failed so far: task 0"
    assert status.host == "n1,n2" and status.started_at == _at(0)

    pending = aggregate_tasks({"1": JobStatus(JobState.PENDING, reason="Resources"), "0": JobStatus(JobState.PENDING)})
    assert pending.state is JobState.PENDING and pending.reason == "Resources"
    assert list(pending.tasks or {}) == ["0", "1"]  # in task order, not the order Slurm printed

    tasks["1"] = JobStatus(JobState.FAILED, 128 + 9, "killed by signal 9", "n2", _at(0), _at(3))
    tasks["10"] = JobStatus(JobState.CANCELLED, None, "cancelled")
    done = aggregate_tasks(tasks)
    assert done.state is JobState.FAILED and done.exit_code == 2 and done.ended_at == _at(3)
    assert done.reason == "2 of 3 tasks failed: task 0 (exit code 2), 1 (killed by signal 9)"


def test_an_array_with_a_preempted_task_is_preempted_unless_another_failed() -> None:
    """A task Slurm preempted, or one that exited on a stop signal, makes the array PREEMPTED (the
    pipeline runs it again without spending a retry); a task's own failure still wins."""
    tasks = {
        "0": JobStatus(JobState.SUCCEEDED, 0, None, "n1", _at(0), _at(1)),
        "1": JobStatus(JobState.PREEMPTED, 0, "preempted by a higher-priority job", "n1", _at(0), _at(2)),
        "2": JobStatus(JobState.FAILED, 138, "exit code 138", "n1", _at(0), _at(2)),
    }
    status = aggregate_tasks(tasks)
    assert status.state is JobState.PREEMPTED and status.reason == "2 of 3 tasks preempted: task 1, 2"
    assert status.tasks and status.tasks["2"].state is JobState.PREEMPTED and "SIGUSR1" in str(status.tasks["2"].reason)
    tasks["0"] = JobStatus(JobState.FAILED, 1, "exit code 1", "n1", _at(0), _at(1))
    assert aggregate_tasks(tasks).state is JobState.FAILED


def test_slurm_states_and_stop_exits() -> None:
    """Slurm's PREEMPTED state is a preemption; TIMEOUT is the job's own limit (killed by SIGTERM
    too, but a rerun would stop at the same point), so it stays FAILED."""
    row = {"JobState": "PREEMPTED", "ExitCode": "0:15", "NodeList": "n1", "StartTime": "2026-12-04T10:00:00"}
    assert SlurmLauncher._row_status(row).state is JobState.PREEMPTED
    timeout = SlurmLauncher._row_status({**row, "JobState": "TIMEOUT"})
    assert timeout.state is JobState.FAILED and timeout.exit_code == 143
    assert stopped_from_outside(timeout) is timeout, "a time limit is not a preemption"
    usr1 = SlurmLauncher._row_status({**row, "JobState": "FAILED", "ExitCode": "138:0"})
    assert stopped_from_outside(usr1).state is JobState.PREEMPTED
    # a node that died under the job: the cluster's failure, run again without spending a retry
    for state, said in (("NODE_FAIL", "a node of the job failed"), ("BOOT_FAIL", "failed to boot")):
        lost_node = SlurmLauncher._row_status({**row, "JobState": state, "ExitCode": "0:9"})
        assert lost_node.state is JobState.PREEMPTED and said in str(lost_node.reason), lost_node


def test_sacct_records_read_as_scontrol_reads_the_same_end() -> None:
    """What sacct keeps once slurmctld has forgotten a job must give the job's end as scontrol gave it:
    a TIMEOUT whose record says ``0:0`` read as exit 0 where scontrol said 143; an OUT_OF_MEMORY's
    ``0:125`` (no signal) as exit 253; a job held when its reservation was deleted, or requeued by its
    federation, as LOST, which closed an attempt whose job still waited in the queue."""
    row = {"JobState": "TIMEOUT", "ExitCode": "0:0", "NodeList": "n1", "StartTime": "2026-12-04T10:00:00"}
    assert SlurmLauncher._row_status(row).exit_code == 143
    oom = SlurmLauncher._row_status({**row, "JobState": "OUT_OF_MEMORY", "ExitCode": "0:125"})
    assert (oom.state, oom.exit_code, oom.reason) == (JobState.FAILED, 137, "out of memory"), oom
    for held in ("RESV_DEL_HOLD", "REQUEUE_FED"):
        waiting = SlurmLauncher._row_status({**row, "JobState": held, "ExitCode": "0:0", "Reason": "None"})
        assert waiting.state is JobState.PENDING, (held, waiting)


def test_array_status_falls_back_to_jobcomp_with_one_record_per_task(tmp_path: Path) -> None:
    """After MinJobAge without accounting: jobcomp has a line per task; a stale line of a wiped cluster loses."""
    jobcomp = tmp_path / "jobcomp.log"
    common = "UserId=root(0) GroupId=root(0) Name=shards Partition=debug TimeLimit=1 NodeCnt=1 ProcCnt=1 WorkDir=/w"
    jobcomp.write_text(
        # a job 90 of an earlier cluster (same id, state wiped since): must not count
        f"JobId=90 {common} JobState=FAILED StartTime=2026-12-01T10:00:00 EndTime=2026-12-01T10:00:01 "
        "NodeList=old ExitCode=1:0 \n"
        f"JobId=91 {common} JobState=COMPLETED StartTime=2026-12-02T19:00:00 EndTime=2026-12-02T19:00:02 "
        "NodeList=node7 ArrayJobId=90 ArrayTaskId=0 DerivedExitCode=0:0 ExitCode=0:0 \n"
        f"JobId=90 {common} JobState=FAILED StartTime=2026-12-02T19:00:00 EndTime=2026-12-02T19:00:03 "
        "NodeList=node7 ArrayJobId=90 ArrayTaskId=1 DerivedExitCode=0:0 ExitCode=5:0 \n"
        f"JobId=900 {common} JobState=COMPLETED StartTime=2026-12-02T19:00:00 EndTime=2026-12-02T19:00:03 "
        "NodeList=node7 ExitCode=0:0 \n"
    )
    bin_dir = tmp_path / "bin"
    jobcomp_only_slurm(bin_dir, jobcomp)
    launcher = get_launcher("slurm", bin_dir=str(bin_dir))
    assert isinstance(launcher, SlurmLauncher)
    status = launcher.status(JobHandle("slurm", "90"))
    assert status.state is JobState.FAILED and status.exit_code == 5, status
    assert status.reason == "1 of 2 tasks failed: task 1 (exit code 5)"
    assert status.tasks is not None and list(status.tasks) == ["0", "1"] and status.host == "node7"
    one = launcher.status(launcher.task_handle(JobHandle("slurm", "90", "/l/slurm-90_%a.log"), 0))
    assert one.state is JobState.SUCCEEDED and one.tasks is None
    assert launcher.task_handle(JobHandle("slurm", "90", "/l/slurm-90_%a.log"), 0).log_path == "/l/slurm-90_0.log"
