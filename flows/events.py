"""openlab's own Prefect events, so people can build Prefect Automations on what openlab knows.

Prefect already emits events for flow and task runs (``prefect.flow-run.Failed`` ...), but a
failed flow run says little: was it a regression of the nightly, a stage that failed, or a
job that was preempted and is being resumed? These events name it, about openlab's own
resources (``openlab.pipeline-run.<id>``, ``openlab.stage-run.<id>``), with the flow run, task
run and deployment attached by Prefect from the run context. An Automation then triggers on,
say, ``openlab.nightly.regressed`` to page someone, or on ``openlab.stage.preempted`` more
than three times an hour to move the nightlies to another partition. A training stage that its own
time limit stopped after it saved its checkpoint, and that goes on from it in the next job (a
chain under a cluster's wall-time cap), is ``openlab.stage.time-limited``, not a preemption: such
an Automation must not fire on every planned link of the chain.

| event | resource | when |
|---|---|---|
| ``openlab.pipeline-run.completed`` / ``.failed`` / ``.cancelled`` | pipeline run | a run ends |
| ``openlab.stage.failed`` / ``.preempted`` / ``.time-limited`` / ``.cancelled`` | stage run | an attempt ends so |
| ``openlab.nightly.passed`` / ``.regressed`` / ``.baseline`` | pipeline run | the verdict is in |
| ``openlab.prediction.met`` / ``.missed`` / ``.not-measured`` | pipeline run | a pre-registered result is checked |

Emitting never fails a run: without a reachable API an event is dropped, as Prefect does.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.pipeline.execute import PipelineContext, StageTransition

log = logging.getLogger(__name__)

#: Stage transitions that become ``openlab.stage.<state>`` events (the others are progress, not news).
STAGE_EVENTS = ("FAILED", "PREEMPTED", "CANCELLED")


def emit(
    event: str,
    kind: str,
    record_id: str,
    name: str | None = None,
    *,
    payload: Mapping[str, Any] | None = None,
    related: list[dict[str, str]] | None = None,
) -> None:
    """Emit ``event`` about openlab record ``record_id`` of ``kind`` (``pipeline-run``, ``stage-run``).

    The payload is stored by the Prefect server: it is redacted as lineage records are (secret
    values scrubbed from any text, credential-named entries masked)."""
    from prefect.events import emit_event

    from orchestrator.secrets import redact_value

    resource = {"prefect.resource.id": f"openlab.{kind}.{record_id}"}
    if name:
        resource["prefect.resource.name"] = name
    safe = redact_value(dict(payload or {}))
    try:
        emit_event(event=event, resource=resource, related=related or [], payload=safe)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - an event must not fail a run
        log.debug("could not emit %s: %s", event, exc)


def _pipeline_related(ctx: PipelineContext) -> list[dict[str, str]]:
    related = [
        {
            "prefect.resource.id": f"openlab.pipeline-run.{ctx.id}",
            "prefect.resource.role": "pipeline-run",
            "prefect.resource.name": ctx.pipeline_run.name,
        },
        {"prefect.resource.id": f"openlab.commit.{ctx.commit.id}", "prefect.resource.role": "commit"},
    ]
    if ctx.issue_id:
        related.append({"prefect.resource.id": f"openlab.issue.{ctx.issue_id}", "prefect.resource.role": "issue"})
    return related


def emitting_transitions(ctx: PipelineContext) -> None:
    """Make ``ctx`` emit :func:`stage_transition` events besides calling its own transition hook.

    Transitions can come from helper threads (a lease lost in the heartbeat thread cancels a
    stage), which have no Prefect context: those are sent from a copy of the caller's.
    """
    from prefect.context import FlowRunContext, TaskRunContext

    flow_context = contextvars.copy_context()
    own = ctx.hooks.on_transition

    def on_transition(event: StageTransition) -> None:
        if own is not None:
            own(event)
        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            stage_transition(ctx, event)
        else:
            flow_context.copy().run(stage_transition, ctx, event)

    ctx.hooks.on_transition = on_transition


def stage_transition(ctx: PipelineContext, event: StageTransition) -> None:
    """``openlab.stage.<state>`` for a stage that failed, was preempted or was cancelled;
    ``openlab.stage.time-limited`` for one stopped by its own time limit that goes on from the
    checkpoint it saved. A stop's payload says whether the job saved its checkpoint anew."""
    if event.state not in STAGE_EVENTS:
        return
    name = event.state.lower()
    payload: dict[str, Any] = {"stage": event.stage, "reason": event.reason, "identity": event.identity}
    if event.state == "PREEMPTED" and event.result is not None:
        if event.result.stopped_by == "time-limit":
            name = "time-limited"
        payload["progress_saved"] = event.result.progress_saved
    emit(
        f"openlab.stage.{name}",
        "stage-run",
        event.stage_run_id or f"{ctx.id}.{event.stage}",
        event.stage,
        payload=payload,
        related=_pipeline_related(ctx),
    )


def pipeline_finished(ctx: PipelineContext) -> None:
    """``openlab.pipeline-run.<state>`` when a run ends, and one event per pre-registered result."""
    run = ctx.pipeline_run
    related = [r for r in _pipeline_related(ctx) if r["prefect.resource.role"] != "pipeline-run"]
    stages = {name: result.state for name, result in ctx.results.items()}
    emit(
        f"openlab.pipeline-run.{(run.state or 'unknown').lower()}",
        "pipeline-run",
        run.id,
        run.name,
        payload={"recipe": run.recipe, "replica": run.replica, "backend": run.backend, "stages": stages},
        related=related,
    )
    for check in (run.preregistration or {}).get("checks", []):
        outcome = str(check.get("outcome") or "unknown").replace(" ", "-")
        emit(f"openlab.prediction.{outcome}", "pipeline-run", run.id, run.name, payload=check, related=related)


def nightly_verdict(pipeline_run_id: str, verdict: Mapping[str, Any]) -> None:
    """``openlab.nightly.<status>`` with the verdict (metrics, values, commits) as its payload."""
    emit(f"openlab.nightly.{verdict.get('status', 'unknown')}", "pipeline-run", pipeline_run_id, payload=verdict)


__all__ = ["STAGE_EVENTS", "emit", "emitting_transitions", "nightly_verdict", "pipeline_finished", "stage_transition"]
