"""The replica pipeline as a Prefect flow: one task per stage, lineage one click away.

Thin on purpose: :mod:`orchestrator.pipeline.execute` decides reuse, leases, launches
and lineage (the same code ``openlab run`` uses); this module only maps it onto Prefect:

- each stage is a task (``data`` → ``tokenize`` → ``pretrain`` → ``midtrain`` →
  ``posttrain`` → ``eval``, or the stages the replica names, e.g. ``data`` → ``tokenize`` →
  ``repro`` for the token-dropping reproduction); the job's log lines go to that task's run
  logger, and each transition (checking, waiting for a lease, reused and why, running, done)
  is logged; the library's own warnings go to the same log (:mod:`flows.logs`); a training
  stage's ``step N/M`` lines move a progress artifact on its task run (:mod:`flows.progress`);
- each stage publishes its lineage card (:func:`orchestrator.cards.stage_card`) as a
  markdown artifact keyed ``lineage-<stage>``, and the run its pipeline card as
  ``lineage-pipeline``;
- a Prefect task retry calls the library again with the same pipeline context, which
  keeps the stage run id, so the retry is a new *attempt* of the same stage run;
- cancellation: Prefect stops the flow-run process with SIGTERM, which arrives as
  ``TerminationSignal`` (a ``BaseException``); the library cancels the running backend
  job and records the attempt, the stage run and the pipeline run CANCELLED on its way
  out. A watcher thread also polls the flow run's state and feeds the library's
  ``should_cancel``, for deployments whose infrastructure does not signal the process.
  The ``on_cancellation`` hook (:mod:`flows.cancel`) remains as a safety net for a
  process killed before it could record anything;
- a crash (the flow process SIGKILLed or OOM-killed): the runner marks the flow run Crashed
  and runs the ``on_crashed`` hook (:mod:`flows.cancel`), which cancels the running job at
  once; the library's reconcile (at every pipeline start, and the ``lineage-reconcile``
  deployment every 10 minutes) catches what no runner saw, so a crashed run leaves neither
  a job running nor a stage run or pipeline run RUNNING forever;
- ``dry_run`` is ``openlab explain``: per stage run or reuse and which identity fields
  changed, as the markdown artifact ``explain`` and one log line per stage.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.states import State

from flows import events
from flows.cancel import on_cancellation_hook, on_crashed_hook
from flows.logs import library_logs_to_run
from flows.progress import StageProgress

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun
    from prefect.tasks import Task

    from orchestrator.pipeline.execute import PipelineContext, StageResult, StageTransition
    from orchestrator.recipes import ResolvedRecipe
    from orchestrator.settings import Settings

Backend = Literal["local", "docker", "slurm", "kubernetes"]
#: The stages a run can stop after (a dropdown in the UI form; orchestrator.recipes.STAGES, checked by a test).
Stage = Literal["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval", "repro"]

#: Pipeline contexts of the runs in this process, by pipeline run id (tasks get the id, not the object:
#: a context holds a database engine and locks, which Prefect must not try to hash or serialize).
_CONTEXTS: dict[str, PipelineContext] = {}
#: Per pipeline run, the Prefect run logger of each stage's current task run (log lines arrive on threads).
_LOGGERS: dict[str, dict[str, Any]] = {}
#: Per pipeline run, each stage's progress bar in the UI (fed from the job's ``step N/M`` lines).
_PROGRESS: dict[str, dict[str, StageProgress]] = {}

#: Seconds between looks at the flow run's state for a cancel request.
CANCEL_POLL_SECONDS = 2.0


class CancelWatcher(threading.Thread):
    """Polls this flow run's state; once it is CANCELLING/CANCELLED, :meth:`requested` is True."""

    def __init__(self, flow_run_id: str, interval: float = CANCEL_POLL_SECONDS) -> None:
        super().__init__(name=f"cancel-watch-{flow_run_id[:8]}", daemon=True)
        # Threads start with an empty context; carry the flow's Prefect settings (API URL) over.
        self._context = contextvars.copy_context()
        self.flow_run_id = flow_run_id
        self.interval = interval
        self._requested = threading.Event()
        self._stop = threading.Event()

    def requested(self) -> bool:
        return self._requested.is_set()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self._context.run(self._watch)

    def _watch(self) -> None:
        from prefect import get_client

        try:
            with get_client(sync_client=True) as client:
                while not self._stop.wait(self.interval):
                    try:
                        state = client.read_flow_run(self.flow_run_id).state
                    except Exception:  # noqa: BLE001, S112 - the API may blip; keep watching
                        continue
                    if state is not None and (state.is_cancelling() or state.is_cancelled()):
                        self._requested.set()
                        return
        except Exception:  # noqa: BLE001 - without a client there is nothing to watch
            return


