"""The staged replica pipeline as a library: recipes in, reused or executed stages out.

Used by ``openlab run`` / ``openlab explain`` (terminal, no Prefect) and by the Prefect
flows in ``flows/`` alike, so both behave the same. Typical use from a flow::

    from orchestrator.pipeline import PipelineHooks, RunOptions, execute_stage_resuming, finish_pipeline, start_recipe

    ctx = start_recipe("marin-535b-a23b", "tiny", options=RunOptions(backend="local", trigger="ui"),
                       hooks=PipelineHooks(on_log=..., on_transition=..., should_cancel=...))
    for stage in ctx.pipeline.order:       # one Prefect task per stage
        execute_stage_resuming(ctx, stage) # runs a preempted job again; raises StageFailed / StageCancelled
    finish_pipeline(ctx)                   # COMPLETED / FAILED / CANCELLED from the stage results

(``execute_stage`` is one attempt: a preempted one leaves its stage run PREEMPTED), or everything
at once: ``run_recipe(...)`` / ``run_pipeline(...)``; the dry run is
``explain_recipe(...)`` / ``plan(...)`` (``plan_markdown`` renders it); ``reconcile(store)`` closes
stale stage runs and ``reconcile_pipeline_runs(store)`` pipeline runs a crashed process left RUNNING.
"""

from orchestrator.pipeline.dag import DEFAULT_VOLATILE, REPO_ROOT, Pipeline, StageSpec, moe_pipeline
from orchestrator.pipeline.execute import (
    PipelineContext,
    PipelineHooks,
    PipelineResult,
    RunOptions,
    StageCancelled,
    StageFailed,
    StagePreempted,
    StageResult,
    StageTransition,
    execute_stage,
    execute_stage_resuming,
    finish_pipeline,
    pipeline_state,
    preemption_retries,
    run_pipeline,
    run_recipe,
    run_stages,
    stage_identity,
    stage_retries,
    start_pipeline,
    start_recipe,
)
from orchestrator.pipeline.outputs import output_dir, verify_outputs
from orchestrator.pipeline.plan import StagePlan, explain_recipe, plan, plan_markdown
from orchestrator.pipeline.reconcile import Reconciled, ReconciledPipeline, reconcile, reconcile_pipeline_runs
from orchestrator.pipeline.reuse import find_reusable

__all__ = [
    "DEFAULT_VOLATILE",
    "REPO_ROOT",
    "Pipeline",
    "PipelineContext",
    "PipelineHooks",
    "PipelineResult",
    "Reconciled",
    "ReconciledPipeline",
    "RunOptions",
    "StageCancelled",
    "StageFailed",
    "StagePlan",
    "StagePreempted",
    "StageResult",
    "StageSpec",
    "StageTransition",
    "execute_stage",
    "execute_stage_resuming",
    "explain_recipe",
    "find_reusable",
    "finish_pipeline",
    "moe_pipeline",
    "output_dir",
    "pipeline_state",
    "plan",
    "plan_markdown",
    "preemption_retries",
    "reconcile",
    "reconcile_pipeline_runs",
    "run_pipeline",
    "run_recipe",
    "run_stages",
    "stage_retries",
    "stage_identity",
    "start_pipeline",
    "start_recipe",
    "verify_outputs",
]
