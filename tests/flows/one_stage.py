"""A one-stage pipeline run as a Prefect flow in this process, for tests of what the flows layer
adds around a stage (task retries, preemption, logs in the UI)."""

from __future__ import annotations

import sys
from typing import Any


def run_one_stage_flow(
    name: str, script: str, *, retries: int = 0, n: int = 1, gpus: int = 0, **spec_fields: Any
) -> Any:
    """Run ``python -c script {out}`` as stage ``name`` (config ``{"n": n}``, asking for ``gpus``,
    with any other :class:`StageSpec` fields given: ``checkpoint``, ``time_limit``) through
    ``run_stages_as_tasks`` in a flow against the current Prefect API; the flow's final state (its
    result is the pipeline run id)."""
    from prefect import flow

    from flows.pipeline import run_stages_as_tasks
    from orchestrator.pipeline.dag import REPO_ROOT, Pipeline, StageSpec
    from orchestrator.pipeline.execute import RunOptions, start_pipeline

    spec = StageSpec(name=name, command=(sys.executable, "-c", script, "{out}"), gpus=gpus, **spec_fields)
    pipeline = Pipeline(name=f"{name}-test", stages=(spec,), repo_root=REPO_ROOT)

    @flow(name=f"{name}-pipeline")
    def one_stage() -> str:
        ctx = start_pipeline(pipeline, {name: {"n": n}}, options=RunOptions(backend="local", trigger="test"))
        run_stages_as_tasks(ctx, retries=retries)
        return ctx.id

    return one_stage(return_state=True)
