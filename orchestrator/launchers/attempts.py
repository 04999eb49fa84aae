"""The one place where job submissions become lineage :class:`Attempt` records.

Flows call :func:`run_job` once per stage; the CLI's ``openlab job run`` does the same.
Whatever happens — success, failure, a submit the backend refuses, Ctrl-C, a crash in
the caller's log callback — the attempt row ends with a terminal state and a reason, and
a job that was started is cancelled before the exception propagates. Only the command is
recorded, never the environment (values of secrets must not reach lineage).

Attempt states use the lineage vocabulary (:data:`orchestrator.lineage.models.STATES`):
a :attr:`JobState.SUCCEEDED` job is recorded as ``COMPLETED``; the others keep their names.

A handle is revived from an attempt with :func:`handle_from_attempt`: every backend makes
its ``job_id`` self-sufficient (a Kubernetes id is ``namespace/name``), so
``openlab job status ID`` works from any process.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import func
from sqlmodel import select

from orchestrator.errors import OpenlabError, Terminated
from orchestrator.launchers.base import (
    ATTEMPT_LABEL,
    BackendUnavailable,
    Backoff,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    JobTimeout,
    Launcher,
    stopped_from_outside,
)
from orchestrator.lineage.models import Attempt, utcnow
from orchestrator.provenance.invocation import current_user
from orchestrator.secrets import redact_argv, scrub

if TYPE_CHECKING:
    from orchestrator.lineage.store import LineageStore

log = logging.getLogger(__name__)

#: How long to keep draining logs after the job ended before recording the end anyway.
LOG_DRAIN_TIMEOUT = 10.0
#: Longest a cancel request waits to be acted on while :func:`run_job` waits between status looks.
CANCEL_CHECK_SECONDS = 0.25


def lineage_state(state: JobState) -> str:
    """The lineage name of a job state (``SUCCEEDED`` is ``COMPLETED`` in lineage)."""
    return "COMPLETED" if state is JobState.SUCCEEDED else str(state)


#: Attempt states (lineage's names) of a job that has ended: nothing its backend says changes them.
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "LOST", "PREEMPTED")


def recorded_status(attempt: Attempt) -> JobStatus:
    """An ended attempt's status as lineage recorded it (:func:`lineage_state` read back), for when
    its backend cannot be asked."""
    state = JobState.SUCCEEDED if attempt.state == "COMPLETED" else JobState(attempt.state)
    return JobStatus(
        state,
        attempt.exit_code,
        attempt.reason,
        attempt.host,
        attempt.started_at,
        attempt.ended_at,
        attempt.image_digest,
        usage=attempt.used,
    )


def next_attempt_number(store: LineageStore, stage_run_id: str | None) -> int:
    """Previous attempts of this stage run + 1 (1 for a job outside any stage run)."""
    if stage_run_id is None:
        return 1
    with store.session() as session:
        count = session.exec(
            select(func.count()).select_from(Attempt).where(Attempt.stage_run_id == stage_run_id)
        ).one()
    return int(count) + 1


def handle_from_attempt(attempt: Attempt, launcher: Launcher | None = None) -> JobHandle:
    """Revive the handle of a recorded attempt. Given the ``launcher`` it will be used with, raise
    :class:`~orchestrator.launchers.base.OtherCluster` when that launcher talks to another cluster
    than the one that ran the job: there its id is nobody's job, or somebody else's."""
    if not attempt.job_id:
        from orchestrator.launchers.base import JobNotFound

        raise JobNotFound(f"attempt {attempt.id} has no job id: its submission failed ({attempt.reason})")
    if launcher is not None:
        launcher.check_cluster(attempt.cluster, f"attempt {attempt.id} (job {attempt.job_id})")
    # a Slurm array's task list (its `array` option, as recorded): the tasks slurmctld has forgotten are
    # looked up elsewhere, not left out of the array's end (SlurmLauncher._with_forgotten_tasks)
    array = ((attempt.resources or {}).get("options") or {}).get("array")
    extra = {"array": True, "array_tasks": str(array)} if array else {}
    return JobHandle(backend=attempt.backend, job_id=attempt.job_id, log_path=attempt.log_path, extra=extra)


def submit_attempt(
    store: LineageStore, launcher: Launcher, spec: JobSpec, *, stage_run_id: str | None = None
) -> tuple[Attempt, JobHandle]:
    """Submit ``spec`` and record the attempt; a refused submit is recorded FAILED and re-raised
    (a job the backend could never run as asked is refused first, with nothing recorded).

    The attempt is recorded (PENDING, no job id) before the job is submitted, and the job carries its
    id (:data:`~orchestrator.launchers.base.ATTEMPT_LABEL`): a submitter killed after the backend took
    the job and before its id was written (SIGKILL, the OOM killer, a lost node) leaves an attempt the
    reaper finds the job of (:func:`orchestrator.pipeline.reconcile.reconcile`), not a job that trains
    on unrecorded."""
    launcher.refuse_unsupported(spec)
    if stage_run_id is not None:
        _require_stage_run(store, stage_run_id)
    number = next_attempt_number(store, stage_run_id)
    secrets = spec.secret_values()  # the job's own (``-e MY_TOKEN=...``), which the store cannot know
    attempt = Attempt(
        stage_run_id=stage_run_id,
        number=number,
        backend=launcher.name,
        cluster=launcher.cluster,
        job_name=spec.name,
        image=launcher.image_name(spec),  # the image that runs, also when it is the backend's default
        # secret options and NAME=value masked as in a run's command, the job's own secret values
        # scrubbed (this process's: by the store's gate)
        command=redact_argv(spec.command, secrets),
        user=current_user(),
        resources=spec.resources() or None,
        state="PENDING",
    )
    with store.transaction() as tx:
        attempt = tx.add(attempt)
    spec = dataclasses.replace(spec, labels={**spec.labels, ATTEMPT_LABEL: attempt.id})
    try:
        handle = launcher.submit(spec)
    except BaseException as exc:
        stopped = interruption_reason(exc)
        with store.transaction() as tx:
            attempt = tx.update(
                attempt,
                state="CANCELLED" if stopped else "FAILED",
                reason=f"submit {stopped}" if stopped else f"submit failed: {scrub(_one_line(exc), secrets)}",
                ended_at=utcnow(),
            )
        raise
    with store.transaction() as tx:
        attempt = tx.update(attempt, job_id=handle.job_id, log_path=handle.log_path)
    return attempt, handle


def unrecorded_job(store: LineageStore, launcher: Launcher, attempt: Attempt, *, record: bool = True) -> Attempt:
    """``attempt`` with the id of its job where its submitter died (SIGKILL, a lost node) between the
    backend taking the job and lineage recording the job's id (:func:`submit_attempt`): the job is
    found by its :data:`~orchestrator.launchers.base.ATTEMPT_LABEL`, and with ``record`` its id
    written. An attempt with a job id, or whose submit ended, is returned as it is, as is one whose
    backend holds no job of it. Raises what :meth:`~orchestrator.launchers.base.Launcher.find` raises."""
    if attempt.job_id or attempt.state != "PENDING":
        return attempt
    found = launcher.find({ATTEMPT_LABEL: attempt.id})
    if not found:
        return attempt
    if not record:
        return attempt.model_copy(update={"job_id": found[0].job_id, "log_path": found[0].log_path})
    with store.transaction() as tx:
        return tx.update(attempt, job_id=found[0].job_id, log_path=found[0].log_path)


def _require_stage_run(store: LineageStore, stage_run_id: str) -> None:
    """Refuse, before anything is submitted, an attempt for a stage run lineage does not hold: the
    job would run, and then its attempt could not be recorded (nor found, nor cancelled)."""
    from orchestrator.lineage.models import StageRun

    if store.get(StageRun, stage_run_id) is None:
        raise OpenlabError(
            f"no stage run {stage_run_id!r} in lineage: give the full id of a recorded stage run "
            "(openlab lineage show PIPELINE_RUN lists them), or leave the stage run out"
        )


def mark_running(store: LineageStore, attempt: Attempt, status: JobStatus) -> Attempt:
    """Record that the job started (once), with its host and start time."""
    if attempt.state == "RUNNING":
        return attempt
    with store.transaction() as tx:
        return tx.update(
            attempt,
            state="RUNNING",
            started_at=max(status.started_at or utcnow(), attempt.submitted_at),
            host=status.host or attempt.host,
            image_digest=status.image_digest or attempt.image_digest,
            granted=status.granted or attempt.granted,
        )


def finish_attempt(store: LineageStore, attempt: Attempt, status: JobStatus) -> Attempt:
    """Record the end of an attempt: state, exit code, reason, host, image digest, times."""
    # Slurm and Kubernetes report whole seconds: never let a job end (or start) before it was submitted
    floor = attempt.submitted_at
    started = attempt.started_at or status.started_at
    ended = status.ended_at or utcnow()
    changes: dict[str, Any] = {
        "state": lineage_state(status.state),
        "exit_code": status.exit_code,
        "reason": status.reason,
        "host": status.host or attempt.host,
        "image_digest": status.image_digest or attempt.image_digest,
        "granted": status.granted or attempt.granted,
        "started_at": max(started, floor) if started and floor else started,
        "ended_at": max(ended, floor) if floor else ended,
    }
    if status.tasks:
        changes["tasks"] = {task: _task_record(t) for task, t in status.tasks.items()}
    if status.usage:
        changes["used"] = dict(status.usage)
    with store.transaction() as tx:
        return tx.update(attempt, **changes)


def _task_record(status: JobStatus) -> dict[str, Any]:
    """One task's end as lineage keeps it: the status as the CLI shows it, in lineage state names."""
    record = status.to_dict()
    record["state"] = lineage_state(status.state)
    record.pop("image_digest", None)  # a property of the job, kept on the attempt itself
    if record.get("usage") is None:
        record.pop("usage", None)
    return record


