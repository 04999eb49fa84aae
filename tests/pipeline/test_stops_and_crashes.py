"""A run stopped from outside is recorded CANCELLED where it stops; a crashed run is closed at the next start.

Real local jobs, real SQLite lineage in a fresh OPENLAB_HOME (tests/conftest.py), the toy
pipeline of tests/pipeline/toy.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.exceptions import TerminationSignal

from orchestrator.lineage import leases
from orchestrator.lineage.models import Attempt, PipelineRun, StageRun, utcnow
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline import PipelineHooks, RunOptions, run_pipeline, start_pipeline
from orchestrator.pipeline.reconcile import pipeline_lease_key, reconcile_pipeline_runs
from tests.pipeline.toy import make_repo, toy_configs, toy_pipeline

HERE = Path(__file__).resolve().parent


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path)


def _pid_gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize(
    ("stop", "reason"),
    [
        (TerminationSignal(signal.SIGTERM), "interrupted (TerminationSignal)"),  # Prefect cancelling the flow run
        (asyncio.CancelledError(), "interrupted (CancelledError)"),
        (KeyboardInterrupt(), "interrupted"),
    ],
    ids=["prefect-termination", "asyncio-cancel", "ctrl-c"],
)
def test_stop_from_outside_cancels_the_job_and_records_cancelled(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException, reason: str
) -> None:
    """The stop arrives while the job runs (as a signal would, in the polling loop): the job is
    killed and attempt, stage run and pipeline run say CANCELLED, not FAILED; no lease is left."""
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("TOY_LEDGER", str(ledger))
    monkeypatch.setenv("TOY_SLEEP", "60")

    def stop_once_the_job_runs() -> bool:
        if ledger.exists() and ledger.read_text().strip():
            raise stop
        return False

    hooks = PipelineHooks(should_cancel=stop_once_the_job_runs)
    with pytest.raises(type(stop)):
        run_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(lease_ttl=10, poll=0.05), hooks=hooks)

    pid = int(ledger.read_text().split()[1])
    deadline = time.monotonic() + 10
    while not _pid_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pid_gone(pid), "the job kept running after the stop"
    with LineageStore.open() as store:
        (run,) = store.list(PipelineRun)
        assert run.state == "CANCELLED" and run.error == reason
        (stage,) = store.list(StageRun, pipeline_run_id=run.id)
        assert (stage.stage, stage.state, stage.error) == ("gen", "CANCELLED", reason)
        (attempt,) = store.list(Attempt, stage_run_id=stage.id)
        assert (attempt.state, attempt.reason) == ("CANCELLED", reason) and attempt.ended_at is not None
        assert store.list(leases.Lease) == []  # the stage's and the pipeline run's leases were given up


#: Runs the toy pipeline's first stage, then dies without closing its pipeline run (SIGKILL, OOM, power cut).
CRASHING = """
import os, sys
from pathlib import Path
from orchestrator.pipeline import RunOptions, execute_stage, start_pipeline
from tests.pipeline.toy import toy_configs, toy_pipeline
ctx = start_pipeline(toy_pipeline(Path(sys.argv[1])), toy_configs(), options=RunOptions(lease_ttl=4.0))
execute_stage(ctx, "gen")
print(ctx.id, flush=True)
os._exit(9)
"""


def test_pipeline_run_of_a_crashed_process_is_closed_failed_at_the_next_start(repo: Path) -> None:
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING, str(repo)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE.parents[1],
        env={**os.environ, "PYTHONPATH": str(HERE.parents[1])},
    )
    assert crashed.returncode == 9, crashed.stderr[-2000:]
    crashed_id = crashed.stdout.split()[-1]

    with LineageStore.open() as store:
        assert store.require(PipelineRun, crashed_id).state == "RUNNING"
        # As if it had run on another machine: its process cannot be looked up from here, so until
        # its lease expires nobody can tell a crash from a pause between stages: left alone.
        with store.transaction() as tx:
            lease = tx.session.get(leases.Lease, pipeline_lease_key(crashed_id))
            assert lease is not None and lease.process
            lease.process = "another-machine/" + lease.process.split("/", 1)[1]
            tx.session.add(lease)
        assert reconcile_pipeline_runs(store) == []
        # A run whose orchestrator is alive and between stages (all its stages ended) is left alone, too.
        alive = start_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(lease_ttl=30), store=store)
        deadline = time.monotonic() + 10
        while leases.is_live(leases.current(store, pipeline_lease_key(crashed_id))):
            assert time.monotonic() < deadline, "the crashed holder's 4 s lease never expired"
            time.sleep(0.1)

        later = start_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(lease_ttl=30), store=store)

        closed = store.require(PipelineRun, crashed_id)
        assert closed.state == "FAILED" and closed.ended_at is not None
        assert "stopped heartbeating" in closed.error and "gen COMPLETED" in closed.error, closed.error
        assert leases.current(store, pipeline_lease_key(crashed_id)) is None
        for ctx in (alive, later):
            assert store.require(PipelineRun, ctx.id).state == "RUNNING"
        assert reconcile_pipeline_runs(store) == []  # nothing left to close; the live runs still heartbeat
        for ctx in (alive, later):
            ctx.lease.release()


def test_reconcile_pipeline_runs_waits_for_unfinished_stages_and_for_runs_without_a_lease(repo: Path) -> None:
    """A RUNNING stage is the stage reconcile's to judge first; a lease-less run (older openlab) gets a grace."""
    with LineageStore.open() as store:
        with store.transaction() as tx:
            busy = tx.add(PipelineRun(name="busy", state="RUNNING"))
            tx.add(StageRun(pipeline_run_id=busy.id, stage="gen", identity="i-busy", state="RUNNING"))
            fresh = tx.add(PipelineRun(name="fresh, no lease", state="RUNNING"))
        assert leases.acquire(store, pipeline_lease_key(busy.id), "dead", ttl=0.01)
        time.sleep(0.05)
        assert reconcile_pipeline_runs(store) == []
        (done,) = reconcile_pipeline_runs(store, grace=0)
        assert done.pipeline_run_id == fresh.id and done.state == "FAILED"
        assert "no orchestrator holds its lease" in done.reason and "none had started" in done.reason
        assert store.require(PipelineRun, busy.id).state == "RUNNING"
        assert store.require(PipelineRun, fresh.id).error == done.reason


