"""The replica pipeline flow end to end against a real Prefect server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun
from orchestrator.prefect_server import PrefectServer

STAGES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]


@pytest.mark.prefect
@pytest.mark.slow
def test_tiny_replica_local_end_to_end_then_reuses(prefect_server: PrefectServer, openlab_home: Path) -> None:
    """The tiny replica runs all six stages as tasks, with cards and lineage; a second run reuses all."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    from flows.pipeline import replica_pipeline

    started = time.monotonic()
    state = replica_pipeline(recipe="marin-535b-a23b", replica="tiny", backend="local", return_state=True)
    first_seconds = time.monotonic() - started
    assert state.is_completed(), state.message
    summary = state.result()
    with LineageStore.open() as store:
        run = store.require(PipelineRun, summary["pipeline_run_id"])
        assert run.state == "COMPLETED" and run.flow_run_id == str(state.state_details.flow_run_id)
        assert run.params["prefect"]["replica"] == "tiny"
        stages = {s.stage: s for s in store.list(StageRun, pipeline_run_id=run.id)}
        assert sorted(stages) == sorted(STAGES)
        assert all(s.state == "COMPLETED" for s in stages.values())
        assert stages["eval"].metrics, "eval recorded its metrics"
        assert all(store.list(Attempt, stage_run_id=s.id) for s in stages.values())

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        by_run = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
        tasks = client.read_task_runs(task_run_filter=by_run)
        assert sorted(t.name.split("-")[0] for t in tasks) == sorted(STAGES)
        of_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        artifacts = client.read_artifacts(artifact_filter=of_run)
        keys = {a.key for a in artifacts}
        assert {f"lineage-{s}" for s in STAGES} <= keys and "lineage-pipeline" in keys
        card = next(a for a in artifacts if a.key == "lineage-pretrain")
        assert stages["pretrain"].id in str(card.data)
        APILogHandler.flush()
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
        assert any("[pretrain]" in log.message for log in logs), "job log lines reached Prefect"
        assert any("pretrain COMPLETED" in log.message for log in logs), "transitions reached Prefect"

    started = time.monotonic()
    again = replica_pipeline(recipe="marin-535b-a23b", replica="tiny", backend="local", return_state=True)
    second_seconds = time.monotonic() - started
    assert again.is_completed()
    with LineageStore.open() as store:
        reused = store.list(StageRun, pipeline_run_id=again.result()["pipeline_run_id"])
        assert sorted(s.state for s in reused) == ["REUSED"] * 6
    print(f"tiny replica: first run {first_seconds:.1f}s, all-reused run {second_seconds:.1f}s")