def interruption_reason(exc: BaseException) -> str | None:
    """Why the caller was stopped from outside, or None when ``exc`` is an ordinary error.

    A ``BaseException`` that is not an ``Exception`` — Ctrl-C (``KeyboardInterrupt``),
    ``SystemExit``, Prefect's ``TerminationSignal`` when a flow run is cancelled, asyncio's
    ``CancelledError`` — means someone stopped the run, not that the job failed. Recording
    it FAILED would make lineage (and the nightly's "last good run") lie, and would leave a
    cancel hook to guess afterwards which failures were really cancels; so such a stop is
    recorded CANCELLED, with this reason, where it happens.
    """
    if isinstance(exc, Exception):
        return None
    if isinstance(exc, Terminated):
        return "terminated (SIGTERM)"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"interrupted ({type(exc).__name__})"


def _any_cancelled(status: JobStatus) -> bool:
    return any(t.state is JobState.CANCELLED for t in (status.tasks or {}).values())


def _tasks_after_cancel(launcher: Launcher, handle: JobHandle) -> dict[str, JobStatus] | None:
    """Each array task's end as the backend reports it once cancelled, so an interrupted array's
    attempt still says which shards had finished (and how) and which were cut short; None for a
    single job or when the backend cannot answer (the interruption is recorded regardless)."""
    try:
        return launcher.status(handle).tasks
    except Exception as exc:  # noqa: BLE001 - best effort while already handling an interruption
        log.warning("could not read the tasks of %s job %s: %s", launcher.name, handle.job_id, _one_line(exc))
        return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _LogPump(threading.Thread):
    """Follows a job's log in the background so the caller can poll status and cancel meanwhile."""

    def __init__(
        self, launcher: Launcher, handle: JobHandle, on_log: Callable[[str], None], secrets: list[str]
    ) -> None:
        super().__init__(name=f"logs-{handle.job_id}", daemon=True)
        self.launcher, self.handle, self.on_log, self.secrets = launcher, handle, on_log, secrets
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for line in self.launcher.logs(self.handle, follow=True):
                self.on_log(scrub(line, self.secrets) if self.secrets else line)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's thread
            self.error = exc