def _stage_retries() -> int:
    from orchestrator.pipeline.execute import stage_retries

    return stage_retries()


def _retry_unless_cancelled(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry a failed stage, unless the library rules a retry out (:func:`why_not_retried`: it was
    cancelled, or its job refused its config), the same decision ``openlab run --retries`` makes;
    the line that says why goes to the stage's log (a cancel says so itself)."""
    from orchestrator.pipeline.execute import StageCancelled, why_not_retried

    try:
        state.result(raise_on_failure=True)
    except Exception as exc:  # noqa: BLE001 - anything the library does not rule out may be transient
        why = why_not_retried(exc)
        if why is not None and not isinstance(exc, StageCancelled):
            get_run_logger().warning("%s", why)
        return why is None
    return True


#: The Prefect loggers its engines log a run's exception to, with its traceback: the task's end
#: ("Task run failed with exception ... Retries are exhausted"), the flow's ("Encountered exception
#: during execution") and, in a served flow-run process, once more on the way out ("Engine execution
#: exited with unexpected exception").
TASK_RUN_LOGGER = "prefect.task_runs"
FLOW_RUN_LOGGER = "prefect.flow_runs"
#: The attribute of an exception that lists the Prefect loggers (above) that need not show it again.
_SHOWN_IN = "_openlab_shown_in"
#: Task runs (ids) that ended on an exception openlab showed: their "Finished in state Failed(...)"
#: line, which Prefect logs at ERROR, is a WARNING like their FAILED transition.
_SHOWN_TASK_RUNS: set[str] = set()


class _ShownErrorsFilter(logging.Filter):
    """Drops a Prefect engine record about an exception openlab has already shown in that run's log
    as one line (:func:`shown`), so a mistyped replica does not bury that line under two tracebacks
    of Prefect's own frames, and lowers a task's final-state line about it to WARNING, so the flow's
    line is the run's one ERROR. Any other exception, a bug's, keeps its record and traceback."""

    def __init__(self, logger_name: str) -> None:
        super().__init__()
        self.logger_name = logger_name

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        if exc is not None:
            return self.logger_name not in getattr(exc, _SHOWN_IN, ())
        task_run_id = getattr(record, "task_run_id", None)
        if record.levelno >= logging.ERROR and task_run_id is not None and str(task_run_id) in _SHOWN_TASK_RUNS:
            if str(record.msg).startswith("Finished in state"):
                record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def shown(exc: BaseException, *logger_names: str) -> BaseException:
    """Mark ``exc`` as shown in a run's log by openlab (its transition line, or the flow's error
    line), so the Prefect loggers named skip their record and traceback of it; returns ``exc``.

    Prefect logs an exception that ends a task or a flow with its traceback, however it is raised,
    and logs it again where a served process's flow returns a Failed state that carries it: the
    engines offer no switch, so a filter on their loggers drops the records of marked exceptions.
    """
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ShownErrorsFilter) for f in logger.filters):
            logger.addFilter(_ShownErrorsFilter(name))
    already = set(getattr(exc, _SHOWN_IN, ()))
    exc.__dict__[_SHOWN_IN] = frozenset(already | set(logger_names))
    if TASK_RUN_LOGGER in logger_names:
        from prefect.context import TaskRunContext

        task_run = TaskRunContext.get()
        if task_run is not None and task_run.task_run is not None:
            _SHOWN_TASK_RUNS.add(str(task_run.task_run.id))
    return exc


def failed_run(exc: BaseException, *, logged: bool = False) -> State[Any]:
    """The Failed state a flow returns for one of openlab's own errors (a mistyped replica, a stage
    whose job failed, a regression): its message is the error's one line, which is also logged
    once at ERROR (unless ``logged`` says a task of the run logged it already), without the
    traceback of Prefect's frames a bug would get. The state carries ``exc``, so a caller of the
    flow function (and ``state.result()``) still gets the exception itself."""
    from prefect.states import Failed

    line = " ".join(str(exc).split()) or type(exc).__name__
    if not logged:
        get_run_logger().error("%s", line)
    shown(exc, FLOW_RUN_LOGGER)
    return Failed(message=line, data=exc)


