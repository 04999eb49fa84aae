"""Cancelling a flow run cancels its backend jobs and records the stage runs CANCELLED.

Prefect 3 cancels a served (or worker-run) flow run by killing its process: the runner
sends the cancel intent over its control channel, then SIGTERM, then SIGKILL after a
grace period, and runs the flow's ``on_cancellation`` hooks — in the flow process when
the SIGTERM lands as ``TerminationSignal``, and again in the runner process after the
kill. A Slurm job, a container or a Kubernetes Job does not die with that process, so
the hook must end it by its handle.

The handle is found through lineage, not through process memory, because the hook may
run in another process than the one that submitted the job: the flow run id is on
the :class:`PipelineRun`, its stage runs have attempts, and an attempt's ``job_id`` is
self-sufficient (:func:`orchestrator.launchers.attempts.handle_from_attempt`). So
:func:`cancel_flow_run_jobs` is idempotent and safe to run from both places.

What gets recorded: every unfinished attempt of the run becomes CANCELLED (also one the
interrupted flow process already closed as FAILED because of the termination signal),
every stage run that had not completed becomes CANCELLED, the pipeline run becomes
CANCELLED, and the leases those stage runs held are released so the next run of the
same identities need not wait for expiry.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlmodel import col

from orchestrator.launchers import get_launcher
from orchestrator.launchers.attempts import handle_from_attempt
from orchestrator.lineage.models import Attempt, Lease, PipelineRun, StageRun, utcnow
from orchestrator.lineage.store import LineageStore

log = logging.getLogger(__name__)

#: Stage-run states that are final on their own; anything else is cut short by a cancel.
SETTLED_STAGE_STATES = frozenset({"COMPLETED", "REUSED", "CANCELLED"})
#: Attempt states that mean the job may still be alive.
LIVE_ATTEMPT_STATES = frozenset({"PENDING", "RUNNING"})
#: How an interrupted flow process describes the attempt it closed (run_job's reason).
TERMINATION_MARKERS = ("TerminationSignal", "interrupted", "CancelledError")


def _cut_by_termination(attempt: Attempt) -> bool:
    return attempt.state == "FAILED" and any(m in (attempt.reason or "") for m in TERMINATION_MARKERS)


def cancel_flow_run_jobs(
    store: LineageStore, flow_run_id: str, *, reason: str = "flow run cancelled in Prefect"
) -> list[str]:
    """Cancel the backend jobs of ``flow_run_id``'s pipeline runs and record the cancel; returns job ids."""
    cancelled_jobs: list[str] = []
    runs = store.list(PipelineRun, flow_run_id=str(flow_run_id))
    for prun in runs:
        stages = store.list(StageRun, pipeline_run_id=prun.id, order_by=col(StageRun.started_at))
        for srun in stages:
            attempts = store.list(Attempt, stage_run_id=srun.id, order_by=col(Attempt.number))
            for attempt in attempts:
                if attempt.state in LIVE_ATTEMPT_STATES or _cut_by_termination(attempt):
                    cancelled_jobs.extend(_cancel_attempt(store, attempt, reason))
            if _cut_short(srun, attempts):
                with store.transaction() as tx:
                    tx.update(srun, state="CANCELLED", error=reason, ended_at=srun.ended_at or utcnow())
                _release_leases(store, [srun.id])
        if prun.state not in ("COMPLETED", "CANCELLED"):
            with store.transaction() as tx:
                tx.update(prun, state="CANCELLED", ended_at=prun.ended_at or utcnow())
    return cancelled_jobs


def _cut_short(srun: StageRun, attempts: list[Attempt]) -> bool:
    """Whether the cancel cut this stage run short (a stage that really failed stays FAILED)."""
    if srun.state in SETTLED_STAGE_STATES:
        return False
    if srun.state != "FAILED":
        return True
    if any(m in (srun.error or "") for m in TERMINATION_MARKERS):
        return True
    last = attempts[-1] if attempts else None
    return last is not None and (last.state in LIVE_ATTEMPT_STATES | {"CANCELLED"} or _cut_by_termination(last))


def _cancel_attempt(store: LineageStore, attempt: Attempt, reason: str) -> list[str]:
    """Cancel one attempt's job by its handle (best effort) and record the attempt CANCELLED."""
    jobs: list[str] = []
    if attempt.job_id:
        try:
            launcher = get_launcher(attempt.backend)
            launcher.cancel(handle_from_attempt(attempt))
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


__all__ = ["cancel_flow_run_jobs", "on_cancellation_hook"]
