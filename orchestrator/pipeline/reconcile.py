"""Reconcile: no stage run stays RUNNING forever after its orchestrator died.

A stage run is RUNNING only while some process holds the lease on its identity and
heartbeats it. When that process crashes (or a Prefect worker is killed) the lease
expires and nobody will ever record the stage's end. At the start of every pipeline run
:func:`reconcile` finds RUNNING stage runs whose lease is gone, expired or now protects a
different stage run, revives the job handle from the stage run's last attempt, asks the
backend, and closes the stage run accordingly:

- job still PENDING/RUNNING: nobody will record its outputs, so it is cancelled and the
  stage run marked CANCELLED ("orphaned");
- job FAILED / CANCELLED / LOST: the stage run gets that state;
- job SUCCEEDED: LOST — the job finished but its outputs were never recorded, so the
  next run re-executes (or resumes from checkpoints in the same output folder);
- no attempt, or the backend no longer knows the job: LOST.

Pipeline runs get the same treatment (:func:`reconcile_pipeline_runs`): a pipeline run
holds a lease of its own (:func:`pipeline_lease_key`) for as long as its orchestrator
looks after it. A RUNNING pipeline run whose lease has expired (or is gone) and whose
stage runs have all ended was abandoned by a crashed process between or after its
stages; it is closed FAILED with an error naming the expired lease and each stage's end,
so the run list, the nightly's "previous successful run" and exports stop showing it
as in progress.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlmodel import col

from orchestrator.lineage import leases
from orchestrator.lineage.models import Attempt, Lease, PipelineRun, StageRun, utcnow
from orchestrator.lineage.store import LineageStore
from orchestrator.settings import Settings, load_settings

log = logging.getLogger("openlab.pipeline")


@dataclass(frozen=True)
class Reconciled:
    """One stale stage run and what it was closed as."""

    stage_run_id: str
    stage: str
    state: str
    reason: str
    job_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage_run_id": self.stage_run_id,
            "stage": self.stage,
            "state": self.state,
            "reason": self.reason,
            "job_id": self.job_id,
        }


@dataclass(frozen=True)
class ReconciledPipeline:
    """One abandoned pipeline run and what it was closed as."""

    pipeline_run_id: str
    state: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"pipeline_run_id": self.pipeline_run_id, "state": self.state, "reason": self.reason}


#: Stage-run states nobody has closed yet; a pipeline run with such a stage is not judged here.
UNFINISHED_STAGE_STATES = frozenset({"PENDING", "RUNNING"})


def pipeline_lease_key(pipeline_run_id: str) -> str:
    """The lease row a pipeline run's orchestrator heartbeats (stage leases are keyed by hex identities)."""
    return f"pipeline-run:{pipeline_run_id}"


def is_stale(store: LineageStore, run: StageRun) -> bool:
    """Whether no live lease protects this RUNNING stage run."""
    lease = leases.current(store, run.identity)
    if not leases.is_live(lease):
        return True
    return lease is not None and lease.stage_run_id is not None and lease.stage_run_id != run.id


