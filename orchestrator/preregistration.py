"""Pre-registered results: what a recipe predicts a run will measure, checked when it ends.

Marin pre-registers the final loss of a hero run on its experiment issue (from a scaling law)
before the run starts. A recipe here can do the same: ``preregistered:`` names metrics, the stage
that reports each, the predicted value and the tolerance within which the prediction counts as
met. The predictions travel in the recipe's lineage, which the pipeline run records when it
*starts*, in the hash-chained event log; so the record itself shows the prediction was made
before the result existed. When the run ends, each prediction is checked against what its stage
measured and the outcome is recorded on the pipeline run (``preregistration``) and shown in the
run summary and the lineage card.

A missed prediction does not fail the run: it is a scientific result, not a regression (that
is the nightly verdict's job, :mod:`orchestrator.nightly`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # recipes import this module; reading one must not load the database layer
    from orchestrator.lineage.store import LineageStore

Outcome = Literal["met", "missed", "not measured"]


@dataclass(frozen=True)
class Prediction:
    """One pre-registered metric: ``value`` ± ``tolerance``, reported by ``stage``."""

    metric: str
    stage: str
    value: float
    tolerance: float
    description: str | None = None


@dataclass(frozen=True)
class PredictionCheck:
    """A prediction against what was measured."""

    metric: str
    stage: str
    predicted: float
    tolerance: float
    actual: float | None
    outcome: Outcome

    @property
    def error(self) -> float | None:
        return None if self.actual is None else self.actual - self.predicted

    def line(self) -> str:
        """``eval/code/loss (eval): predicted 5.3 ± 0.5, measured 5.26 (-0.04): met``."""
        head = f"{self.metric} ({self.stage}): predicted {self.predicted:.6g} ± {self.tolerance:.3g}"
        if self.actual is None:
            return f"{head}, not measured"
        return f"{head}, measured {self.actual:.6g} ({self.error:+.3g}): {self.outcome}"


def check_predictions(predictions: Iterable[Prediction], metrics: Mapping[str, float]) -> list[PredictionCheck]:
    """Each prediction against ``metrics`` (:func:`orchestrator.nightly.pipeline_metrics`'s shape)."""
    checks = []
    for p in predictions:
        actual = metrics.get(f"{p.stage}/{p.metric}")
        outcome: Outcome
        if actual is None:
            outcome = "not measured"
        else:
            off = abs(actual - p.value)  # on the tolerance counts as met, float dust included
            outcome = "met" if off <= p.tolerance or math.isclose(off, p.tolerance, rel_tol=1e-9) else "missed"
        checks.append(PredictionCheck(p.metric, p.stage, p.value, p.tolerance, actual, outcome))
    return checks


def record_preregistration(
    store: LineageStore, pipeline_run_id: str, predictions: Iterable[Prediction]
) -> list[PredictionCheck]:
    """Check a finished run's predictions and record the outcome on its pipeline run."""
    from orchestrator.lineage.models import PipelineRun, utcnow
    from orchestrator.nightly import pipeline_metrics  # one reading of a run's metrics, reuse included

    predictions = list(predictions)
    if not predictions:
        return []
    checks = check_predictions(predictions, pipeline_metrics(store, pipeline_run_id))
    with store.transaction() as tx:
        run = tx.get(PipelineRun, pipeline_run_id)
        if run is not None:
            tx.update(
                run,
                preregistration={
                    "checks": [{**asdict(c), "error": c.error} for c in checks],
                    "decided_at": utcnow().isoformat(),
                },
            )
    return checks


def outcome_lines(record: Mapping[str, Any] | None) -> list[str]:
    """Lines for a recorded ``preregistration`` (summaries and cards)."""
    if not record:
        return []
    return [PredictionCheck(**{k: v for k, v in c.items() if k != "error"}).line() for c in record.get("checks", [])]


__all__ = ["Prediction", "PredictionCheck", "check_predictions", "outcome_lines", "record_preregistration"]
