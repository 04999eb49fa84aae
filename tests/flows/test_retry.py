"""A Prefect task retry of a failed stage is a new attempt of the same stage run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun
from orchestrator.prefect_server import PrefectServer

pytestmark = [pytest.mark.prefect]

#: Fails the first time (leaving a marker), succeeds the second: a transient failure.
FLAKY = (
    "import pathlib, sys; out = pathlib.Path(sys.argv[1]); m = out.parent / 'tried-once';"
    "first = not m.exists(); m.touch(); print('flaky stage, first try' if first else 'flaky stage, retry');"
    "sys.exit(3 if first else 0)"
)


def test_task_retry_adds_an_attempt_to_the_same_stage_run(prefect_server: PrefectServer, openlab_home: Path) -> None:
    from prefect import flow

    from flows.pipeline import run_stages_as_tasks
    from orchestrator.pipeline.dag import REPO_ROOT, Pipeline, StageSpec
    from orchestrator.pipeline.execute import RunOptions, start_pipeline

    spec = StageSpec(name="flaky", command=(sys.executable, "-c", FLAKY, "{out}"))
    pipeline = Pipeline(name="flaky-test", stages=(spec,), repo_root=REPO_ROOT)

    @flow(name="flaky-pipeline")
    def flaky_pipeline() -> str:
        ctx = start_pipeline(pipeline, {"flaky": {"n": 1}}, options=RunOptions(backend="local", trigger="test"))
        run_stages_as_tasks(ctx, retries=1)
        return ctx.id

    state = flaky_pipeline(return_state=True)
    assert state.is_completed(), state.message
    with LineageStore.open() as store:
        run = store.require(PipelineRun, state.result())
        assert run.state == "COMPLETED"
        (stage,) = store.list(StageRun, pipeline_run_id=run.id)
        assert stage.state == "COMPLETED"
        attempts = store.list(Attempt, stage_run_id=stage.id)
        assert sorted((a.number, a.state) for a in attempts) == [(1, "FAILED"), (2, "COMPLETED")]
