"""Pre-registered predictions: checked against what the run measured, recorded on the run."""

from __future__ import annotations

from orchestrator.lineage import LineageStore, PipelineRun, StageRun
from orchestrator.preregistration import Prediction, check_predictions, outcome_lines, record_preregistration

LOSS = Prediction("eval/code/loss", "eval", 5.3, 0.1)
DROP = Prediction("repro/waterfilling_cf1.05/late_median_drop", "repro", 0.0074, 0.0037)


def test_met_missed_and_not_measured() -> None:
    checks = check_predictions([LOSS, DROP], {"eval/eval/code/loss": 5.25, "eval/code/loss": 5.25})
    assert [c.outcome for c in checks] == ["met", "not measured"]
    assert abs(checks[0].error + 0.05) < 1e-12
    assert checks[0].line() == "eval/code/loss (eval): predicted 5.3 ± 0.1, measured 5.25 (-0.05): met"
    assert checks[1].line().endswith("not measured")
    (far,) = check_predictions([LOSS], {"eval/eval/code/loss": 5.45})
    assert far.outcome == "missed"
    (edge,) = check_predictions([LOSS], {"eval/eval/code/loss": 5.4})  # on the tolerance: met
    assert edge.outcome == "met"


def test_recorded_on_the_pipeline_run_from_its_stages_metrics_and_shown_as_recorded(store: LineageStore) -> None:
    with store.transaction() as tx:
        run = tx.add(PipelineRun(recipe="r", replica="tiny", state="COMPLETED"))
        tx.add(
            StageRun(
                pipeline_run_id=run.id, stage="eval", identity="i", state="COMPLETED", metrics={"eval/code/loss": 5.62}
            )
        )
    checks = record_preregistration(store, run.id, [LOSS])
    assert [c.outcome for c in checks] == ["missed"]
    recorded = store.require(PipelineRun, run.id).preregistration
    assert recorded is not None and recorded["checks"][0]["actual"] == 5.62
    assert outcome_lines(recorded) == ["eval/code/loss (eval): predicted 5.3 ± 0.1, measured 5.62 (+0.32): missed"]
    assert record_preregistration(store, run.id, []) == []
