"""The local backend notices a job's end when it happens, not at the next poll.

A stage's overhead on the local backend used to be mostly poll latency (a trivial job took
~95 ms against ~1 ms for the bare command). These tests pin the behaviour that removed it:
waiting wakes on the supervisor's exit, and the supervisor's record is what another process
reads back.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator.launchers import JobHandle, JobSpec, JobState, get_launcher
from orchestrator.launchers.local import LocalLauncher

needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds need Linux >= 5.3")


@needs_pidfd
def test_wait_wakes_when_the_job_ends_not_at_the_next_poll() -> None:
    """With polls backing off to 10 s the next look after a 1.3 s job would come at ~2.5 s."""
    launcher = get_launcher("local")
    handle = launcher.submit(JobSpec(name="short", command=["sleep", "1.3"]))
    start = time.monotonic()
    status = launcher.wait(handle, timeout=30, poll=10)
    elapsed = time.monotonic() - start
    assert status.state is JobState.SUCCEEDED, status
    assert elapsed < 2.0, f"wait returned {elapsed:.2f}s after submit: it slept to the next poll"


@needs_pidfd
def test_following_the_log_ends_with_the_job_from_another_launcher() -> None:
    """``openlab job logs -f`` runs in another process: a fresh launcher, a handle revived from its dict."""
    submitter = get_launcher("local")
    handle = submitter.submit(JobSpec(name="follow", command=["sh", "-c", "echo one; sleep 1; echo two"]))
    follower = get_launcher("local")
    revived = JobHandle.from_dict({**handle.to_dict(), "extra": {}})  # what lineage keeps: no supervisor pid
    start = time.monotonic()
    assert list(follower.logs(revived, follow=True)) == ["one", "two"]
    assert time.monotonic() - start < 3.0
    assert follower.status(revived).state is JobState.SUCCEEDED


def test_supervisor_record_is_json_any_reader_can_parse(tmp_path: Path) -> None:
    """The supervisor writes JSON by hand (no json import on its critical path): it must stay valid JSON."""
    launcher = get_launcher("local")
    assert isinstance(launcher, LocalLauncher)
    workdir = tmp_path / 'dir with "quotes" and \\ backslash'
    workdir.mkdir()
    handle = launcher.submit(JobSpec(name="json", command=["sh", "-c", "pwd; exit 4"], workdir=str(workdir)))
    status = launcher.wait(handle, timeout=30)
    assert status.state is JobState.FAILED and status.exit_code == 4 and status.reason == "exit code 4"
    assert status.host == os.uname().nodename and status.started_at and status.ended_at
    run = json.loads(launcher._run_path(handle.job_id).read_text())
    assert run["state"] == "FAILED" and run["exit_code"] == 4
    assert list(launcher.logs(handle)) == [str(workdir)]  # the job ran in the working directory it was given


def test_supervisor_json_encoder_round_trips_awkward_strings() -> None:
    from orchestrator.launchers import _supervise

    data = {
        "reason": 'a "quoted" \\ path\n\ttab \x01 ctrl é',
        "none": None,
        "t": 1796280669.4943156,
        "n": -3,
        "flag": False,
    }
    assert json.loads(_supervise.dumps(data)) == data


def test_a_job_whose_supervisor_was_killed_is_lost_and_its_processes_ended() -> None:
    """SIGKILL the supervisor (the OOM killer's pick): the job runs on in its own process group with
    no one to time, stop or record it, and a LOST job is run again by its pipeline. Its status says
    LOST and ends those processes, so two never write the same output; another group is not touched."""
    from orchestrator.launchers._supervise import group_members

    launcher = get_launcher("local")
    handle = launcher.submit(JobSpec(name="orphan", command=["sleep", "120"]))
    other = launcher.submit(JobSpec(name="bystander", command=["sleep", "120"]))
    try:
        _lose_the_supervisor(launcher, handle, other)
    finally:  # nothing of this test outlives it, whatever failed
        launcher.cancel(other)
        pgid = int(launcher._read(handle.job_id).get("pgid") or 0)
        if pgid and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)


def _lose_the_supervisor(launcher: LocalLauncher, handle: JobHandle, other: JobHandle) -> None:
    from orchestrator.launchers._supervise import group_members
    from orchestrator.launchers.local import _alive

    deadline = time.monotonic() + 10
    while launcher.status(handle).state is not JobState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    record = launcher._read(handle.job_id)
    pgid, supervisor = int(record["pgid"]), int(record["supervisor_pid"])
    assert group_members(pgid)
    os.kill(supervisor, signal.SIGKILL)
    while _alive(supervisor):  # a zombie until its parent, this launcher, reaps it: not alive
        time.sleep(0.02)

    status = launcher.status(handle)
    assert status.state is JobState.LOST, status
    assert "its processes, left running with no one to time, stop or record them, were ended" in (status.reason or "")
    deadline = time.monotonic() + 5
    while group_members(pgid):
        assert time.monotonic() < deadline, f"the orphaned job still runs: {group_members(pgid)}"
        time.sleep(0.05)
    assert launcher.status(other).state is JobState.RUNNING  # only the job's own group
