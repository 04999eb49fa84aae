"""A sweep from the UI: one replica run per combination of values, then the runs side by side.

*Deployments → replica-sweep/sweep → Run*: a grid (``{"pretrain.lr": [0.005, 0.01, 0.02]}``)
starts one ``replica-pipeline/replica`` flow run per combination, each with those values as its
``overrides`` (``openlab run --set``), so each is an ordinary pipeline run with its own name,
logs, cards and lineage, shown in the UI under this one. They run at once (or ``at_once`` at a
time): on Slurm or Kubernetes that is real parallelism, and stages they share (data, tokenize)
run once, the others waiting on its lease and reusing it. When all have ended, the ``sweep``
artifact is ``openlab lineage compare`` of them: what each set beside what it measured. Every
combination is checked against the recipe of the git ref the runs will run before any run starts
(``dry_run`` starts none and publishes the ``sweep-plan`` artifact: per run and stage, run, reuse
or shared); a trial that fails fails the sweep, after the others have ended and the table is published.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State

from flows.pipeline import Backend, Stage

#: Seconds between looks at the trials' states.
POLL_SECONDS = 2.0
#: Seconds a trial may wait for a runner before the sweep's log says why it might wait forever.
WAITING_WARN_SECONDS = 120.0


def sweep_run_name() -> str:
    """``sweep marin-535b-a23b:tiny on local: pretrain.lr x3``: the UI's run list says what was swept."""
    from prefect.runtime import flow_run

    from flows.pipeline import default_backend_name

    params = flow_run.parameters or {}
    grid = params.get("grid") or {}
    swept = ", ".join(
        [f"{k} x{len(v) if isinstance(v, list) else '?'}" for k, v in grid.items()]
        + [f"{k} x{params.get('count')} drawn" for k in params.get("samples") or {}]
    )
    where = params.get("backend") or default_backend_name()
    name = f"sweep {params.get('recipe')}:{params.get('replica')} on {where}: {swept}"
    return name + (" (dry run)" if params.get("dry_run") else "")


