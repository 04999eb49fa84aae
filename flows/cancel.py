"""The safety net of cancellation: jobs and records a killed flow process could not close.

Prefect 3 cancels a served (or worker-run) flow run by killing its process: the runner
sends the cancel intent over its control channel, then SIGTERM, then SIGKILL after a
grace period, and runs the flow's ``on_cancellation`` hooks — in the flow process when
the SIGTERM lands as ``TerminationSignal``, and again in the runner process after the
kill. The SIGTERM itself is handled where the job runs: ``TerminationSignal`` is a
``BaseException``, and :func:`orchestrator.launchers.attempts.run_job` and
:func:`orchestrator.pipeline.execute.execute_stage` cancel the job and record the
attempt and the stage run CANCELLED on the way out. This hook is for what that cannot
cover: a process SIGKILLed (or stuck) before it recorded anything, whose Slurm job,
container or Kubernetes Job does not die with it and must be ended by its handle.

The handle is found through lineage, not through process memory, because the hook may
run in another process than the one that submitted the job: the flow run id is on
the :class:`PipelineRun`, its stage runs have attempts, and an attempt's ``job_id`` is
self-sufficient (:func:`orchestrator.launchers.attempts.handle_from_attempt`). So
:func:`cancel_flow_run_jobs` is idempotent and safe to run from both places.

What gets recorded: every attempt still PENDING/RUNNING becomes CANCELLED, every stage
run still PENDING/RUNNING becomes CANCELLED, a pipeline run still RUNNING becomes
CANCELLED, and the leases those stage runs held are released so the next run of the same
identities need not wait for expiry. What already ended keeps its state: a stage that
really failed stays FAILED. On a cancel, the stages' task runs it cut short are marked Cancelled
too: the SIGTERM leaves the running one Crashed in the UI.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlmodel import col

from orchestrator.launchers import get_launcher
from orchestrator.launchers.attempts import handle_from_attempt, unrecorded_job
from orchestrator.lineage.models import Attempt, Lease, PipelineRun, StageRun, utcnow
from orchestrator.lineage.store import LineageStore

log = logging.getLogger(__name__)

#: States of attempts and stage runs that nobody has closed yet: only these are cut short by a cancel.
UNFINISHED_STATES = frozenset({"PENDING", "RUNNING"})


def cancel_flow_run_jobs(
    store: LineageStore,
    flow_run_id: str,
    *,
    reason: str = "flow run cancelled in Prefect",
    run_state: str = "CANCELLED",
) -> list[str]:
    """Cancel the backend jobs of ``flow_run_id``'s pipeline runs and record the cancel; returns job ids.

    ``run_state`` is what a still-RUNNING pipeline run becomes: CANCELLED when a person
    cancelled it, FAILED when its flow process crashed (nobody asked for the stop).
    """
    cancelled_jobs: list[str] = []
    runs = store.list(PipelineRun, flow_run_id=str(flow_run_id))
    for prun in runs:
        stages = store.list(StageRun, pipeline_run_id=prun.id, order_by=col(StageRun.started_at))
        for srun in stages:
            for attempt in store.list(Attempt, stage_run_id=srun.id, order_by=col(Attempt.number)):
                if attempt.state in UNFINISHED_STATES:
                    cancelled_jobs.extend(_cancel_attempt(store, attempt, reason))
            if srun.state in UNFINISHED_STATES:
                with store.transaction() as tx:
                    tx.update(srun, state="CANCELLED", error=reason, ended_at=srun.ended_at or utcnow())
                _release_leases(store, [srun.id])
        if prun.state == "RUNNING":
            with store.transaction() as tx:
                tx.update(prun, state=run_state, error=reason, ended_at=prun.ended_at or utcnow())
        _release_pipeline_lease(store, prun.id)
    return cancelled_jobs


def _cancel_attempt(store: LineageStore, attempt: Attempt, reason: str) -> list[str]:
    """Cancel one attempt's job by its handle (best effort) and record the attempt CANCELLED."""
    jobs: list[str] = []
    if not attempt.job_id:  # its submitter may have died after the backend took the job, before recording it
        try:
            attempt = unrecorded_job(store, get_launcher(attempt.backend), attempt)
        except Exception as exc:  # noqa: BLE001 - record what we can even if the backend cannot be asked
            log.warning("could not look for the %s job of attempt %s: %s", attempt.backend, attempt.id, exc)
    if attempt.job_id:
        try:
            launcher = get_launcher(attempt.backend)
            launcher.cancel(handle_from_attempt(attempt, launcher))  # never a same-numbered job elsewhere
            jobs.append(f"{attempt.backend}:{attempt.job_id}")
            log.info("cancelled %s job %s (attempt %s)", attempt.backend, attempt.job_id, attempt.id)
        except Exception as exc:  # noqa: BLE001 - record what we can even if the backend refuses
            log.warning("could not cancel %s job %s: %s", attempt.backend, attempt.job_id, exc)
    if attempt.state != "CANCELLED":
        with store.transaction() as tx:
            tx.update(attempt, state="CANCELLED", reason=reason, ended_at=attempt.ended_at or utcnow())
    return jobs