def _publish_stage_card(ctx: PipelineContext, stage: str, stage_run_id: str | None) -> None:
    """The stage's lineage card as the markdown artifact ``lineage-<stage>``; never fails the stage."""
    if not stage_run_id:
        return
    from prefect.artifacts import create_markdown_artifact

    from orchestrator.cards import stage_card

    try:
        create_markdown_artifact(
            key=f"lineage-{stage}",
            markdown=stage_card(ctx.store, stage_run_id),
            description=f"openlab lineage of stage {stage} (stage run {stage_run_id}, pipeline run {ctx.id})",
        )
    except Exception as exc:  # noqa: BLE001 - a card must not fail a stage
        get_run_logger().warning("could not publish the lineage card of %s: %s", stage, exc)


@task(name="stage", cache_policy=NO_CACHE, retry_condition_fn=_retry_unless_cancelled, retry_delay_seconds=2)
def run_stage(pipeline_run_id: str, stage: str) -> dict[str, Any]:
    """Reuse or run one stage through the library (again when its job is preempted, which spends
    no Prefect retry); publish its card; return its result summary."""
    from orchestrator.errors import OpenlabError
    from orchestrator.pipeline.execute import StageFailed, execute_stage_resuming

    ctx = _CONTEXTS[pipeline_run_id]
    logger = get_run_logger()
    _LOGGERS.setdefault(pipeline_run_id, {})[stage] = logger
    progress = _PROGRESS.setdefault(pipeline_run_id, {})[stage] = StageProgress(stage)
    try:
        result: StageResult = execute_stage_resuming(ctx, stage)
    except StageFailed as exc:
        failed = exc.result
        _publish_stage_card(ctx, stage, failed.stage_run_id if failed else ctx.stage_runs.get(stage))
        # its FAILED/CANCELLED transition line says why in this task's log; the flow says it once more
        shown(exc, TASK_RUN_LOGGER)
        raise
    except OpenlabError as exc:  # a stage refused before its job (a backend unknown): the flow's line says it
        shown(exc, TASK_RUN_LOGGER)
        raise
    progress.finish()
    _publish_stage_card(ctx, stage, result.stage_run_id)  # a reuse was said by its REUSED transition line
    return result.to_dict()


def _forward_to_prefect(ctx: PipelineContext, watcher: CancelWatcher | None, flow_logger: Any) -> None:
    """Chain onto ``ctx``'s hooks the callbacks that show a stage in the UI: its job's log lines and
    its transitions in the stage task's log, its progress bar, and the flow run's cancellation.

    Whatever hooks the caller gave (a custom flow's own) still run first; so a flow built on
    :func:`run_stages_as_tasks` shows its stages the way the replica flows do.
    """
    # Log lines arrive on the launcher's log-pump thread, which has an empty context: run each
    # call in a copy of the flow's context so Prefect's log handler sees the same settings.
    base = contextvars.copy_context()
    own = ctx.hooks

    def logger_for(stage: str) -> Any:
        return _LOGGERS.get(ctx.id, {}).get(stage, flow_logger)

    def on_log(stage: str, line: str) -> None:
        if own.on_log is not None:
            own.on_log(stage, line)
        base.copy().run(logger_for(stage).info, "[%s] %s", stage, line)

    def on_transition(event: StageTransition) -> None:
        if own.on_transition is not None:
            own.on_transition(event)
        level = "warning" if event.state in ("FAILED", "CANCELLED", "PREEMPTED") else "info"
        base.copy().run(getattr(logger_for(event.stage), level), "%s", event.line())

    def on_progress(stage: str, done: int, total: int) -> None:
        if own.on_progress is not None:
            own.on_progress(stage, done, total)
        progress = _PROGRESS.get(ctx.id, {}).get(stage)
        if progress is not None:
            progress.update(done, total)

    def should_cancel() -> bool:
        return bool(
            (own.should_cancel is not None and own.should_cancel()) or (watcher is not None and watcher.requested())
        )

    ctx.hooks = replace(
        own, on_log=on_log, on_transition=on_transition, on_progress=on_progress, should_cancel=should_cancel
    )