def cancel_trials(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect ``on_cancellation`` hook: cancel the sweep's runs that have not ended.

    Prefect's server cancels the child runs of a cancelled run too, but only once the parent is
    Cancelled and on its next cleanup pass; a sweep of day-long trials cancelled because its grid
    was wrong should stop them now. Each trial's own cancellation then ends its backend jobs.
    """
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.logging import get_logger
    from prefect.states import Cancelling

    logger = get_logger("openlab.sweep")
    try:
        with get_client(sync_client=True) as client:
            trials = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]))
            )
            for trial in trials:
                if trial.state is not None and not trial.state.is_final():
                    client.set_flow_run_state(trial.id, Cancelling(message=f"its sweep {flow_run.name} was cancelled"))
                    logger.info("cancelled sweep run %s", trial.name)
    except Exception as exc:  # noqa: BLE001 - a hook must not hide the cancellation itself
        logger.error("could not cancel the runs of sweep %s: %s", flow_run.id, exc)


@flow(
    name="replica-sweep",
    flow_run_name=sweep_run_name,
    validate_parameters=True,
    on_cancellation=[cancel_trials],
)
def replica_sweep(
    grid: dict[str, list[Any]] | None = None,
    samples: dict[str, str] | None = None,
    count: int = 0,
    sample_seed: int = 0,
    recipe: str = "marin-535b-a23b",
    replica: str = "tiny",
    backend: Backend | None = None,
    overrides: dict[str, Any] | None = None,
    issue: str | None = None,
    until: Stage | None = None,
    git_ref: str = "HEAD",
    at_once: int = 0,
    metrics: list[str] | None = None,
    over: list[str] | None = None,
    dry_run: bool = False,
) -> dict[str, Any] | State[Any]:
    """Run the replica once per combination of the grid's values and compare the runs.

    Args:
        grid: Values to try, recipe key -> list: {"pretrain.lr": [0.005, 0.01, 0.02]}. Several keys
            try every combination (at most 64 runs).
        samples: Values to draw at random instead, recipe key -> distribution:
            {"pretrain.lr": "loguniform(0.001,0.03)"}; uniform(A,B), loguniform(A,B), int(A,B) or
            choice(V1,V2,...). Every grid combination runs the same draws.
        count: How many different draws of the samples to run.
        sample_seed: Seed of the draws: the same seed draws the same values (and reuses their runs).
        recipe: Recipe name (a file in recipes/) or path.
        replica: Scaled-down replica of the recipe.
        backend: Where the stage jobs run; empty: `[backends] default` of openlab.toml (local when unset).
        overrides: Values set for every run of the sweep, as `openlab run --set` sets them.
        issue: Experiment issue owner/repo#N every run of the sweep is linked to (its card on it).
        until: Stop each run after this stage; empty runs every stage of the replica.
        git_ref: Commit to run; HEAD runs the working tree as it is (each run as it finds it). Another ref is
            resolved once, when the sweep starts: every run runs that commit, wherever the ref moves meanwhile.
        at_once: How many runs at a time; 0 starts them all at once.
        metrics: Metric patterns for the comparison (`eval/*/loss`, `eval:eval/*/loss`); empty: eval's
            losses and repro's late-window drop fractions.
        over: Values to take the comparison over (["seed"]): a row per group of runs asked the same but for
            them, each metric as mean ± standard deviation over the group.
        dry_run: Start nothing: per run and stage, run, reuse or shared, and the jobs the sweep would start.
    """
    from flows.pipeline import failed_run
    from orchestrator.errors import OpenlabError

    try:
        return _sweep(
            grid=grid,
            samples=samples,
            count=count,
            sample_seed=sample_seed,
            recipe=recipe,
            replica=replica,
            backend=backend,
            overrides=overrides,
            issue=issue,
            until=until,
            git_ref=git_ref,
            at_once=at_once,
            metrics=metrics,
            over=over,
            dry_run=dry_run,
        )
    except OpenlabError as exc:  # a bad grid, a trial that failed: one line, no traceback; a bug keeps its own
        return failed_run(exc)


def _sweep(
    *,
    grid: dict[str, list[Any]] | None,
    samples: dict[str, str] | None,
    count: int,
    sample_seed: int,
    recipe: str,
    replica: str,
    backend: str | None,
    overrides: dict[str, Any] | None,
    issue: str | None,
    until: str | None,
    git_ref: str,
    at_once: int,
    metrics: list[str] | None,
    over: list[str] | None,
    dry_run: bool,
) -> dict[str, Any]:
    """The body of :func:`replica_sweep` (its arguments), which turns openlab's errors into its Failed state."""
    from prefect import get_client
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import get_run_context
    from prefect.deployments import run_deployment

    from flows.deployments import PIPELINE_DEPLOYMENT
    from flows.gitref import checkout_ref
    from flows.pipeline import flow_backend, replica_name, replica_pipeline, run_tags, sweep_tags, tag_flow_run
    from orchestrator.cards import render_comparison
    from orchestrator.errors import ConfigError, OpenlabError
    from orchestrator.lineage.compare import DEFAULT_METRICS, compare_runs
    from orchestrator.lineage.models import PipelineRun
    from orchestrator.lineage.store import LineageStore
    from orchestrator.pipeline.dag import REPO_ROOT
    from orchestrator.pipeline.sweep import check_over, plan_sweep
    from orchestrator.recipes import Sampling, parse_sample, set_words
    from orchestrator.settings import load_settings

    logger = get_run_logger()
    backend = flow_backend(backend)  # every run of the sweep on the one backend, whatever the default is by then
    tag_flow_run(getattr(get_run_context(), "flow_run", None), run_tags(recipe, replica, backend))
    if at_once < 0:
        raise ConfigError(f"sweep: at_once must be 0 (all at once) or more, got {at_once}")
    sampled = {key: parse_sample(key, text, "samples") for key, text in (samples or {}).items()}
    sampling = Sampling.asked(sampled, count, sample_seed, ("samples", "count"))
    if sampling is None and not grid:
        raise ConfigError('give the values to try: a grid ({"pretrain.lr": [0.005, 0.01]}) or samples and count')
    grid = grid or {}
    check_over(over or [], {**grid, **(sampling.samplers if sampling else {})}, "over")
    if issue:  # refused once, before any run starts (each would fail on it alike)
        from orchestrator.links.github import check_issue_option

        check_issue_option(issue, load_settings())
    # The recipe of the tree the runs will run (a git ref brings its own), every combination checked
    # against it before any run starts: nothing half-swept.
    repo_root = checkout_ref(REPO_ROOT, git_ref, load_settings())
    if git_ref and git_ref.strip() not in ("HEAD", "@"):  # each run at the commit checked, not where the ref is later
        from flows.gitref import resolve_ref

        git_ref = resolve_ref(REPO_ROOT, git_ref.strip())
    planned = plan_sweep(
        recipe,
        replica,
        grid,
        overrides,
        sampling=sampling,
        until=until or None,
        named=("grid", "overrides", "samples", "until"),
        root=repo_root,
    )
    if dry_run:
        return _dry_run(planned, backend=backend, git_ref=git_ref, repo_root=repo_root)
    trials = [trial.sets for trial in planned]
    sweep_id = planned[0].sweep["id"]
    name = f"{replica_pipeline.name}/{PIPELINE_DEPLOYMENT}"
    asked = {**grid, **({"sampled": sampling.to_dict()} if sampling else {})}
    logger.info("sweep %s: %d runs of %s:%s on %s: %s", sweep_id, len(trials), recipe, replica, backend, asked)

    pending = list(enumerate(trials))
    running: dict[Any, int] = {}  # flow run id -> trial number
    started: dict[Any, float] = {}  # flow run id -> when it was asked for, until it runs
    ended: dict[int, Any] = {}  # trial number -> final flow run
    with get_client(sync_client=True) as client:
        while pending or running:
            while pending and (at_once == 0 or len(running) < at_once):
                number, trial = pending.pop(0)
                parameters = {
                    "recipe": recipe,
                    "replica": replica,
                    "backend": backend,
                    "git_ref": git_ref,
                    "until": until,
                    "issue": issue,
                    "overrides": trial,
                }
                child = run_deployment(
                    name,
                    parameters=parameters,
                    timeout=0,  # started, not awaited: the trials run side by side
                    tags=sweep_tags(sweep_id, number + 1, len(trials)),  # recorded as its pipeline run's sweep
                    # the name the run takes when it starts, from the start: a search for the name logged finds it
                    flow_run_name=replica_name(parameters),
                )
                running[child.id] = number
                started[child.id] = time.monotonic()
                logger.info(
                    "run %d of %d: %s (flow run %r, id %s)",
                    number + 1,
                    len(trials),
                    " ".join(set_words(trial)),
                    child.name,
                    child.id,
                )
            time.sleep(POLL_SECONDS)
            for flow_run_id, number in list(running.items()):
                flow_run = client.read_flow_run(flow_run_id)
                if flow_run_id in started and flow_run.state is not None and not flow_run.state.is_scheduled():
                    del started[flow_run_id]  # it runs (or ran): a runner took it
                elif flow_run_id in started and time.monotonic() - started[flow_run_id] > WAITING_WARN_SECONDS:
                    del started[flow_run_id]  # said once
                    logger.warning(
                        "run %d of %d has waited %.0f s for a runner: is replica-pipeline/replica served, with room "
                        "for it beside this sweep (`openlab server --limit` at least at_once + 1)?",
                        number + 1,
                        len(trials),
                        WAITING_WARN_SECONDS,
                    )
                if flow_run.state is not None and flow_run.state.is_final():
                    del running[flow_run_id]
                    ended[number] = flow_run
                    logger.info("run %d of %d %s: %s", number + 1, len(trials), flow_run.state.name, flow_run.name)

    with LineageStore.open() as store:
        runs = [r for n in sorted(ended) for r in store.list(PipelineRun, flow_run_id=str(ended[n].id))]
        comparison = compare_runs(store, runs, metrics or DEFAULT_METRICS) if runs else None
    title = f"sweep {sweep_id} of {recipe}:{replica} on {backend}"
    if comparison is not None:
        shown = comparison.over(over) if over else comparison
        try:
            create_markdown_artifact(
                key="sweep", markdown=render_comparison(shown, title, metrics or ()), description=title
            )
        except Exception as exc:  # noqa: BLE001 - the runs and their lineage stand without it
            logger.warning("could not publish the sweep artifact: %s", exc)
        logger.info("compare them: `%s`", comparison.command(metrics or (), over=over or ()))
    failed = [(n, f) for n, f in sorted(ended.items()) if not f.state.is_completed()]
    if failed:
        named = "; ".join(f"{' '.join(set_words(trials[n]))}: {f.state.name} ({f.state.message})" for n, f in failed)
        raise OpenlabError(f"{len(failed)} of {len(trials)} sweep runs did not complete: {named}")
    return {
        "sweep": sweep_id,
        "runs": [{"trial": trials[n], "flow_run": str(f.id), "state": f.state.name} for n, f in sorted(ended.items())],
        "comparison": comparison.to_dict() if comparison is not None else None,
    }


def _dry_run(planned: list[Any], *, backend: str, git_ref: str, repo_root: Any) -> dict[str, Any]:
    """``openlab sweep --dry-run`` inside the flow, at the git ref the runs would use: the ``sweep-plan``
    artifact and a log line per run; nothing started or recorded."""
    from prefect.artifacts import create_markdown_artifact

    from orchestrator.cards import render_sweep_plan
    from orchestrator.pipeline.sweep import explain_sweep

    logger = get_run_logger()
    plan = explain_sweep(planned, backend=backend, repo_root=repo_root)
    first = planned[0].recipe
    title = f"sweep dry run: {len(planned)} runs of {first.name} on {backend} at git ref {git_ref}"
    for trial in planned:
        actions = ", ".join(f"{stage} {action}" for stage, action in plan.actions[trial.number].items())
        logger.info("dry run: run %d (%s): %s", trial.number, trial.label, actions)
    logger.info("the sweep would start %d jobs: %s", sum(plan.jobs.values()), plan.jobs)
    try:
        create_markdown_artifact(key="sweep-plan", markdown=render_sweep_plan(plan, title), description=title)
    except Exception as exc:  # noqa: BLE001 - the plan is in the logs and the return value either way
        logger.warning("could not publish the sweep's dry-run artifact: %s", exc)
    return {"dry_run": True, "git_ref": git_ref, "backend": backend, **plan.to_dict()}


__all__ = ["cancel_trials", "replica_sweep", "sweep_run_name"]