def _judge(
    store: LineageStore, run: StageRun, settings: Settings, *, cancel: bool = True
) -> tuple[str, str, Attempt | None, Any]:
    """(state, reason, last attempt, backend status) for a stale stage run; ``cancel=False`` only asks.
    RUNNING: left as it is, its job being on a cluster this openlab does not reach, or its backend
    unreachable for now (a later pass asks again: recording LOST would be for good)."""
    from orchestrator.launchers.attempts import handle_from_attempt, lineage_state, unrecorded_job
    from orchestrator.launchers.base import BackendUnavailable, JobState, LauncherError, OtherCluster, get_launcher

    attempts = store.list(Attempt, stage_run_id=run.id, order_by=col(Attempt.number).desc(), limit=1)
    if not attempts:
        return "LOST", "its orchestrator ended before any job was submitted", None, None
    attempt = attempts[0]
    if not attempt.job_id and attempt.state != "PENDING":
        return "FAILED", f"job submission failed: {attempt.reason}", attempt, None
    try:
        launcher = get_launcher(attempt.backend, settings)
    except LauncherError as exc:
        return "LOST", f"backend {attempt.backend} cannot report job {attempt.job_id}: {exc}", attempt, None
    if not attempt.job_id:  # its orchestrator ended while submitting: the backend may have taken the job
        ended = f"its orchestrator ended while submitting a job to {attempt.backend}"
        try:
            attempt = unrecorded_job(store, launcher, attempt, record=cancel)
        except BackendUnavailable as exc:
            return "RUNNING", f"{ended}, which cannot be asked whether it took it now: {exc}", attempt, None
        except LauncherError as exc:
            return "LOST", f"{ended}, which cannot be asked whether it took it: {exc}", attempt, None
        if not attempt.job_id:
            return "LOST", f"{ended}, which holds no job of it", attempt, None
    try:
        handle = handle_from_attempt(attempt, launcher)
    except OtherCluster as exc:  # its job is on a cluster this openlab does not reach: not this reaper's to judge
        return "RUNNING", str(exc), attempt, None
    try:
        status = launcher.status(handle)
    except BackendUnavailable as exc:  # slurmctld or slurmdbd down for now: the job may be fine; ask again later
        return (
            "RUNNING",
            f"backend {attempt.backend} cannot be asked about job {attempt.job_id} now: {exc}",
            attempt,
            None,
        )
    except LauncherError as exc:
        return "LOST", f"backend {attempt.backend} cannot report job {attempt.job_id}: {exc}", attempt, None
    if not status.state.terminal:
        if not cancel:
            why = f"orphaned: no orchestrator looks after job {attempt.job_id}, which runs; it would be cancelled"
            return "CANCELLED", why, attempt, status
        try:
            launcher.cancel(handle)
        except LauncherError as exc:
            log.warning("could not cancel orphaned job %s: %s", attempt.job_id, exc)
        return (
            "CANCELLED",
            f"orphaned: no orchestrator looked after job {attempt.job_id}, which ran; job cancelled",
            attempt,
            status,
        )
    if status.state is JobState.SUCCEEDED:
        return (
            "LOST",
            f"job {attempt.job_id} succeeded but its orchestrator ended before recording outputs",
            attempt,
            status,
        )
    detail = f" ({status.reason})" if status.reason else ""
    return (
        # a preempted job's attempt says PREEMPTED; with no orchestrator left to run it again, the
        # stage run itself failed
        "FAILED" if status.state is JobState.PREEMPTED else lineage_state(status.state),
        f"job {attempt.job_id} ended {status.state}{detail} while unattended",
        attempt,
        status,
    )


def reconcile(store: LineageStore, *, settings: Settings | None = None, dry_run: bool = False) -> list[Reconciled]:
    """Close every RUNNING stage run whose lease has expired; return what was done.

    With ``dry_run`` nothing is cancelled or written: each stale run's job is only asked for
    its state, and the result says what a real reconcile would record.
    """
    from orchestrator.launchers.attempts import finish_attempt
    from orchestrator.launchers.base import JobState, JobStatus

    settings = settings or load_settings()
    done: list[Reconciled] = []
    for run in store.list(StageRun, state="RUNNING"):
        if not is_stale(store, run):
            continue
        state, reason, attempt, status = _judge(store, run, settings, cancel=not dry_run)
        if state == "RUNNING" or dry_run:  # RUNNING: left as it is (another cluster's job, or a backend down)
            if state == "RUNNING":
                log.warning("left stage run %s (%s) running: %s", run.id, run.stage, reason)
            done.append(Reconciled(run.id, run.stage, state, reason, attempt.job_id if attempt else None))
            continue
        current = store.get(StageRun, run.id)
        if current is None or current.state != "RUNNING" or not is_stale(store, current):
            continue  # its holder came back or another reconciler got there first
        with store.transaction() as tx:
            tx.update(current, state=state, error=f"reconciled: {reason}", ended_at=utcnow())
        if attempt is not None and attempt.state in ("PENDING", "RUNNING"):
            end = status or JobStatus(state=JobState.LOST, reason=reason)
            if not end.state.terminal:
                end = JobStatus(state=JobState.CANCELLED, reason=reason)
            try:
                finish_attempt(store, attempt, end)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not close attempt %s: %s", attempt.id, exc)
        log.warning("reconciled stale stage run %s (%s): %s - %s", run.id, run.stage, state, reason)
        done.append(Reconciled(run.id, run.stage, state, reason, attempt.job_id if attempt else None))
    return done