def run_replica(
    *,
    recipe: str,
    replica: str,
    backend: str | None,
    issue: str | None,
    git_ref: str,
    force: bool,
    dry_run: bool,
    trigger: str | None = None,
    require_issue: bool = False,
    until: str | None = None,
    overrides: dict[str, Any] | None = None,
    force_stages: list[str] | None = None,
    retries: int | None = None,
) -> dict[str, Any]:
    """The body of the pipeline flows (also used by the nightly): start, run each stage as a task, finish.

    ``force_stages`` re-runs those stages even where a completed identical one exists (``openlab run
    --force-stage``); ``retries`` is this run's retries of a failed stage, over ``[pipeline]
    stage_retries``."""

    from flows.gitref import checkout_ref
    from orchestrator.errors import ConfigError
    from orchestrator.pipeline.execute import RunOptions, start_recipe
    from orchestrator.recipes import resolve
    from orchestrator.settings import load_settings

    logger = get_run_logger()
    run_ctx = get_run_context()
    flow_run = getattr(run_ctx, "flow_run", None)
    flow_run_id = str(flow_run.id) if flow_run is not None else None
    with library_logs_to_run(flow_run_id):  # the library's warnings reach this run's log in the UI
        settings = load_settings()
        backend = flow_backend(backend, settings)
        from orchestrator.pipeline.dag import REPO_ROOT

        repo_root = checkout_ref(REPO_ROOT, git_ref, settings)
        if repo_root != REPO_ROOT:
            logger.info("running git ref %s from worktree %s", git_ref, repo_root)
        # The recipe of the tree that runs (a checked-out ref brings its own), cut --until a stage.
        try:
            named = dict.fromkeys(overrides or {}, "overrides")  # the run form's field, not `--set`
            resolved = resolve(recipe, replica, root=repo_root, sets=overrides, sets_from=named).until(
                until or None, "until"
            )
        except ConfigError as exc:
            if repo_root == REPO_ROOT:
                raise
            # the ref's recipe file, read by this server's code: a key added (or dropped) since shows here
            raise ConfigError(
                f"{exc} (the recipe of git ref {git_ref} was read with the recipe schema of the code serving this "
                "flow; if that ref's recipes use keys this code does not know, serve the flows from that ref)"
            ) from None
        tag_flow_run(flow_run, run_tags(resolved.recipe.name, resolved.replica, backend))
        forced: bool | frozenset[str] = force or (frozenset(force_stages) if force_stages else False)
        if retries is not None and retries < 0:
            raise ConfigError(f"retries = {retries}: give 0 or more (the retries of a failed stage)")
        if dry_run:
            return _dry_run(
                resolved=resolved,
                backend=backend,
                git_ref=git_ref,
                force=forced,
                repo_root=repo_root,
                settings=settings,
            )
        watcher = CancelWatcher(flow_run_id) if flow_run_id else None
        params = {
            "recipe": recipe,
            "replica": replica,
            "backend": backend,
            "issue": issue,
            "require_issue": require_issue,
            "git_ref": git_ref,
            "force": force,
            "dry_run": dry_run,
            "until": until,
            "overrides": dict(overrides or {}),
            "flow_run_id": flow_run_id,
            **({"force_stages": sorted(force_stages)} if force_stages else {}),
            **({"retries": retries} if retries is not None else {}),
        }
        automation = _automation(flow_run)
        if automation:  # which Automation started it: the trigger alone says only that one did
            params["automation"] = automation
        sweep = sweep_of(flow_run)
        options = RunOptions(
            backend=backend,
            issue=issue or None,
            issue_required=require_issue,
            force=forced,
            trigger=trigger or _trigger(flow_run),
            flow_run_id=flow_run_id,
            params={"prefect": params, **({"sweep": sweep} if sweep else {})},
        )
        ctx = start_recipe(resolved, options=options, settings=settings, repo_root=repo_root)
        logger.info("pipeline run %s: %s on %s (commit %s)", ctx.id, ctx.pipeline_run.name, backend, ctx.commit.id[:12])
        if ctx.pipeline_run.params.get("retry_of"):
            logger.info(
                "this flow run is retried: pipeline run %s retries %s (completed stages are reused, a training "
                "stage resumes from its checkpoint)",
                ctx.id,
                ctx.pipeline_run.params["retry_of"],
            )
        run_stages_as_tasks(ctx, retries=_stage_retries() if retries is None else retries, watcher=watcher)
        summary = {
            "pipeline_run_id": ctx.id,
            "recipe_path": str(resolved.recipe.path),  # the file that ran (a checked-out ref's own)
            "state": ctx.pipeline_run.state,
            "commit": ctx.commit.id,
            "stages": {s: r.to_dict() for s, r in ctx.results.items()},
        }
        from orchestrator.preregistration import outcome_lines

        for line in outcome_lines(ctx.pipeline_run.preregistration):
            logger.info("pre-registered %s", line)
        summary["preregistration"] = ctx.pipeline_run.preregistration
        logger.info("pipeline run %s %s; `openlab lineage show %s`", ctx.id, ctx.pipeline_run.state, ctx.id)
        from orchestrator.lineage.diff import compare_hint

        hint = compare_hint(ctx.store, ctx.pipeline_run)
        if hint:  # what changed since the last run of this replica, and how the results moved
            logger.info("compared with the previous run: `%s`", hint)
        return summary


