"""Local jobs that ask for GPUs get GPUs no other local job holds, and wait for them as Slurm's do.

Every local job asking for one GPU was given ``CUDA_VISIBLE_DEVICES=0``: two stages of a sweep on one
workstation both ran on GPU 0 and ran out of its memory. No GPU is needed to see which GPUs a job is
given: ``[backends.local] gpus`` names them (as on a machine with them), and the job prints its
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.launchers import JobSpec, JobState, LauncherError, get_launcher
from orchestrator.launchers.local import LocalLauncher


def _held_until(gate: Path, name: str) -> list[str]:
    """A job that prints its GPUs, then runs until ``gate`` exists."""
    return ["sh", "-c", f'echo "{name}=$CUDA_VISIBLE_DEVICES"; while [ ! -e {gate} ]; do sleep 0.1; done']


def _until(launcher: LocalLauncher, handle: object, state: JobState, timeout: float = 20) -> object:
    """The job's status once it is ``state`` (PENDING: once it says why it waits, not just submitted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = launcher.status(handle)  # type: ignore[arg-type]
        if status.state is state and (state is not JobState.PENDING or status.reason):
            return status
        time.sleep(0.1)
    raise AssertionError(f"not {state} after {timeout} s: {launcher.status(handle)}")  # type: ignore[arg-type]


def test_jobs_get_gpus_no_other_job_holds_and_one_waits_for_a_free_one(tmp_path: Path) -> None:
    launcher = get_launcher("local", gpus=["0", "1"])
    gates = {name: tmp_path / f"{name}.go" for name in "abc"}
    a = launcher.submit(JobSpec(name="a", command=_held_until(gates["a"], "a"), gpus=1))
    b = launcher.submit(JobSpec(name="b", command=_held_until(gates["b"], "b"), gpus=1))
    _until(launcher, a, JobState.RUNNING)
    _until(launcher, b, JobState.RUNNING)
    c = launcher.submit(JobSpec(name="c", command=_held_until(gates["c"], "c"), gpus=1, time_limit=4))
    waiting = _until(launcher, c, JobState.PENDING)
    assert waiting.reason == f"waiting for 1 GPU(s) of 0,1: held by {', '.join(sorted([a.job_id, b.job_id]))}"
    time.sleep(4.5)  # longer than c's time limit: waiting is not running
    assert launcher.status(c).state is JobState.PENDING

    gates["a"].touch()
    assert launcher.wait(a, timeout=20).state is JobState.SUCCEEDED
    assert _until(launcher, c, JobState.RUNNING).started_at is not None
    gates["b"].touch()
    gates["c"].touch()
    assert launcher.wait(b, timeout=20).state is JobState.SUCCEEDED
    assert launcher.wait(c, timeout=20).state is JobState.SUCCEEDED, "its limit counts from its start"
    given = {h.job_id: next(iter(launcher.logs(h))) for h in (a, b, c)}
    assert {given[a.job_id], given[b.job_id]} == {"a=0", "b=1"} or {given[a.job_id], given[b.job_id]} == {
        "a=1",
        "b=0",
    }, given
    assert given[c.job_id] == given[a.job_id].replace("a=", "c="), "c got the GPU a gave back"
    assert (launcher.state_dir / "gpus.held").read_text() == "", "every GPU given back"


def test_a_job_cancelled_while_it_waits_never_runs_and_a_dead_supervisors_gpu_is_free(tmp_path: Path) -> None:
    launcher = get_launcher("local", gpus=1)
    gate = tmp_path / "go"
    holder = launcher.submit(JobSpec(name="holder", command=_held_until(gate, "holder"), gpus=1))
    _until(launcher, holder, JobState.RUNNING)
    ran = tmp_path / "ran"
    waiter = launcher.submit(JobSpec(name="waiter", command=["touch", str(ran)], gpus=1))
    _until(launcher, waiter, JobState.PENDING)
    launcher.cancel(waiter)
    status = launcher.status(waiter)
    assert status.state is JobState.CANCELLED and status.reason == "cancelled while waiting for GPUs", status
    assert not ran.exists()

    # the holder's supervisor killed (the OOM killer): its job runs on, on the GPU, so the GPU stays its
    # own (two jobs on one GPU run out of its memory) until the job is cancelled, also while the dead
    # supervisor is a zombie its parent (this process, the submitter) has not reaped
    supervisor = int(holder.extra["supervisor_pid"])
    os.kill(supervisor, signal.SIGKILL)
    _until_zombie(supervisor)
    after = launcher.submit(JobSpec(name="after", command=["sh", "-c", "echo after=$CUDA_VISIBLE_DEVICES"], gpus=1))
    assert _until(launcher, after, JobState.PENDING).reason == f"waiting for 1 GPU(s) of 0: held by {holder.job_id}"
    time.sleep(1)
    assert launcher.status(after).state is JobState.PENDING
    launcher.cancel(holder)
    assert launcher.status(holder).state is JobState.CANCELLED
    assert not Path(f"/proc/{supervisor}").exists(), "the cancel reaped the zombie"
    assert launcher.wait(after, timeout=20).state is JobState.SUCCEEDED
    assert list(launcher.logs(after)) == ["after=0"]

    # a supervisor gone with its job: the GPU is free even before anyone cancels or reaps it
    gone = launcher.submit(JobSpec(name="gone", command=_held_until(gate.with_name("go2"), "gone"), gpus=1))
    _until(launcher, gone, JobState.RUNNING)
    group = launcher.process_group(gone)
    os.kill(int(gone.extra["supervisor_pid"]), signal.SIGKILL)
    os.killpg(group, signal.SIGKILL)
    _until_zombie(int(gone.extra["supervisor_pid"]))
    again = launcher.submit(JobSpec(name="again", command=["true"], gpus=1))
    assert launcher.wait(again, timeout=20).state is JobState.SUCCEEDED


def _until_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} is not a zombie after 10 s")


def test_the_gpus_are_the_setting_else_those_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # e.g. a share of a machine someone was given
    launcher = get_launcher("local")
    assert launcher.gpu_ids() == ["3", "5"]
    job = launcher.submit(JobSpec(name="share", command=["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], gpus=2))
    assert launcher.wait(job, timeout=20).state is JobState.SUCCEEDED
    assert list(launcher.logs(job)) == ["3,5"]
    with pytest.raises(LauncherError, match=r"asks for 3 GPUs and this machine has 2 \(3, 5\)"):
        launcher.submit(JobSpec(name="too-many", command=["true"], gpus=3))
    assert get_launcher("local", gpus=4).gpu_ids() == ["0", "1", "2", "3"]
    for bad in ("x", -1, ["0", "0"], ["0,1"], True):
        with pytest.raises(ConfigError, match="backend option gpus = .* is not GPUs: give"):
            get_launcher("local", gpus=bad).check_options({"gpus": bad})