def _outage(launcher: Launcher, handle: JobHandle, exc: BackendUnavailable, since: float | None) -> float:
    """Note a failed status look while the backend cannot be asked (a slurmctld restarting or
    failing over): the job runs on meanwhile, and giving up at the first failed look cancelled a
    healthy job, or left it running unwatched while a retry started another. Re-raise once the
    outage has lasted longer than the launcher's :attr:`~Launcher.outage_grace`; returns when it began."""
    now = time.monotonic()
    grace = launcher.outage_grace
    if since is None:
        log.warning(
            "%s cannot be asked about job %s (%s): the job runs on; waiting up to %g s for it to answer",
            launcher.name,
            handle.job_id,
            _one_line(exc),
            grace,
        )
        return now
    if now - since > grace:
        raise BackendUnavailable(f"{_one_line(exc)} (for {now - since:.0f} s, longer than outage_grace {grace:g} s)")
    return since


def _pause(launcher: Launcher, handle: JobHandle, seconds: float, should_cancel: Callable[[], bool] | None) -> None:
    """``launcher.pause`` for up to ``seconds``, in slices of :data:`CANCEL_CHECK_SECONDS` with a
    cancel check between them; returns as soon as a cancel is requested or a slice ends early.

    A slice that ends before its time means the backend saw the job end (the local pidfd, the
    Docker engine's wait), so the caller should look now rather than finish the interval.
    """
    if should_cancel is None:
        launcher.pause(handle, seconds)
        return
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        piece = min(CANCEL_CHECK_SECONDS, left)
        began = time.monotonic()
        launcher.pause(handle, piece)
        if time.monotonic() - began < 0.9 * piece or should_cancel():
            return


