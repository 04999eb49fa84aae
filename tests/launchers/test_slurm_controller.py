"""What the Slurm launcher sends the controller and what it makes of the controller's answers.

- The caller's environment does not choose the job: ``SBATCH_*`` (which beat ``#SBATCH`` lines)
  and an enclosing job's ``SLURM_*`` (an orchestrator run inside an sbatch job) are not sbatch's
  input, nor the new job's environment; a job's own ``-e`` values reach it all the same.
- A log follower reads its file often and asks slurmctld at most every ``poll_interval``.
- A job Slurm says will never start (``DependencyNeverSatisfied``) ends FAILED, saying why.
- sacct failing (slurmdbd down) is "cannot say now", not "no such job" (LOST for good).
- sbatch that timed out after submitting is not run again: the job would run twice.

Against the real single-node cluster (``require_slurm``), with wrapper scripts in ``bin_dir`` in
front of the real commands where a failure or a count is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.launchers import BackendUnavailable, JobHandle, JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.slurm import parse_scontrol
from orchestrator.lineage.models import Attempt
from orchestrator.lineage.store import LineageStore
from tests.launchers.harness import Harness

TOOLS = ("sbatch", "squeue", "scontrol", "scancel", "sacct", "srun", "sinfo")


def wrapped_slurm(tmp_path: Path, **bodies: str) -> Path:
    """A bin dir of the real Slurm commands, with ``bodies`` (shell, ``$REAL`` the real command) in
    front of those named."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        real = shutil.which(tool)
        path = bin_dir / tool
        if tool in bodies:
            path.write_text(f"#!/bin/bash\nREAL={real or '/nonexistent/' + tool}\n{bodies[tool]}")
            path.chmod(0o755)
        elif real:
            path.symlink_to(real)
    return bin_dir


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
    return parse_scontrol(out.stdout.splitlines()[0])


def queued(job_id: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if line.strip()]


# -- A, B: the caller's environment ---------------------------------------------------------------


