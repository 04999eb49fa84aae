"""How a flow run that fails for one of openlab's own reasons reads in the UI: one ERROR line, the
Failed state's message, no traceback of Prefect's frames; and a job that refused its config is not
run again by a Prefect retry. Real flows in this process against a real Prefect server, real jobs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from orchestrator.lineage import Attempt, LineageStore, StageRun
from orchestrator.prefect_server import PrefectServer
from tests.flows.conftest import flow_run_logs

pytestmark = [pytest.mark.prefect]


def _finished(logs: list[Any]) -> bool:
    """The run's last line ("Finished in state") reached the server."""
    return any(log.message.startswith("Finished in state") and log.task_run_id is None for log in logs)


def assert_one_error_line(state: Any) -> list[Any]:
    """The run failed with its state's message as its one ERROR line and not a line of traceback; its logs."""
    assert state.is_failed(), state
    logs = flow_run_logs(state.state_details.flow_run_id, _finished)
    errors = [log.message for log in logs if log.level >= logging.ERROR]
    assert errors == [state.message], errors
    traced = [log.message for log in logs if "Traceback (most recent call last)" in log.message]
    assert traced == [], traced[0]
    return logs


def test_a_mistyped_replica_fails_the_run_with_one_line_and_no_traceback(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    from flows.nightly import nightly_replica
    from flows.pipeline import replica_pipeline

    state = replica_pipeline(replica="tny", backend="local", return_state=True)
    assert_one_error_line(state)
    assert "no replica 'tny'" in state.message and "did you mean 'tiny'?" in state.message, state.message
    with pytest.raises(Exception, match="did you mean 'tiny'"):  # a caller of the flow still gets the error
        state.result()

    nightly = nightly_replica(replica="tny", backend="local", git_ref="HEAD", return_state=True)
    assert_one_error_line(nightly)
    assert "did you mean 'tiny'?" in nightly.message, nightly.message

    # named as the run form names the field, not as the CLI's flag (the UI has no `--until`)
    until = replica_pipeline(replica="tiny", backend="local", until="repro", return_state=True)
    assert_one_error_line(until)
    assert until.message.startswith("until 'repro': not a stage of this run; "), until.message


def test_a_bad_sweep_grid_fails_the_run_with_one_line_and_no_traceback(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    from flows.sweep import replica_sweep

    state = replica_sweep(grid={"data.max_bytes": [1, 2]}, backend="local", return_state=True)
    assert_one_error_line(state)
    assert "grid data.max_bytes: no such recipe field" in state.message, state.message


def test_the_gc_and_digest_forms_bad_fields_fail_the_run_with_one_line_and_no_traceback(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    """`unused_for = "7 days"` in the gc form, `since = "yesterday"` in the digest's: a traceback of
    Prefect's frames, where `openlab gc` and `openlab github digest` say one line."""
    from flows.digest import github_digest
    from flows.gc import collect_outputs

    state = collect_outputs(unused_for="7 days", return_state=True)
    assert_one_error_line(state)
    assert "cannot read '7 days'" in state.message, state.message
    negative = collect_outputs(keep=-1, return_state=True)
    assert_one_error_line(negative)
    assert negative.message.startswith("keep -1: give 0 or more"), negative.message
    digest = github_digest(since="yesterday", dry_run=True, return_state=True)
    assert_one_error_line(digest)
    assert "cannot read 'yesterday'" in digest.message, digest.message


def test_a_stage_whose_job_refused_its_config_fails_once_in_one_line_and_is_not_retried(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    """The audit's run: a pretrain whose `model.context` is longer than the data. Its job exits 2 with
    `error: config: ...`; the stage's task is not retried (a second identical job would fail the same
    way), the stage's log says why, and the flow run fails with that error as its one ERROR line."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    from flows.pipeline import replica_pipeline

    state = replica_pipeline(
        replica="tiny", backend="local", until="pretrain", overrides={"model.context": 100000}, return_state=True
    )
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
        )
    (pretrain,) = [t for t in tasks if t.name.startswith("pretrain")]
    assert pretrain.state.is_failed() and pretrain.run_count == 1, (pretrain.state, pretrain.run_count)
    logs = assert_one_error_line(state)
    assert state.message.startswith("stage pretrain failed: job "), state.message
    assert "error: config: model.context=100000 is longer than the data" in state.message, state.message
    (why,) = [log for log in logs if "is not retried" in log.message]
    assert why.task_run_id == pretrain.id and why.level == logging.WARNING
    assert why.message.startswith("pretrain is not retried: its job refused its config (exit 2, error: config: model")
    assert not [log.message for log in logs if "Retry 1/" in log.message]
    with LineageStore.open() as store:
        (stage,) = store.list(StageRun, stage="pretrain")
        assert stage.state == "FAILED"
        assert [(a.state, a.exit_code) for a in store.list(Attempt, stage_run_id=stage.id)] == [("FAILED", 2)]


def test_a_nightly_whose_stage_failed_records_a_regressed_verdict_naming_the_failure(
    prefect_server: PrefectServer, openlab_home: Path, tmp_path: Path
) -> None:
    """A training that no longer finishes is the worst regression a nightly can find, and it recorded
    no verdict: no `openlab.nightly.regressed` event to page on, no regression issue, no commit status."""
    import yaml

    from flows.nightly import nightly_replica
    from orchestrator.lineage import PipelineRun
    from orchestrator.pipeline.dag import REPO_ROOT

    data = yaml.safe_load((REPO_ROOT / "recipes" / "marin-535b-a23b.yaml").read_text())
    data["data"]["domains"]["code"] = f"path:{tmp_path}/gone/**/*.py"  # the corpus moved away: the data stage fails
    recipe = tmp_path / "marin-535b-a23b.yaml"
    recipe.write_text(yaml.safe_dump(data))
    state = nightly_replica(recipe=str(recipe), replica="tiny", backend="local", git_ref="HEAD", return_state=True)
    assert state.is_failed() and "stage data failed" in state.message, state.message
    with LineageStore.open() as store:
        (run,) = store.list(PipelineRun)
    assert run.state == "FAILED" and run.verdict is not None, run
    assert run.verdict["status"] == "regressed", run.verdict
    assert run.verdict["message"].startswith("nightly failed before its verdict: stage data failed: "), run.verdict
    assert "matched no files" in run.verdict["message"]
    # the run's card, published when the pipeline ended, is published again with the verdict on it
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    of_run = ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
        key=ArtifactFilterKey(any_=["lineage-pipeline"]),
    )
    with get_client(sync_client=True) as client:
        cards = client.read_artifacts(artifact_filter=of_run)
    assert any("**Nightly verdict:** regressed" in str(card.data) for card in cards), [c.data for c in cards]