#: Starts the toy pipeline's first stage (a long job) with a short lease and waits to be killed.
KILLED_MID_STAGE = """
import sys
from pathlib import Path
from orchestrator.pipeline import RunOptions, execute_stage, start_pipeline
from tests.pipeline.toy import toy_configs, toy_pipeline
ctx = start_pipeline(toy_pipeline(Path(sys.argv[1])), toy_configs(), options=RunOptions(poll=0.05))
print(ctx.id, flush=True)
execute_stage(ctx, "gen")
"""


def test_lineage_reconcile_frees_the_job_of_a_killed_orchestrator_now(
    repo: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL the process that runs a stage: its job lives on (it is its own session, as a Slurm job would
    be). `openlab lineage reconcile --dry-run` names it and changes nothing; `openlab lineage reconcile`
    cancels the job and closes stage, attempt and pipeline run at once, without a new pipeline start, and
    without waiting for the dead holder's 90 s lease to expire."""
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("TOY_LEDGER", str(ledger))
    monkeypatch.setenv("TOY_SLEEP", "120")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_STAGE, str(repo)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE.parents[1],
        env={**os.environ, "PYTHONPATH": str(HERE.parents[1])},
    )
    try:
        assert proc.stdout is not None
        prun_id = proc.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while not (ledger.exists() and ledger.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, "the stage's job never started"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    job_pid = int(ledger.read_text().split()[1])
    assert not _pid_gone(job_pid), "the job died with its orchestrator; nothing would be orphaned"

    with LineageStore.open() as store:
        (stage,) = store.list(StageRun, pipeline_run_id=prun_id)
        (attempt,) = store.list(Attempt, stage_run_id=stage.id)
        # The default 90 s lease has not expired, but its holder's process is gone: nothing to wait for.
        lease = leases.current(store, stage.identity)
        assert lease is not None and lease.expires_at.replace(tzinfo=dt.UTC) > utcnow() + dt.timedelta(seconds=30)
        assert not leases.is_live(lease)

    dry = run_cli("lineage", "reconcile", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert [(r["stage_run_id"], r["state"], r["job_id"]) for r in planned["stage_runs"]] == [
        (stage.id, "CANCELLED", attempt.job_id)
    ]
    assert [(r["pipeline_run_id"], r["state"]) for r in planned["pipeline_runs"]] == [(prun_id, "FAILED")]
    assert "gen CANCELLED" in planned["pipeline_runs"][0]["reason"]
    assert not _pid_gone(job_pid), "--dry-run cancelled the job"
    with LineageStore.open() as store:
        assert store.require(StageRun, stage.id).state == "RUNNING"
        assert store.require(PipelineRun, prun_id).state == "RUNNING"

    real = run_cli("lineage", "reconcile")
    assert real.returncode == 0, real.stderr
    assert f"closed stage run {stage.id} (gen job {attempt.job_id}) as CANCELLED" in real.stdout, real.stdout
    assert f"closed pipeline run {prun_id} as FAILED" in real.stdout, real.stdout
    deadline = time.monotonic() + 15
    while not _pid_gone(job_pid):
        assert time.monotonic() < deadline, "the orphaned job kept running after reconcile"
        time.sleep(0.05)
    with LineageStore.open() as store:
        assert store.require(StageRun, stage.id).state == "CANCELLED"
        assert store.require(Attempt, attempt.id).state == "CANCELLED"
        closed = store.require(PipelineRun, prun_id)
        assert closed.state == "FAILED" and "gen CANCELLED" in closed.error
    again = run_cli("lineage", "reconcile")
    assert again.returncode == 0 and "nothing to reconcile" in again.stdout, again.stdout