def run_tags(recipe: str | None, replica: str | None, backend: str | None = None) -> set[str]:
    """``openlab``, ``recipe:<name>``, ``replica:<name>`` and ``backend:<name>``: what the UI's run
    list filters a replica's runs by (its flow run, and each stage's task run as :func:`stage_tags`)."""
    tags = {"openlab"}
    tags |= {
        f"{key}:{value}" for key, value in (("recipe", recipe), ("replica", replica), ("backend", backend)) if value
    }
    return tags


def tag_flow_run(flow_run: Any, tags: set[str]) -> None:
    """Add ``tags`` to this flow run, beside those it was created with (its deployment's, a sweep's).

    A deployment's tags are the same for every run, and the recipe, replica and backend of one are
    known only once its parameters are read (a form left without a backend runs on the default),
    so they are added from inside the run; without them the run list could filter task runs by
    replica but not the runs themselves. Never fails the run: the tags are for finding it."""
    if flow_run is None or tags <= set(getattr(flow_run, "tags", None) or ()):
        return
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(flow_run.id).tags or []  # the latest: a retry's, a person's
            client.update_flow_run(flow_run.id, tags=sorted(set(current) | tags))
    except Exception as exc:  # noqa: BLE001 - a tag must not fail a run
        get_run_logger().warning("could not tag this flow run %s: %s", ", ".join(sorted(tags)), exc)


def stage_tags(ctx: PipelineContext, stage: str) -> set[str]:
    """The Prefect tags of ``stage``'s task run: what to filter by in the UI, and what Prefect's
    tag concurrency limits count (``prefect concurrency-limit create backend:slurm 4``: at most
    four openlab jobs on Slurm at once from this server; ``stage:pretrain 1``: one pretrain job at
    a time; ``gpu 1``: one GPU job at a time).

    ``openlab``, ``recipe:<name>`` (``pipeline:<name>`` without one) and ``replica:<name>``
    always. ``stage:<name>``, ``backend:<name>`` and ``gpu`` (when the stage asks for GPUs) only
    on a stage that will launch a job; a stage about to be reused is tagged ``reused`` instead
    (its task run is still named after the stage), so a limit on long jobs never holds up a run
    that only reuses their outputs.
    """
    from orchestrator.pipeline.execute import would_reuse

    spec = ctx.pipeline.stage(stage)
    run = ctx.pipeline_run
    tags = {"openlab", f"recipe:{run.recipe}" if run.recipe else f"pipeline:{ctx.pipeline.name}"}
    if run.replica:
        tags.add(f"replica:{run.replica}")
    try:
        reused = would_reuse(ctx, stage)
    except Exception as exc:  # noqa: BLE001 - a forecast; the stage itself reports what is wrong
        get_run_logger().debug("could not forecast whether %s is reused: %s", stage, exc)
        reused = False
    if reused:
        tags.add("reused")
    else:
        tags |= {f"stage:{stage}", f"backend:{ctx.backend_of(spec)}"}
        if spec.gpus:
            tags.add("gpu")
    return tags


