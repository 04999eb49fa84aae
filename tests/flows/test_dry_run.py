"""The flow's dry run is ``openlab explain`` in Prefect: per stage run or reuse, and which identity fields changed.

A real Prefect server (``prefect_server``), the flow run in this process, a real ``data``
stage executed first so there is something to reuse and something to compare against.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun
from orchestrator.prefect_server import PrefectServer
from tests.flows.conftest import REPO_ROOT

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

RECIPE = REPO_ROOT / "recipes" / "marin-535b-a23b.yaml"


def _artifact_and_logs(flow_run_id: Any, expect_in_logs: str) -> tuple[str, str]:
    """The run's ``explain`` artifact and its logs (which reach the server in batches: wait for them)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        deadline = time.monotonic() + 20
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
            text = "\n".join(log.message for log in logs)
            if expect_in_logs in text or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    (explain,) = [a for a in artifacts if a.key == "explain"]
    return str(explain.data), text


def test_dry_run_explains_reuse_and_changed_fields_and_launches_nothing(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    from flows.pipeline import replica_pipeline
    from orchestrator.pipeline import RunOptions, execute_stage, finish_pipeline, start_recipe

    ctx = start_recipe("marin-535b-a23b", "tiny", options=RunOptions(backend="local", trigger="test"))
    data_run = execute_stage(ctx, "data").stage_run_id
    finish_pipeline(ctx)
    with LineageStore.open() as store:
        recorded = (len(store.list(PipelineRun)), len(store.list(StageRun)), len(store.list(Attempt)))

    # 1. Nothing changed: data is reused from the run above, the stages after it have never run.
    state = replica_pipeline(recipe="marin-535b-a23b", replica="tiny", dry_run=True, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    plans = {p["stage"]: p for p in result["stages"]}
    assert list(plans) == ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]
    assert plans["data"]["action"] == "reuse" and plans["data"]["reused_from"] == data_run
    assert plans["tokenize"]["action"] == "run" and "no earlier completed run" in plans["tokenize"]["reason"]
    markdown, logs = _artifact_and_logs(state.state_details.flow_run_id, "dry run: eval would")
    assert f"| data | **reuse** | `{plans['data']['identity'][:16]}` |" in markdown
    assert "| tokenize | **run** |" in markdown
    assert "dry run: data would reuse" in logs and "dry run: tokenize would run" in logs

    # 2. One recipe value changed: data would run, and the dry run names the identity field that changed.
    edited = tmp_path / "marin-535b-a23b.yaml"
    recipe = yaml.safe_load(RECIPE.read_text())
    assert recipe["replicas"]["tiny"]["set"]["data.max_bytes_per_domain"] == 200000
    recipe["replicas"]["tiny"]["set"]["data.max_bytes_per_domain"] = 150000
    edited.write_text(yaml.safe_dump(recipe))
    state = replica_pipeline(recipe=str(edited), replica="tiny", dry_run=True, return_state=True)
    assert state.is_completed(), state.message
    data = state.result()["stages"][0]
    assert data["action"] == "run" and data["previous"] == data_run
    (change,) = data["changes"]
    assert "max_bytes_per_domain" in change and "200000" in change and "150000" in change, change
    markdown, logs = _artifact_and_logs(state.state_details.flow_run_id, "dry run: eval would")
    assert "| data | **run** |" in markdown and change in markdown
    assert f"changed: {change}" in logs

    # 2b. The same value set in the form (`overrides`, as `openlab run --set`): the same plan, no file edited.
    state = replica_pipeline(
        recipe="marin-535b-a23b", replica="tiny", dry_run=True, overrides={"data.max_bytes_per_domain": 150000}
    )
    assert state["stages"][0]["changes"] == [change] and state["stages"][0]["action"] == "run"
    assert state["lineage"]["run_set"] == {"data.max_bytes_per_domain": 150000}

    # 3. `until` from the form: only the stage and what it reads from are planned.
    state = replica_pipeline(
        recipe="marin-535b-a23b", replica="tiny", dry_run=True, until="tokenize", return_state=True
    )
    assert state.is_completed(), state.message
    assert [p["stage"] for p in state.result()["stages"]] == ["data", "tokenize"]
    bad = replica_pipeline(recipe="marin-535b-a23b", replica="tiny", dry_run=True, until="repro", return_state=True)
    assert bad.is_failed() and (bad.message or "").startswith("until 'repro': not a stage of this run"), bad.message

    # 4. `force_stages` from the form (`openlab run --force-stage`, which the form lacked): that stage is run
    state = replica_pipeline(
        recipe="marin-535b-a23b", replica="tiny", dry_run=True, force_stages=["data"], until="tokenize"
    )
    assert state["stages"][0]["action"] == "run" and "forced" in state["stages"][0]["reason"], state["stages"][0]
    assert state["force"] == ["data"]
    bad = replica_pipeline(recipe="marin-535b-a23b", replica="tiny", dry_run=True, retries=-1, return_state=True)
    assert bad.is_failed() and bad.message == "retries = -1: give 0 or more (the retries of a failed stage)"

    with LineageStore.open() as store:  # a dry run launches and records nothing
        assert (len(store.list(PipelineRun)), len(store.list(StageRun)), len(store.list(Attempt))) == recorded