@pytest.mark.slurm
def test_sbatch_variables_of_the_callers_environment_do_not_choose_the_job(
    slurm_harness: Harness, store: LineageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SBATCH_PARTITION=batch SBATCH_TIMELIMIT=5 openlab job run -o partition=urgent --time-limit 2h``
    ran in batch with 5 minutes while lineage said urgent and 2 h: sbatch lets its input variables
    beat the script's ``#SBATCH`` lines. A job's own ``-e SBATCH_PARTITION`` reaches the job alone."""
    monkeypatch.setenv("SBATCH_PARTITION", "batch")
    monkeypatch.setenv("SBATCH_TIMELIMIT", "5")
    monkeypatch.setenv("SQUEUE_PARTITION", "batch")  # squeue would then not find the job, nor cancel wait for it
    script = 'echo "own=${SBATCH_PARTITION-unset} caller=${SBATCH_TIMELIMIT-unset} kept=$KEPT"'
    spec = JobSpec(
        name="sbatch-env",
        command=["bash", "-c", script],
        options={"partition": "urgent"},
        time_limit=7200,
        env={"SBATCH_PARTITION": "batch", "KEPT": "yes"},
    )
    lines: list[str] = []
    attempt, status = run_job(store, slurm_harness.launcher, spec, on_log=lines.append, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    job = scontrol_job(attempt.job_id)
    assert (job["Partition"], job["TimeLimit"]) == ("urgent", "02:00:00"), job
    assert lines == ["own=batch caller=unset kept=yes"], lines


def test_a_jobs_own_slurm_variables_are_passed_under_another_name_and_given_back() -> None:
    from orchestrator.launchers.slurm import passed_env

    given, renamed = passed_env({"SBATCH_PARTITION": "x", "SLURM_CONF": "/c", "PATH": "/bin", "SRUN-odd": "1"})
    assert given == {"OPENLAB_JOB_ENV__SBATCH_PARTITION": "x", "SLURM_CONF": "/c", "PATH": "/bin", "SRUN-odd": "1"}
    assert renamed == ["SBATCH_PARTITION"]
    script = get_launcher("slurm").batch_script(
        JobSpec(name="x", command=["true"], env={"SBATCH_PARTITION": "x", "A": "secret"}), "/l/slurm-%j.log"
    )
    assert 'export SBATCH_PARTITION="$OPENLAB_JOB_ENV__SBATCH_PARTITION"' in script
    assert "secret" not in script  # values never go into the script file


@pytest.mark.slurm
def test_a_job_submitted_from_inside_a_slurm_job_does_not_inherit_its_allocation(
    slurm_harness: Harness, store: LineageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An orchestrator running in an sbatch job (common on HPC) has the job's SLURM_* set; with
    ``--export=ALL`` they reached the new job, whose srun then refused to start:
    ``SLURM_MEM_PER_CPU, SLURM_MEM_PER_GPU, and SLURM_MEM_PER_NODE are mutually exclusive``."""
    monkeypatch.setenv("SLURM_MEM_PER_CPU", "100")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_OUTER_MARKER", "outer")
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")  # would turn the times the launcher parses into "Tomorr 12:00"
    spec = JobSpec(
        name="nested-alloc",
        command=["bash", "-c", 'echo "rank $RANK outer=${SLURM_OUTER_MARKER-none}"'],
        memory="500M",
        tasks_per_node=2,
    )
    lines: list[str] = []
    _attempt, status = run_job(store, slurm_harness.launcher, spec, on_log=lines.append, timeout=120)
    assert status.state is JobState.SUCCEEDED, (status, lines)
    assert status.started_at is not None and status.ended_at is not None
    assert sorted(line.split(": ", 1)[-1] for line in lines) == ["rank 0 outer=none", "rank 1 outer=none"], lines


# -- C: how often the log follower asks -----------------------------------------------------------


@pytest.mark.slurm
def test_a_log_follower_asks_the_controller_at_most_every_poll_interval(slurm_harness: Harness, tmp_path: Path) -> None:
    """``logs(follow=True)`` asked ``scontrol show job`` at every look at its file, ~10 times a
    second (a 21 s job: 211 calls), whatever ``poll_interval`` said."""
    calls = tmp_path / "scontrol.calls"
    bin_dir = wrapped_slurm(tmp_path, scontrol=f'echo "$*" >> {calls}\nexec "$REAL" "$@"\n')
    launcher = get_launcher("slurm", bin_dir=str(bin_dir), poll_interval=2)
    handle = launcher.submit(
        JobSpec(name="follow-count", command=["bash", "-c", "for i in 1 2 3 4 5 6; do echo $i; sleep 1; done"])
    )
    start = time.monotonic()
    lines = list(launcher.logs(handle, follow=True))
    took = time.monotonic() - start
    assert lines == ["1", "2", "3", "4", "5", "6"], lines
    asked = [c for c in calls.read_text().splitlines() if c.startswith("show job")]
    assert len(asked) <= took / 2 + 2, f"{len(asked)} scontrol calls in {took:.1f}s"
    assert launcher.status(handle).state is JobState.SUCCEEDED


# -- D: a job that can never start --------------------------------------------------------------


@pytest.mark.slurm
def test_a_job_whose_dependency_can_never_be_satisfied_fails_saying_why(
    slurm_harness: Harness, store: LineageStore
) -> None:
    """With ``--dependency=afterok:`` on a job that failed, squeue shows ``PD (DependencyNeverSatisfied)``
    and run_job waited for ever. Slurm says it will never start: it is cancelled and FAILED."""
    launcher = slurm_harness.launcher
    failed = launcher.submit(JobSpec(name="dep-fails", command=["bash", "-c", "exit 3"]))
    assert launcher.wait(failed, timeout=60).state is JobState.FAILED
    after = {"extra_args": [f"--dependency=afterok:{failed.job_id}"]}
    spec = JobSpec(name="dep-never", command=["true"], options=after)
    start = time.monotonic()
    attempt, status = run_job(store, launcher, spec, timeout=90)
    assert time.monotonic() - start < 60
    assert status.state is JobState.FAILED, status
    assert "DependencyNeverSatisfied" in (status.reason or ""), status
    assert queued(attempt.job_id) == []  # nothing left waiting in the queue
    recorded = store.get(Attempt, attempt.id)
    assert recorded.state == "FAILED" and "DependencyNeverSatisfied" in recorded.reason
    # a later look (scontrol: CANCELLED, Reason=DependencyNeverSatisfied) says the same, not "cancelled"
    later = launcher.status(JobHandle("slurm", attempt.job_id))
    assert later.state is JobState.FAILED and "DependencyNeverSatisfied" in (later.reason or ""), later
    # and so does job list's one squeue for many jobs
    both = launcher.statuses([JobHandle("slurm", attempt.job_id), failed])
    assert [s.state for s in both] == [JobState.FAILED, JobState.FAILED], both  # type: ignore[union-attr]
    # an array whose tasks can never start: every task FAILED, saying why
    shards = launcher.submit(JobSpec(name="dep-never-array", command=["true"], options={**after, "array": "0-1"}))
    status = launcher.wait(shards, timeout=60)
    assert status.state is JobState.FAILED and status.reason.startswith("2 of 2 tasks failed: task 0 (never"), status
    assert "DependencyNeverSatisfied" in status.reason and queued(shards.job_id) == []


# -- E: slurmdbd not answering ---------------------------------------------------------------------


FORGOTTEN = 'if [ "$1 $2" = "show job" ]; then echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi\n'
DBD_DOWN = (
    'echo "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection to host:'
    '127.0.0.1:6819: Connection refused" >&2\n'
    'echo "sacct: error: Problem talking to the database: Connection refused" >&2\nexit 1\n'
)


@pytest.mark.slurm
def test_sacct_failing_is_not_read_as_a_job_slurm_forgot(slurm_harness: Harness, tmp_path: Path) -> None:
    """scontrol has forgotten the job (MinJobAge) and slurmdbd does not answer: the job was
    recorded ``LOST 'slurm no longer knows job 999 (scontrol, sacct, jobcomp)'`` for good. It is
    BackendUnavailable (ask again later); the jobcomp log still answers where it knows the job."""
    jobcomp = tmp_path / "jobcomp.log"
    jobcomp.write_text(
        "JobId=77 UserId=root(0) GroupId=root(0) Name=train JobState=COMPLETED Partition=debug TimeLimit=1 "
        "StartTime=2026-12-02T19:06:52 EndTime=2026-12-02T19:08:01 NodeList=vm NodeCnt=1 ProcCnt=1 "
        "ExitCode=0:0 \n"
    )
    bin_dir = wrapped_slurm(tmp_path, scontrol=FORGOTTEN + 'exec "$REAL" "$@"\n', sacct=DBD_DOWN)
    launcher = get_launcher("slurm", bin_dir=str(bin_dir), jobcomp_loc=str(jobcomp), retries=0)
    with pytest.raises(BackendUnavailable, match="sacct failed: .*Connection refused"):
        launcher.status(JobHandle("slurm", "999"))
    assert launcher.status(JobHandle("slurm", "77")).state is JobState.SUCCEEDED
    # a cluster without accounting says so: that is "sacct does not know", and jobcomp alone answers
    (bin_dir / "sacct").write_text('#!/bin/sh\necho "sacct: error: Slurm accounting storage is disabled" >&2\nexit 1\n')
    assert launcher.status(JobHandle("slurm", "999")).state is JobState.LOST


# -- F: sbatch that timed out after submitting ----------------------------------------------------


@pytest.mark.slurm
def test_a_timed_out_sbatch_that_went_through_is_not_run_again(slurm_harness: Harness, tmp_path: Path) -> None:
    """sbatch was run again after "Socket timed out", which a submission that went through also
    says when its answer is lost: the job ran twice. The queue is asked for it first."""
    calls = tmp_path / "sbatch.calls"
    timed_out = (
        f'echo x >> {calls}\n"$REAL" "$@" > /dev/null || exit\n'
        'echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2\nexit 1\n'
    )
    launcher = get_launcher("slurm", bin_dir=str(wrapped_slurm(tmp_path, sbatch=timed_out)), retries=3)
    name = f"sbatch-once-{uuid.uuid4().hex[:8]}"
    try:
        handle = launcher.submit(JobSpec(name=name, command=["sleep", "30"]))
        assert calls.read_text().count("x") == 1
        out = subprocess.run(["squeue", "-h", f"--name={name}", "-o", "%i|%o"], capture_output=True, text=True).stdout
        assert out.split() == [f"{handle.job_id}|{handle.extra['script']}"], out
    finally:  # every job it submitted, however many that was
        subprocess.run(["scancel", f"--name={name}"], check=False)
    deadline = time.monotonic() + 30
    while queued(handle.job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert queued(handle.job_id) == []


def test_sbatch_is_run_again_only_once_the_queue_says_the_job_is_not_there(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in {
        "sbatch": (
            f"echo x >> {calls}\n"
            f'if [ "$(wc -l < {calls})" -lt 2 ]; then\n'
            '  echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2; exit 1\n'
            "fi\necho 4242\n"
        ),
        "squeue": f"echo q >> {calls}.q\nexit 0\n",  # the queue answers: no such job
    }.items():
        (bin_dir / tool).write_text("#!/bin/sh\n" + body)
        (bin_dir / tool).chmod(0o755)
    launcher = get_launcher("slurm", bin_dir=str(bin_dir), retries=3)
    assert launcher.submit(JobSpec(name="x", command=["true"])).job_id == "4242"
    assert calls.read_text().count("x") == 2 and Path(f"{calls}.q").read_text().count("q") == 1

    # the queue cannot say: sbatch is not run blind, and the error says the job may be there
    calls.unlink()
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\necho x >> {calls}\necho "sbatch: error: Socket timed out on send/recv operation" >&2\nexit 1\n'
    )
    (bin_dir / "squeue").write_text(
        '#!/bin/sh\necho "squeue: error: Socket timed out on send/recv operation" >&2\nexit 1\n'
    )
    with pytest.raises(BackendUnavailable, match="may have submitted the job all the same"):
        get_launcher("slurm", bin_dir=str(bin_dir), retries=2).submit(JobSpec(name="x", command=["true"]))
    assert calls.read_text().count("x") == 1


@pytest.mark.slurm
def test_the_log_of_a_job_queued_longer_than_half_a_minute_is_followed_once_it_runs() -> None:
    """A job waiting in the queue writes no log until it starts. The follower gave up on a missing
    log after 30 s, so ``openlab job run`` printed none of the job's output and ``job logs -f`` on a
    pending job returned at once with nothing, as the job then ran; ``tail -F`` waits."""
    import threading

    from tests.services import require_slurm

    require_slurm()
    launcher = get_launcher("slurm", sacct=False)
    spec = JobSpec(
        name="queued", command=["sh", "-c", "echo line-one; sleep 1; echo line-two"], options={"extra_args": ["--hold"]}
    )
    handle = launcher.submit(spec)  # held in the queue, as a job waiting for a busy cluster is
    lines: list[str] = []
    follower = threading.Thread(target=lambda: lines.extend(launcher.logs(handle, follow=True)), daemon=True)
    try:
        follower.start()
        time.sleep(33)
        assert follower.is_alive(), f"the follower gave up on a queued job: {lines}"
        subprocess.run(["scontrol", "release", handle.job_id], check=True, env=launcher._env())
        follower.join(90)
    finally:
        launcher.cancel(handle)
        launcher.cleanup(handle)
    assert not follower.is_alive() and lines[:2] == ["line-one", "line-two"], lines


@pytest.mark.slurm
def test_sacct_says_who_cancelled_a_job_and_an_unknown_job_is_not_said_cancelled(store: LineageStore) -> None:
    """A plain ``scancel`` from someone else (an admin) was recorded as openlab's own cancel, "cancelled":
    sacct's "CANCELLED by UID" lost its uid. And ``openlab job cancel 999999 --backend slurm`` said
    "slurm job 999999: CANCELLED", exit 0, for a job that never existed."""
    import pwd

    from tests.forked_cli import run_cli
    from tests.services import require_slurm_accounting

    require_slurm_accounting()
    launcher = get_launcher("slurm")
    handle = launcher.submit(JobSpec(name="cancelled-elsewhere", command=["sleep", "300"]))
    subprocess.run(["scancel", handle.job_id], check=True, env=launcher._env())
    deadline = time.monotonic() + 60
    while not (rows := launcher._sacct(handle.job_id) or []) or rows[0]["JobState"] != "CANCELLED":
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    me = pwd.getpwuid(os.getuid()).pw_name
    assert launcher._row_status(rows[0]).reason == f"cancelled by {me} (uid {os.getuid()})", rows
    launcher.cleanup(handle)

    unknown = run_cli(
        ["job", "cancel", "999999", "--backend", "slurm"], env=dict(os.environ), cwd=Path.cwd(), timeout=60
    )
    assert unknown.returncode == 2 and "slurm knows no job 999999" in unknown.stderr, unknown
    assert "CANCELLED" not in unknown.stdout


@pytest.mark.slurm
def test_a_working_directory_the_node_cannot_enter_fails_the_job(store: LineageStore, tmp_path: Path) -> None:
    """Slurm runs a job whose ``--chdir`` it cannot enter in /tmp instead, saying so in one line of the
    log only: the job ran somewhere else than asked, and was recorded SUCCEEDED."""
    from tests.services import require_slurm

    require_slurm()
    missing = tmp_path / "dir with space"  # not made
    spec = JobSpec(name="elsewhere", command=["sh", "-c", "pwd > ran-here"], workdir=str(missing))
    attempt, status = run_job(store, get_launcher("slurm"), spec, timeout=120)
    assert (status.state, status.exit_code) == (JobState.FAILED, 127), status
    assert f"cannot enter its working directory {missing}" in str(store.require(Attempt, attempt.id).reason)
    assert not (Path("/tmp") / "ran-here").exists()


@pytest.mark.slurm
def test_job_list_shows_why_a_requeued_job_waits_not_where_it_ran_before(store: LineageStore) -> None:
    """A job Slurm put back in the queue (requeued, preempted) showed the host of its last run where
    squeue shows why it waits: ``vm`` instead of ``(JobHeldAdmin)``."""
    from orchestrator.launchers.attempts import mark_running, submit_attempt
    from tests.forked_cli import run_cli
    from tests.services import require_slurm

    require_slurm()
    launcher = get_launcher("slurm")
    attempt, handle = submit_attempt(store, launcher, JobSpec(name="requeued", command=["sleep", "300"]))
    try:
        deadline = time.monotonic() + 60
        while (status := launcher.status(handle)).state is not JobState.RUNNING:
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        attempt = mark_running(store, attempt, status)
        assert attempt.host
        subprocess.run(["scontrol", "requeuehold", handle.job_id], check=True, env=launcher._env())
        deadline = time.monotonic() + 60
        while (status := launcher.status(handle)).state is not JobState.PENDING:
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        listed = run_cli(["job", "list", "--json"], env=dict(os.environ), cwd=Path.cwd(), timeout=60)
        (row,) = [r for r in json.loads(listed.stdout) if r["job_id"] == handle.job_id]
        assert (row["state"], row["host"], row["reason"]) == ("PENDING", None, status.reason), row
    finally:
        launcher.cancel(handle)