def run_stages_as_tasks(ctx: PipelineContext, *, retries: int = 1, watcher: CancelWatcher | None = None) -> None:
    """Run every stage of a started pipeline as a Prefect task (in order), then close the pipeline run.

    A failed stage is retried ``retries`` times by Prefect; the library keeps the stage run
    id in ``ctx``, so each retry is a new attempt of the same stage run.
    """
    from orchestrator.launchers.attempts import interruption_reason
    from orchestrator.pipeline.execute import StageCancelled, StageFailed, finish_pipeline

    _CONTEXTS[ctx.id] = ctx
    if watcher is None:  # a custom flow's: its flow run's cancellation must stop the jobs too
        run = get_run_context()
        flow_run = getattr(run, "flow_run", None)
        watcher = CancelWatcher(str(flow_run.id)) if flow_run is not None else None
    _forward_to_prefect(ctx, watcher, get_run_logger())
    events.emitting_transitions(ctx)
    if watcher is not None:
        watcher.start()
    state: str | None = None
    error: str | None = None
    try:
        with library_logs_to_run():
            for stage in ctx.pipeline.order:
                run_stage.with_options(name=stage, retries=retries, tags=stage_tags(ctx, stage))(ctx.id, stage)
    except StageCancelled as exc:
        state, error = "CANCELLED", str(exc)
        raise
    except StageFailed as exc:
        state, error = "FAILED", str(exc)
        raise
    except Exception as exc:
        state, error = "FAILED", f"{type(exc).__name__}: {exc}"
        raise
    except BaseException as exc:
        # Prefect's TerminationSignal (the flow run was cancelled), Ctrl-C, SystemExit: the stage
        # that was running already cancelled its job and recorded CANCELLED (run_job, execute_stage)
        state, error = "CANCELLED", f"flow-run process stopped: {interruption_reason(exc)}"
        raise
    finally:
        if watcher is not None:
            watcher.stop()
        try:
            finish_pipeline(ctx, state, error)
            events.pipeline_finished(ctx)
            _publish_pipeline_card(ctx)
        finally:
            _CONTEXTS.pop(ctx.id, None)
            _LOGGERS.pop(ctx.id, None)
            _PROGRESS.pop(ctx.id, None)


def _trigger(flow_run: Any) -> str:
    """``schedule`` for cron runs, ``automation`` for runs a Prefect Automation's *run deployment*
    action created, ``ui`` for deployment runs started by a person or the API, else ``prefect``."""
    if flow_run is None:
        return "prefect"
    if getattr(flow_run, "auto_scheduled", False):
        return "schedule"
    if _automation(flow_run):
        return "automation"
    return "ui" if getattr(flow_run, "deployment_id", None) else "prefect"


#: The tags a sweep gives each flow run it starts (:mod:`flows.sweep`): ``sweep:<id>`` (a filter in
#: the UI's run list) and ``sweep-run:<n>/<of>``.
SWEEP_TAG = "sweep:"
SWEEP_RUN_TAG = "sweep-run:"


def sweep_tags(sweep_id: str, number: int, count: int) -> list[str]:
    """The tags of run ``number`` of ``count`` of sweep ``sweep_id`` (read back by :func:`sweep_of`)."""
    return ["sweep", f"{SWEEP_TAG}{sweep_id}", f"{SWEEP_RUN_TAG}{number}/{count}"]


def sweep_of(flow_run: Any) -> dict[str, Any] | None:
    """``params.sweep`` of a flow run a sweep started, from its tags; None for any other run.

    Tags, not a parameter: the run form would show a ``sweep`` field a person should never fill in.
    """
    from orchestrator.pipeline.sweep import sweep_params

    tags = list(getattr(flow_run, "tags", None) or [])
    ids = [t[len(SWEEP_TAG) :] for t in tags if t.startswith(SWEEP_TAG)]
    runs = [t[len(SWEEP_RUN_TAG) :].partition("/") for t in tags if t.startswith(SWEEP_RUN_TAG)]
    if len(ids) != 1 or len(runs) != 1 or not (runs[0][0].isdigit() and runs[0][2].isdigit()):
        return None
    return sweep_params(ids[0], int(runs[0][0]), int(runs[0][2]), _sweep_sampling(flow_run))


