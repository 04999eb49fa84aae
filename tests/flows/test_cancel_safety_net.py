"""The on_cancellation safety net: what a flow process killed before it could record anything left behind.

Real local job, real SQLite lineage; the records are those a SIGKILLed flow process leaves
(attempt and stage run RUNNING, pipeline run RUNNING, leases held; or, killed while submitting, an
attempt PENDING with no job id yet).
"""

from __future__ import annotations

import signal
import time

from flows.cancel import cancel_flow_run_jobs
from orchestrator.launchers import JobSpec, get_launcher
from orchestrator.launchers.attempts import mark_running, submit_attempt
from orchestrator.launchers.base import ATTEMPT_LABEL
from orchestrator.lineage import leases
from orchestrator.lineage.models import Attempt, PipelineRun, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.reconcile import pipeline_lease_key
from orchestrator.settings import load_settings
from tests.launchers.killed_submitter import run_killed_submitter


def test_safety_net_cancels_the_orphaned_job_and_leaves_real_failures_alone() -> None:
    settings = load_settings()
    launcher = get_launcher("local", settings)
    with LineageStore.open(settings) as store:
        with store.transaction() as tx:
            run = tx.add(PipelineRun(name="killed", flow_run_id="fr-killed", state="RUNNING"))
            failed = tx.add(
                StageRun(pipeline_run_id=run.id, stage="data", identity="i-data", state="FAILED", error="exit 3")
            )
            running = tx.add(StageRun(pipeline_run_id=run.id, stage="tokenize", identity="i-tok", state="RUNNING"))
        with store.transaction() as tx:
            tx.add(Attempt(stage_run_id=failed.id, backend="local", job_id="gone", state="FAILED", reason="exit 3"))
        attempt, handle = submit_attempt(
            store, launcher, JobSpec(name="orphan", command=["sleep", "60"]), stage_run_id=running.id
        )
        attempt = mark_running(store, attempt, launcher.status(handle))
        assert leases.acquire(store, "i-tok", "killed-process", ttl=600, stage_run_id=running.id)
        assert leases.acquire(store, pipeline_lease_key(run.id), "killed-process", ttl=600)

        jobs = cancel_flow_run_jobs(store, "fr-killed", reason="cancelled: test")

        assert jobs == [f"local:{handle.job_id}"]
        deadline = time.monotonic() + 15
        while not launcher.status(handle).state.terminal and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.status(handle).state.terminal, "the orphaned job still runs"
        assert store.require(Attempt, attempt.id).state == "CANCELLED"
        assert store.require(StageRun, running.id).state == "CANCELLED"
        assert store.require(StageRun, failed.id).state == "FAILED"  # a stage that really failed stays FAILED
        closed = store.require(PipelineRun, run.id)
        assert closed.state == "CANCELLED" and closed.error == "cancelled: test"
        assert store.list(leases.Lease) == []  # the next run of these identities need not wait for expiry
        assert cancel_flow_run_jobs(store, "fr-killed") == []  # the flow process and the runner may both call it


def test_crashed_flow_whose_submit_was_cut_short_by_sigkill_has_its_job_cancelled() -> None:
    """The flow process SIGKILLed right after the backend took a job, before its id was recorded: the
    on_crashed hook finds the job by the attempt recorded before the submit (its label) and cancels it.
    Before, the attempt was never recorded, and the job trained on with nobody to stop it."""
    settings = load_settings()
    launcher = get_launcher("local", settings)
    with LineageStore.open(settings) as store:
        with store.transaction() as tx:
            run = tx.add(PipelineRun(name="killed", flow_run_id="fr-sigkill", state="RUNNING"))
            stage = tx.add(StageRun(pipeline_run_id=run.id, stage="pretrain", identity="i-pre", state="RUNNING"))
        given = {"backend": "local", "config": {}, "name": "cut", "command": ["sleep", "60"], "image": None}
        child = run_killed_submitter({**given, "env": {}, "stage_run": stage.id}, timeout=60)
        assert child.returncode == -signal.SIGKILL, child.stderr
        (attempt,) = store.list(Attempt, stage_run_id=stage.id)
        (handle,) = launcher.find({ATTEMPT_LABEL: attempt.id})
        assert attempt.job_id is None and not launcher.status(handle).state.terminal

        jobs = cancel_flow_run_jobs(store, "fr-sigkill", reason="crashed: test", run_state="FAILED")

        assert jobs == [f"local:{handle.job_id}"]
        deadline = time.monotonic() + 15
        while not launcher.status(handle).state.terminal and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.status(handle).state.terminal, "the job whose submitter was killed still runs"
        closed = store.require(Attempt, attempt.id)
        assert (closed.job_id, closed.state) == (handle.job_id, "CANCELLED")
        assert store.require(PipelineRun, run.id).state == "FAILED"