#: A line that says what went wrong: ``error: ...`` (openlab's workloads and most command-line
#: tools), ``fatal: ...``, ``ERROR:root:...`` (Python's logging), ``[ERROR] ...``, or a Python
#: exception's last line (``ValueError: lr must be positive``, ``torch.OutOfMemoryError: CUDA out
#: of memory``), or the Docker CLI's ``Error response from daemon: ...`` (a job that runs
#: containers itself). The word alone is not enough: ``error rate 0.31`` is a metric, not a reason.
ERROR_LINE = re.compile(
    r"(?i:error|fatal|critical)\s*:.*"
    r"|\[(?i:error|fatal|critical)\]\s.*"
    r"|(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?::.*)?"
    r"|(?:docker: )?Error response from daemon:.*"
)
#: ``0: `` before a task's line in a job of several tasks (srun --label, our task runner), ``[3] ``
#: before an array task's (the Slurm launcher's log of a whole array).
_TASK_LABEL = re.compile(r"^(?:\d+: |\[\d+\] )")


def error_line(launcher: Launcher, handle: JobHandle, secrets: list[str], lines: int = 40) -> str | None:
    """The last line among the job log's last ``lines`` that says what went wrong (see
    :data:`ERROR_LINE`), with secret values masked; None when there is none or the log cannot
    be read. A failed job's attempt carries it in its reason, so ``lineage list``, the Prefect
    run's state and the regression issue say *why* without anyone opening the log."""
    try:
        tail = list(launcher.logs(handle, tail=lines))
    except Exception as exc:  # noqa: BLE001 - the reason without it is still the reason
        log.debug("could not read the end of %s job %s's log: %s", launcher.name, handle.job_id, _one_line(exc))
        return None
    for raw in reversed(tail):
        line = _TASK_LABEL.sub("", raw).strip()
        if ERROR_LINE.fullmatch(line):
            return scrub(line if len(line) <= 300 else line[:299] + "…", secrets)
    return None