def _sweep_sampling(flow_run: Any) -> Any:
    """How the sweep flow run that started ``flow_run`` drew its values (``params.sweep.sampled``, as
    ``openlab sweep --sample`` records it), read from that sweep's own parameters: its ``samples``,
    ``count`` and ``sample_seed`` are enough to draw the same values again, and a tag could not hold
    them. None for a grid-only sweep, or when the sweep's run cannot be read (logged: the run goes on)."""
    parent_task_run = getattr(flow_run, "parent_task_run_id", None)
    if parent_task_run is None:
        return None
    from prefect import get_client

    from orchestrator.recipes import Sampling, parse_sample

    try:
        with get_client(sync_client=True) as client:
            sweep = client.read_flow_run(client.read_task_run(parent_task_run).flow_run_id)
        given = dict(sweep.parameters or {})
        samples = given.get("samples") or {}
        if not samples:
            return None
        sampled = {key: parse_sample(key, text, "samples") for key, text in samples.items()}
        return Sampling.asked(sampled, given.get("count"), given.get("sample_seed") or 0, ("samples", "count"))
    except Exception as exc:  # noqa: BLE001 - a record without `sampled` beats a run that fails over it
        get_run_logger().warning("could not read how the sweep drew this run's values: %s", exc)
        return None


def _automation(flow_run: Any) -> str | None:
    """The name of the Automation that created ``flow_run``, as Prefect records it (``created_by``
    of type ``AUTOMATION``; Prefect's open-source server sets no other creator)."""
    created_by = getattr(flow_run, "created_by", None)
    if created_by is None or str(getattr(created_by, "type", "")).upper() != "AUTOMATION":
        return None
    return getattr(created_by, "display_value", None) or str(getattr(created_by, "id", "")) or None


def _publish_pipeline_card(ctx: PipelineContext) -> None:
    from prefect.artifacts import create_markdown_artifact

    from orchestrator.cards import pipeline_card

    try:
        create_markdown_artifact(
            key="lineage-pipeline",
            markdown=pipeline_card(ctx.store, ctx.id),
            description=f"openlab lineage of pipeline run {ctx.id}",
        )
    except Exception as exc:  # noqa: BLE001 - a card must not fail the run
        get_run_logger().warning("could not publish the pipeline card: %s", exc)


def _dry_run(
    *,
    resolved: ResolvedRecipe,
    backend: str,
    git_ref: str,
    force: bool | frozenset[str],
    repo_root: Path,
    settings: Settings,
) -> dict[str, Any]:
    """``openlab explain`` inside the flow: per stage run or reuse and which identity fields changed.

    The same library call as the terminal (:func:`orchestrator.pipeline.explain_recipe`), at
    the same git ref the real run would use, so pressing *dry run* in the UI answers "what
    would this run redo, and why" before any GPU time is spent. Published as the markdown
    artifact ``explain`` and logged one line per stage; nothing is launched or recorded.
    """
    from prefect.artifacts import create_markdown_artifact

    from orchestrator.pipeline.plan import explain_recipe, plan_markdown

    logger = get_run_logger()
    plans = explain_recipe(resolved, settings=settings, force=force, repo_root=repo_root, backend=backend)
    said = f", forced: {', '.join(sorted(force))}" if isinstance(force, frozenset) else ", forced" if force else ""
    title = f"openlab explain {resolved.name} (backend {backend}, git ref {git_ref}{said})"
    for p in plans:
        changed = f"; changed: {'; '.join(p.changes)}" if p.changes else ""
        logger.info("dry run: %s would %s - %s%s", p.stage, p.action, p.reason, changed)
    try:
        create_markdown_artifact(key="explain", markdown=plan_markdown(title, plans), description=title)
    except Exception as exc:  # noqa: BLE001 - the plan is in the logs and the return value either way
        logger.warning("could not publish the dry-run artifact: %s", exc)
    return {
        "dry_run": True,
        "recipe": resolved.name,
        "backend": backend,
        "git_ref": git_ref,
        "force": sorted(force) if isinstance(force, frozenset) else force,
        "lineage": resolved.lineage(),
        "stages": [p.to_dict() for p in plans],
    }


def flow_backend(backend: str | None, settings: Settings | None = None) -> str:
    """The backend a flow's stage jobs run on: the form's, else ``[backends] default`` (as ``openlab
    run`` without ``--backend``): the scheduled nightly, whose form nobody fills in, ran on the
    server's own machine whatever the lab had configured."""
    from orchestrator.settings import load_settings

    if backend:
        return backend
    return (settings or load_settings()).default_backend  # a misspelt default is refused, named, there


def default_backend_name() -> str:
    """``[backends] default``, for a run name; "the default backend" where the settings cannot be read."""
    try:
        return flow_backend(None)
    except Exception:  # noqa: BLE001 - a name must not fail a run; the run itself says why
        return "the default backend"