def _release_leases(store: LineageStore, stage_run_ids: list[str]) -> None:
    from orchestrator.lineage import leases

    for lease in store.list(Lease, where=[col(Lease.stage_run_id).in_(stage_run_ids)]):
        leases.release(store, lease.identity, lease.holder)


def _release_pipeline_lease(store: LineageStore, pipeline_run_id: str) -> None:
    """Drop the pipeline run's own lease: the run is closed, nobody looks after it any more."""
    from orchestrator.lineage import leases
    from orchestrator.pipeline.reconcile import pipeline_lease_key

    key = pipeline_lease_key(pipeline_run_id)
    lease = leases.current(store, key)
    if lease is not None:
        leases.release(store, key, lease.holder)


def on_cancellation_hook(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect ``on_cancellation`` hook: cancel this flow run's jobs through lineage."""
    from prefect.logging import get_logger

    logger = get_logger("openlab.cancel")
    message = getattr(state, "message", None) or "flow run cancelled in Prefect"
    try:
        with LineageStore.open() as store:
            jobs = cancel_flow_run_jobs(store, str(flow_run.id), reason=f"cancelled: {message}")
    except Exception as exc:  # noqa: BLE001 - a hook must not hide the cancellation itself
        logger.error("openlab could not cancel the jobs of flow run %s: %s", flow_run.id, exc)
        return
    if jobs:
        logger.info("openlab cancelled backend jobs of flow run %s: %s", flow_run.id, ", ".join(jobs))
    try:
        _cancel_task_runs(flow_run.id, message)
    except Exception as exc:  # noqa: BLE001 - the run is cancelled all the same; only its tasks' look is off
        logger.warning("openlab could not mark the stages of flow run %s Cancelled: %s", flow_run.id, exc)


#: Task-run states a cancel leaves behind: the stage cut short by the SIGTERM reads Crashed ("Execution
#: was aborted by a termination signal"), one not yet started Pending or Scheduled.
_CUT_SHORT = frozenset({"CRASHED", "RUNNING", "PENDING", "SCHEDULED"})


def _cancel_task_runs(flow_run_id: Any, message: str) -> None:
    """Mark the task runs a cancel cut short Cancelled, as lineage records their stages: the UI showed
    the stage a person cancelled as Crashed, which reads as a bug in it. Idempotent, as the hook runs
    twice (the flow process, then the runner)."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        of_run = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
        for task_run in client.read_task_runs(task_run_filter=of_run):
            if task_run.state is not None and task_run.state.type.value in _CUT_SHORT:
                client.set_task_run_state(
                    task_run.id, Cancelled(message=f"cancelled with its flow run: {message}"), force=True
                )


def on_crashed_hook(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect ``on_crashed`` hook: the flow process died (SIGKILL, OOM); end its jobs now.

    The runner that started the process sees it exit, marks the flow run Crashed and runs
    this hook in its own process, so the orphaned Slurm job, container or Kubernetes Job is
    cancelled at once instead of when the stage's lease expires and a reconcile finds it.
    The jobs' attempts and stages are recorded CANCELLED (openlab stopped them) and the
    pipeline run FAILED, each with the crash message.
    """
    from prefect.logging import get_logger

    logger = get_logger("openlab.cancel")
    message = getattr(state, "message", None) or "flow process crashed"
    try:
        with LineageStore.open() as store:
            jobs = cancel_flow_run_jobs(store, str(flow_run.id), reason=f"crashed: {message}", run_state="FAILED")
    except Exception as exc:  # noqa: BLE001 - the reaper (lineage-reconcile) still gets them after lease expiry
        logger.error("openlab could not cancel the jobs of crashed flow run %s: %s", flow_run.id, exc)
        return
    if jobs:
        logger.info("openlab cancelled backend jobs of crashed flow run %s: %s", flow_run.id, ", ".join(jobs))


__all__ = ["cancel_flow_run_jobs", "on_cancellation_hook", "on_crashed_hook"]