def run_job(
    store: LineageStore,
    launcher: Launcher,
    spec: JobSpec,
    *,
    stage_run_id: str | None = None,
    on_log: Callable[[str], None] | None = None,
    timeout: float | None = None,
    should_cancel: Callable[[], bool] | None = None,
    poll: float | None = None,
) -> tuple[Attempt, JobStatus]:
    """Submit, stream logs to ``on_log`` (from a background thread), wait, and record the end.

    Lines passed to ``on_log`` have secret values (from the spec's and this process's
    secret-named variables) replaced by ``***``.

    Status looks come at the launcher's cadence (``poll``, else its ``poll_interval``);
    ``should_cancel`` is asked between them at least every :data:`CANCEL_CHECK_SECONDS`, so a
    backend polled gently (Docker every 2 s, a busy Slurm controller every 30 s) still stops
    a cancelled job at once. When it returns True the job is cancelled and the attempt
    recorded CANCELLED. After ``timeout`` seconds the job is cancelled and
    :class:`JobTimeout` raised. On any exception the job is cancelled and the attempt
    recorded with the reason, then the exception re-raised: CANCELLED for a timeout and for
    a stop from outside (Ctrl-C, SystemExit, Prefect's TerminationSignal, asyncio
    cancellation: see :func:`interruption_reason`), FAILED for anything else. The finished
    job's leftovers (container, Job object) are cleaned up once its logs are read.
    """
    attempt, handle = submit_attempt(store, launcher, spec, stage_run_id=stage_run_id)
    pump = _LogPump(launcher, handle, on_log, spec.secret_values()) if on_log is not None else None
    backoff = Backoff(launcher.poll_interval if poll is None else poll)
    deadline = None if timeout is None else time.monotonic() + timeout
    cancelled_by_caller = False
    try:
        if pump is not None:
            pump.start()
        outage: float | None = None  # since when the backend could not be asked, if it cannot now
        while True:
            try:
                status = launcher.status(handle)
            except BackendUnavailable as exc:
                outage = _outage(launcher, handle, exc, outage)
                if deadline is not None and time.monotonic() >= deadline:
                    raise JobTimeout(f"{launcher.name} job {handle.job_id} did not finish within {timeout:g}s") from exc
                time.sleep(min(backoff.next_delay(), 5.0))
                continue
            if outage is not None:
                log.warning("%s answers again: job %s is %s", launcher.name, handle.job_id, status.state)
                outage = None
            if status.state is JobState.RUNNING or (status.state.terminal and status.started_at):
                attempt = mark_running(store, attempt, status)
            if status.state.terminal:
                break
            if should_cancel is not None and not cancelled_by_caller and should_cancel():
                cancelled_by_caller = True
                launcher.cancel(handle)
                backoff.reset()  # the end is expected now: look again soon, not a whole interval later
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(f"{launcher.name} job {handle.job_id} did not finish within {timeout:g}s")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            _pause(launcher, handle, backoff.next_delay(left), None if cancelled_by_caller else should_cancel)
        if pump is not None:
            pump.join(LOG_DRAIN_TIMEOUT)
            if pump.error is not None:
                log.warning("log streaming of %s failed: %s", handle.job_id, _one_line(pump.error))
        if not cancelled_by_caller:  # a stop signal we did not send: preempted, evicted, warned
            status = stopped_from_outside(status)
        if cancelled_by_caller and status.state is JobState.CANCELLED and not status.reason:
            status.reason = "cancelled by request"
        elif cancelled_by_caller and status.state is JobState.FAILED and _any_cancelled(status):
            # An array cancelled after one of its tasks failed: the cancel is what ended the job,
            # so the attempt is CANCELLED; the failure stays in the reason and in that task's record.
            status = dataclasses.replace(
                status, state=JobState.CANCELLED, reason=f"cancelled by request after {status.reason}"
            )
        if status.state is JobState.FAILED and not cancelled_by_caller:
            said = error_line(launcher, handle, spec.secret_values())
            if said and said not in (status.reason or ""):  # what went wrong, where only the log said it
                status = dataclasses.replace(status, reason=f"{status.reason}: {said}" if status.reason else said)
        attempt = finish_attempt(store, attempt, status)
    except BaseException as exc:
        stopped = interruption_reason(exc)
        try:
            launcher.cancel(handle)
        except Exception as cancel_exc:  # noqa: BLE001 - the original error matters more
            log.warning("could not cancel %s job %s: %s", launcher.name, handle.job_id, _one_line(cancel_exc))
        end = JobStatus(
            state=JobState.CANCELLED if stopped or isinstance(exc, JobTimeout) else JobState.FAILED,
            reason=stopped or scrub(_one_line(exc), spec.secret_values()),
            tasks=_tasks_after_cancel(launcher, handle),
        )
        try:
            finish_attempt(store, attempt, end)
        except Exception as rec_exc:  # noqa: BLE001
            log.error("could not record the end of attempt %s: %s", attempt.id, _one_line(rec_exc))
        if pump is not None:
            pump.join(2.0)
        raise
    finally:
        try:
            launcher.cleanup(handle)
        except Exception as exc:  # noqa: BLE001 - cleanup is best effort
            log.warning("cleanup of %s job %s failed: %s", launcher.name, handle.job_id, _one_line(exc))
    return attempt, status


__all__ = [
    "ENDED",
    "finish_attempt",
    "handle_from_attempt",
    "interruption_reason",
    "lineage_state",
    "mark_running",
    "next_attempt_number",
    "recorded_status",
    "run_job",
    "submit_attempt",
    "unrecorded_job",
]
