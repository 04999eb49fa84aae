"""A Prefect task retry of a failed stage is a new attempt of the same stage run; a preempted stage
runs again inside its task, spending no Prefect retry."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun
from orchestrator.prefect_server import PrefectServer
from tests.flows.one_stage import run_one_stage_flow

pytestmark = [pytest.mark.prefect]

#: Fails the first time (leaving a marker), succeeds the second: a transient failure.
FLAKY = (
    "import pathlib, sys; out = pathlib.Path(sys.argv[1]); m = out.parent / 'tried-once';"
    "first = not m.exists(); m.touch(); print('flaky stage, first try' if first else 'flaky stage, retry');"
    "sys.exit(3 if first else 0)"
)


def test_task_retry_adds_an_attempt_to_the_same_stage_run(prefect_server: PrefectServer, openlab_home: Path) -> None:
    state = run_one_stage_flow("flaky", FLAKY, retries=1)
    assert state.is_completed(), state.message
    with LineageStore.open() as store:
        run = store.require(PipelineRun, state.result())
        assert run.state == "COMPLETED"
        (stage,) = store.list(StageRun, pipeline_run_id=run.id)
        assert stage.state == "COMPLETED"
        attempts = store.list(Attempt, stage_run_id=stage.id)
        assert sorted((a.number, a.state) for a in attempts) == [(1, "FAILED"), (2, "COMPLETED")]


#: Stopped by SIGTERM from outside the first time (a preemption), done the second.
PREEMPTED_ONCE = (
    "import os, pathlib, signal, sys; out = pathlib.Path(sys.argv[1]); m = out.parent / 'preempted-once';"
    "first = not m.exists(); m.touch(); print('preempted' if first else 'resumed', flush=True);"
    "first and os.kill(os.getpid(), signal.SIGTERM)"
)


def test_a_preempted_stage_resumes_without_spending_a_prefect_retry(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    state = run_one_stage_flow("spot", PREEMPTED_ONCE, retries=0)
    assert state.is_completed(), state.message
    with LineageStore.open() as store:
        run = store.require(PipelineRun, state.result())
        (stage,) = store.list(StageRun, pipeline_run_id=run.id)
        attempts = store.list(Attempt, stage_run_id=stage.id, order_by=Attempt.number)
        assert [(a.number, a.state) for a in attempts] == [(1, "PREEMPTED"), (2, "COMPLETED")]

    with get_client(sync_client=True) as client:
        of_run = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        (task_run,) = client.read_task_runs(task_run_filter=of_run)
        assert task_run.run_count == 1, "the stage's task ran once: the preemption spent no Prefect retry"
        assert task_run.state.is_completed()