def replica_run_name(prefix: str = "") -> str:
    """The flow run's name in the UI's run list, from its parameters: ``marin-535b-a23b:tiny on
    slurm``, ``… @ v1.2 until tokenize (dry run)``, where Prefect would pick two random words
    (``stereotyped-chipmunk``) that say nothing of what ran."""
    from prefect.runtime import flow_run

    return replica_name(flow_run.parameters or {}, prefix)


def replica_name(params: dict[str, Any], prefix: str = "") -> str:
    """:func:`replica_run_name` of a run with these parameters: also the name a sweep gives each run it
    creates, so the name it logs is the one the run list shows once the run starts."""
    from orchestrator.recipes import set_words

    name = (
        f"{prefix}{params.get('recipe')}:{params.get('replica')} on {params.get('backend') or default_backend_name()}"
    )
    if params.get("git_ref") not in (None, "", "HEAD"):
        name += f" @ {params['git_ref']}"
    if params.get("until"):
        name += f" until {params['until']}"
    for word in set_words(params.get("overrides") or {}):  # the experiment's own values
        name += f" {word}"
    if params.get("dry_run"):
        name += " (dry run)"
    return name


@flow(
    name="replica-pipeline",
    description="Run a recipe's replica stage by stage with reuse, leases and lineage.",
    flow_run_name=replica_run_name,
    on_cancellation=[on_cancellation_hook],
    on_crashed=[on_crashed_hook],
    validate_parameters=True,
)
def replica_pipeline(
    recipe: str = "marin-535b-a23b",
    replica: str = "tiny",
    backend: Backend | None = None,
    issue: str | None = None,
    require_issue: bool = False,
    git_ref: str = "HEAD",
    force: bool = False,
    dry_run: bool = False,
    until: Stage | None = None,
    overrides: dict[str, Any] | None = None,
    force_stages: list[Stage] | None = None,
    retries: int | None = None,
) -> dict[str, Any] | State[Any]:
    """Run a recipe's scaled-down replica stage by stage, reusing what is already done.

    Args:
        recipe: Recipe name (a file in recipes/) or path.
        replica: Scaled-down replica of the recipe (tiny runs in minutes on 2 CPU cores).
        backend: Where the stage jobs run; empty: `[backends] default` of openlab.toml (local when unset).
        issue: Experiment issue owner/repo#N whose card shows this run's lineage.
        require_issue: Fail before any job starts when the issue cannot be resolved (no token, 404, 401).
        git_ref: Commit to run; HEAD runs the working tree as it is, anything else a clean checkout.
        force: Re-run every stage even when a completed identical one exists.
        dry_run: Launch nothing; say for each stage whether it would run or be reused, and which
            identity fields changed since its closest completed run (what `openlab explain` prints).
        until: Stop after this stage (it and the stages it reads from run; e.g. tokenize to
            prepare data now and train later); empty runs every stage of the replica.
        overrides: Recipe values for this run only, over the replica's own, as `openlab run --set`
            sets them: {"pretrain.lr": 0.02, "dispatch.scheme": "ragged"}. They change the stages'
            identities (what is reused) and are recorded with the run.
        force_stages: Re-run these stages even when a completed identical one exists (after fixing
            the eval code: eval); the others are reused as usual. `openlab run --force-stage`.
        retries: Retries of a failed stage in this run; empty: `[pipeline] stage_retries`.
    """
    from orchestrator.errors import OpenlabError

    try:
        return run_replica(
            recipe=recipe,
            replica=replica,
            backend=backend,
            issue=issue,
            require_issue=require_issue,
            git_ref=git_ref,
            force=force,
            dry_run=dry_run,
            until=until,
            overrides=overrides,
            force_stages=list(force_stages or []),
            retries=retries,
        )
    except OpenlabError as exc:  # a user's mistake or a stage's failure, said in one line; a bug keeps its traceback
        return failed_run(exc)


__all__ = [
    "Backend",
    "CancelWatcher",
    "Stage",
    "default_backend_name",
    "failed_run",
    "flow_backend",
    "replica_name",
    "replica_pipeline",
    "run_replica",
    "run_stage",
    "run_stages_as_tasks",
    "run_tags",
    "shown",
    "sweep_of",
    "sweep_tags",
]
