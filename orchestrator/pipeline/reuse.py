"""Whether a stage identity already completed, and what changed since the closest run that did.

Skip-if-done by content: a COMPLETED stage run of the same identity whose outputs still verify
is reused (:func:`find_reusable`, checked again under the identity's lease with
:func:`still_reusable`, so ``openlab gc`` and a reuse never cross). When a stage does run, the
reason names what changed, against the closest earlier run rather than the latest
(:func:`closest_completed`), or that nothing did (:func:`unchanged_since`): ``openlab run``,
``explain`` and the flows all say it the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlmodel import col, select

from orchestrator.identity import FieldChange, diff_identities
from orchestrator.lineage.models import Artifact, PipelineRun, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.outputs import verify_outputs
from orchestrator.settings import Settings

#: How :func:`find_reusable` begins when the identity completed before but its outputs are gone or changed.
NO_LONGER_VERIFY = "completed runs with this identity no longer verify: "


def find_reusable(
    store: LineageStore, identity: str, settings: Settings, *, deep: bool = False
) -> tuple[StageRun | None, str]:
    """The latest COMPLETED stage run of ``identity`` whose outputs verify, and why (or why not)."""
    candidates = store.list(
        StageRun,
        where=[StageRun.identity == identity, StageRun.state == "COMPLETED"],
        order_by=col(StageRun.ended_at).desc(),
        limit=5,
    )
    if not candidates:
        return None, "no completed run with this identity"
    problems = []
    for run in candidates:
        # outputs openlab removed (gc) or replaced (a forced re-run) are not reused, even where a folder
        # with the same stable bytes stands there now: the record says they are gone
        problem = _removed(store, run) or verify_outputs(run.outputs, settings, deep=deep)
        if problem is None:
            return run, f"identity {identity[:16]} already completed by {run.id}; outputs verified"
        problems.append(f"{run.id}: {problem}")
    return None, NO_LONGER_VERIFY + "; ".join(problems)


def still_reusable(store: LineageStore, identity: str, original: StageRun) -> bool:
    """Whether outputs :func:`find_reusable` verified a moment ago are still the ones to reuse.

    Called under the identity's lease, so cheap: no newer run of the identity completed (a forced
    re-run rewrites the folder), gc has not marked the outputs removed, and they are still there.
    Anything else sends the caller back to :func:`find_reusable`.
    """
    latest = store.list(
        StageRun,
        where=[StageRun.identity == identity, StageRun.state == "COMPLETED"],
        order_by=col(StageRun.ended_at).desc(),
        limit=1,
    )
    if not latest or latest[0].id != original.id or _removed(store, original) is not None:
        return False
    return all(Path(out.get("path", "")).exists() for out in original.outputs.values() if isinstance(out, dict))


def _removed(store: LineageStore, run: StageRun) -> str | None:
    """Why ``run``'s outputs are gone when openlab removed them: ``outputs removed by openlab gc on ...``,
    or ``outputs replaced on ... by a forced re-run ...``."""
    for out in run.outputs.values():
        art = store.get(Artifact, out.get("artifact_id") or "") if isinstance(out, dict) else None
        if art is not None and art.removed_at is not None:
            when = f"{art.removed_at:%Y-%m-%d %H:%M} UTC"
            reason = art.removed_reason or ""
            if reason.startswith("replaced by "):
                return f"outputs replaced on {when} by {reason.removeprefix('replaced by ')}"
            return f"outputs removed by openlab gc on {when}"
    return None


#: How many of a stage's latest completed runs the "changed since" comparison looks among.
CLOSEST_AMONG = 20


def closest_completed(
    store: LineageStore,
    stage: str,
    fields: Mapping[str, Any],
    *,
    exclude_identity: str | None = None,
    recipe: str | None = None,
    replica: str | None = None,
    unknown_inputs: Sequence[str] = (),
) -> StageRun | None:
    """Of the latest completed runs of ``stage`` (this recipe and replica first), the one whose
    identity differs from ``fields`` in the fewest fields; the latest among equals.

    "Changed since the last run" against whichever ran last buries the one change a person made
    under another backend's image and packages (a local plan after a Docker run); against the
    closest run it names that change (Marin's complaint: a dry run could not show which change
    invalidated a hash). ``unknown_inputs`` (not yet computed) are left out of the count.
    """
    with store.session() as session:
        query = select(StageRun).where(StageRun.stage == stage, StageRun.state == "COMPLETED")
        if exclude_identity:
            query = query.where(StageRun.identity != exclude_identity)
        latest_first = col(StageRun.ended_at).desc()
        candidates: list[StageRun] = []
        if recipe is not None:  # this recipe and replica's runs if it has any, else any recipe's
            same = query.join(PipelineRun, col(StageRun.pipeline_run_id) == col(PipelineRun.id)).where(
                PipelineRun.recipe == recipe, PipelineRun.replica == replica
            )
            candidates = list(session.exec(same.order_by(latest_first).limit(CLOSEST_AMONG)))
        if not candidates:
            candidates = list(session.exec(query.order_by(latest_first).limit(CLOSEST_AMONG)))
    if not candidates:
        return None

    def distance(run: StageRun) -> int:
        return len(diff_identities(known_fields(run.identity_fields, unknown_inputs), fields))

    return min(candidates, key=distance)  # min keeps the first (latest) of equals


def known_fields(identity_fields: Mapping[str, Any], unknown_inputs: Sequence[str]) -> dict[str, Any]:
    """An earlier run's identity fields without the inputs not yet known for the stage now (its
    upstream stages are still to run): what the two can be compared on."""
    old = dict(identity_fields)
    if unknown_inputs:
        old["inputs"] = {k: v for k, v in (old.get("inputs") or {}).items() if k not in unknown_inputs}
    return old


def describe_changes(changes: Sequence[FieldChange]) -> list[str]:
    return [c.describe() for c in changes]


def latest_completed(store: LineageStore, digest: str) -> StageRun | None:
    """The latest completed run of this very identity, if any."""
    same = store.list(
        StageRun,
        where=[StageRun.identity == digest, StageRun.state == "COMPLETED"],
        order_by=col(StageRun.ended_at).desc(),
        limit=1,
    )
    return same[0] if same else None


def unchanged_since(digest: str, same: StageRun) -> str:
    """Why a stage whose identity already completed runs again: nothing of it changed."""
    return f"identity {digest[:16]} unchanged since {same.id}"