def _abandoned_since(lease: Lease | None, run: PipelineRun, grace: float) -> str | None:
    """Why nobody looks after ``run`` any more, or None while its orchestrator may still be alive.

    A run with no lease row at all is given ``grace`` seconds from its start: its orchestrator
    may be an older openlab that took no pipeline lease, or one that is about to.
    """
    if lease is not None:
        if leases.is_live(lease):
            return None
        if leases.holder_gone(lease):
            return f"its orchestrator {lease.holder} is gone (its process ended without closing the run)"
        expired = lease.expires_at if lease.expires_at.tzinfo else lease.expires_at.replace(tzinfo=dt.UTC)
        return f"its orchestrator {lease.holder} stopped heartbeating (lease expired {expired:%Y-%m-%d %H:%M:%S} UTC)"
    started = run.started_at if run.started_at.tzinfo else run.started_at.replace(tzinfo=dt.UTC)
    if (utcnow() - started).total_seconds() < grace:
        return None
    return f"no orchestrator holds its lease (started {started:%Y-%m-%d %H:%M:%S} UTC)"


def _closing_reason(why: str, ends: list[tuple[str, str]]) -> str:
    ended = ", ".join(f"{stage} {state}" for stage, state in ends) or "none had started"
    return f"reconciled: {why} before it closed the run (stages: {ended})"


def reconcile_pipeline_runs(
    store: LineageStore,
    *,
    grace: float = leases.DEFAULT_TTL,
    dry_run: bool = False,
    closing: Mapping[str, str] | None = None,
) -> list[ReconciledPipeline]:
    """Close RUNNING pipeline runs whose lease is not live and whose stages have all ended; return them.

    Run after :func:`reconcile`, which closes the stale stage runs first. Each run is judged
    again inside the closing transaction (writers serialise on it), so a run its orchestrator
    closes or heartbeats meanwhile is left alone. ``dry_run`` writes nothing; ``closing``
    maps the stage runs a dry-run :func:`reconcile` would close to the state it would give them.
    """
    from sqlmodel import select

    done: list[ReconciledPipeline] = []
    for run in store.list(PipelineRun, state="RUNNING"):
        key = pipeline_lease_key(run.id)
        why = _abandoned_since(leases.current(store, key), run, grace)
        if why is None:
            continue
        if dry_run:
            stages = store.list(StageRun, pipeline_run_id=run.id, order_by=col(StageRun.started_at))
            ends = [(s.stage, (closing or {}).get(s.id, s.state)) for s in stages]
            if not any(state in UNFINISHED_STAGE_STATES for _, state in ends):
                done.append(ReconciledPipeline(run.id, "FAILED", _closing_reason(why, ends)))
            continue
        with store.transaction() as tx:
            current = tx.get(PipelineRun, run.id)
            if current is None or current.state != "RUNNING":
                continue
            lease = tx.session.get(Lease, key)
            why = _abandoned_since(lease, current, grace)
            stages = list(
                tx.session.exec(
                    select(StageRun).where(StageRun.pipeline_run_id == run.id).order_by(col(StageRun.started_at))
                ).all()
            )
            if why is None or any(s.state in UNFINISHED_STAGE_STATES for s in stages):
                continue  # alive again, or a stage is still being looked after
            reason = _closing_reason(why, [(s.stage, s.state) for s in stages])
            tx.update(current, state="FAILED", error=reason, ended_at=utcnow())
            if lease is not None:  # coordination state, not lineage: dropped with the run's closing
                tx.session.delete(lease)
        log.warning("reconciled abandoned pipeline run %s: FAILED - %s", run.id, reason)
        done.append(ReconciledPipeline(run.id, "FAILED", reason))
    return done


@dataclass(frozen=True)
class ReconcileReport:
    """What one reconcile pass closed (or, on a dry run, would close)."""

    stage_runs: list[Reconciled]
    pipeline_runs: list[ReconciledPipeline]
    dry_run: bool = False

    def __bool__(self) -> bool:
        return bool(self.stage_runs or self.pipeline_runs)

    @property
    def left(self) -> list[Reconciled]:
        """Stale stage runs left RUNNING: their job is on a cluster this openlab does not reach,
        where only a reaper that reaches it may judge (or cancel) it."""
        return [r for r in self.stage_runs if r.state == "RUNNING"]

    def lines(self) -> list[str]:
        """One sentence per closed (or left) run, for a terminal or a Prefect log."""
        verb = "would close" if self.dry_run else "closed"
        out = []
        for r in self.stage_runs:
            job = f" job {r.job_id}" if r.job_id else ""
            if r.state == "RUNNING":
                out.append(f"left stage run {r.stage_run_id} ({r.stage}{job}) running: {r.reason}")
                continue
            out.append(f"{verb} stage run {r.stage_run_id} ({r.stage}{job}) as {r.state}: {r.reason}")
        for p in self.pipeline_runs:
            out.append(f"{verb} pipeline run {p.pipeline_run_id} as {p.state}: {p.reason}")
        return out

    @property
    def headline(self) -> str:
        n = len(self.stage_runs) - len(self.left) + len(self.pipeline_runs)
        verb = "Would close (dry run)" if self.dry_run else "Closed"
        left = f"; {len(self.left)} on another cluster left running" if self.left else ""
        return f"{verb}: {n} run(s) left RUNNING by dead orchestrators{left}"

    def markdown(self) -> str:
        """The report as a markdown table (the reaper flow's Prefect artifact)."""
        from orchestrator.cards import md_cell

        rows = [
            f"| stage run `{r.stage_run_id}` ({md_cell(r.stage)}) | {md_cell(r.job_id or '')} | {r.state} "
            f"| {md_cell(r.reason)} |"
            for r in self.stage_runs
        ]
        rows += [
            f"| pipeline run `{p.pipeline_run_id}` | | {p.state} | {md_cell(p.reason)} |" for p in self.pipeline_runs
        ]
        return "\n".join([f"**{self.headline}**", "", "| run | job | state | why |", "|---|---|---|---|", *rows])

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "stage_runs": [r.to_dict() for r in self.stage_runs],
            "pipeline_runs": [r.to_dict() for r in self.pipeline_runs],
        }


def reconcile_all(store: LineageStore, *, settings: Settings | None = None, dry_run: bool = False) -> ReconcileReport:
    """Stale stage runs first (cancelling their orphaned jobs), then the pipeline runs they leave abandoned."""
    stages = reconcile(store, settings=settings, dry_run=dry_run)
    closing = {r.stage_run_id: r.state for r in stages}
    pipelines = reconcile_pipeline_runs(store, dry_run=dry_run, closing=closing)
    return ReconcileReport(stages, pipelines, dry_run)


__all__ = [
    "ReconcileReport",
    "Reconciled",
    "ReconciledPipeline",
    "is_stale",
    "pipeline_lease_key",
    "reconcile",
    "reconcile_all",
    "reconcile_pipeline_runs",
]
