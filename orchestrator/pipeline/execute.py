"""Executing a pipeline: one stage at a time, skip-if-done by content, one holder per identity.

The flow of :func:`execute_stage`, and why each step is there:

1. **Identity** (:mod:`orchestrator.identity`): the stage's config (minus inputs, W&B and
   runtime placement), its inputs by *content* (upstream outputs hashed without volatile
   files such as ``metrics.json``), the working-tree tree hashes of its declared code
   paths and its declared environment fields. The output folder is
   ``artifacts_dir/<stage>/<identity[:16]>``: derived from the identity, never part of it.
2. **Reuse** (:mod:`orchestrator.pipeline.reuse`): a COMPLETED stage run with the same
   identity whose outputs still verify (content hash re-checked) is reused: a REUSED stage
   run points at it (``reused_from``) and the reason is logged. The check runs before the
   lease (re-hashing is the slow part), the decision under it (step 3).
3. **Lease** (:mod:`orchestrator.lineage.leases`): take the lease on the identity; if another
   live holder has it, wait, then check for reuse again — so two pipeline runs started at
   once execute each identity once. A reuse is recorded under the lease too, after checking
   that the outputs verified in step 2 are still there: ``openlab gc`` deletes only under the
   same lease, so either gc sees the REUSED stage run (and keeps the folder) or the reuse sees
   the removal (and runs the stage again) — never a reused folder deleted in between.
4. **Run** the job with :func:`orchestrator.launchers.attempts.run_job` on the chosen
   backend, streaming its log to the hooks; a lost lease or a cancel request cancels it.
5. **Record** (:mod:`orchestrator.pipeline.outputs`) the output folder as an Artifact
   (snapshot Merkle hash) ``wasGeneratedBy`` the stage run, which ``used`` its inputs and
   ``wasAssociatedWith`` the commit and the environment; metrics come from ``metrics.json``.

The same functions serve ``openlab run`` (terminal, no Prefect) and the Prefect flows in
``flows/``: :func:`start_pipeline` / :func:`execute_stage` / :func:`finish_pipeline` for
a flow that maps each stage onto a task, :func:`run_pipeline` for everything at once.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import col

from orchestrator.errors import ConfigError, OpenlabError, choices
from orchestrator.identity import StageIdentity, compute_identity, diff_identities
from orchestrator.lineage import leases
from orchestrator.lineage.models import (
    Artifact,
    Attempt,
    Commit,
    Environment,
    PipelineRun,
    StageRun,
    new_id,
    utcnow,
)
from orchestrator.lineage.record import live_records_at, mark_removed
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.checkpoints import checkpoint_mark, stopped_with_progress, warn_before_limit
from orchestrator.pipeline.dag import Pipeline, StageSpec, default_python, moe_pipeline
from orchestrator.pipeline.outputs import hash_output, output_dir, read_metrics, record_outputs
from orchestrator.pipeline.reuse import (
    NO_LONGER_VERIFY,
    closest_completed,
    describe_changes,
    find_reusable,
    latest_completed,
    still_reusable,
    unchanged_since,
)
from orchestrator.provenance.invocation import current_user
from orchestrator.recipes import ResolvedRecipe, identity_config
from orchestrator.secrets import scrub
from orchestrator.settings import Settings, load_settings

if TYPE_CHECKING:
    from orchestrator.launchers.base import Launcher
    from orchestrator.provenance import Provenance

log = logging.getLogger("openlab.pipeline")
#: Stage transitions, one line each; a separate logger so a display that shows transitions its own
#: way (the terminal's bars, the flows' task logs) can leave these out.
transition_log = logging.getLogger("openlab.pipeline.transitions")
# With no handler anywhere, Python's last resort prints every WARNING: each failed stage came out a
# second time, bare, under `openlab run`'s and `openlab sweep`'s own line for it. A handler that
# drops them keeps that from happening and leaves whatever a program configures (a root handler,
# basicConfig) to receive them as before.
transition_log.addHandler(logging.NullHandler())

#: Stage states a transition hook sees (lineage states plus the two waiting phases).
TRANSITIONS = ("CHECKING", "WAITING", "RUNNING", "REUSED", "COMPLETED", "FAILED", "CANCELLED", "SKIPPED")

_PROGRESS = re.compile(r"\bstep[ =:]*(\d+)\s*/\s*(\d+)", re.IGNORECASE)


class StageFailed(OpenlabError):
    """A stage ended FAILED (its result, with the reason, is attached)."""

    exit_code = 1

    def __init__(self, message: str, result: StageResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class StageCancelled(StageFailed):
    """A stage was cancelled (by request, or because its lease was taken over)."""


class StagePreempted(StageFailed):
    """A stage's job was stopped from outside (preempted, evicted, a scheduler's stop signal), or by
    its own time limit after saving its checkpoint anew (:mod:`orchestrator.pipeline.checkpoints`): not its
    own failure, so :func:`execute_stage_resuming` runs it again without spending a retry, and a
    training stage resumes from the checkpoint it saved on the way out."""


# -- options, hooks, results ------------------------------------------------------------------

#: Retries of a failed stage when ``[pipeline] stage_retries`` is not set (the flows' Prefect task
#: retries and ``openlab run`` both use it, so a stage is retried the same from the UI and a terminal).
DEFAULT_STAGE_RETRIES = 1
#: New attempts of a preempted stage when ``[pipeline] preemption_retries`` is not set. Apart from
#: the retries: a preemption is not the job's failure, but a bound keeps a job that is preempted
#: every time (or that dies by SIGTERM on its own) from running for ever.
DEFAULT_PREEMPTION_RETRIES = 3


@dataclass
class RunOptions:
    """How to run a pipeline: backend, links, forcing, lease timing, trigger."""

    backend: str = "local"
    #: Experiment issue ``owner/repo#N`` (or ``#N`` with a configured default repo).
    issue: str | None = None
    #: Stop before any job starts when the issue cannot be linked (also ``[github] required = true``).
    issue_required: bool = False
    #: True re-runs every stage; a collection of stage names re-runs those.
    force: bool | frozenset[str] = False
    trigger: str = "terminal"
    #: What the person typed (:func:`orchestrator.provenance.invocation.command_line`); None when
    #: Prefect started the run (its parameters are in ``params``).
    command: list[str] | None = None
    flow_run_id: str | None = None
    #: Extra parameters recorded on the pipeline run (e.g. the UI's form values).
    params: dict[str, Any] = field(default_factory=dict)
    lease_ttl: float = leases.DEFAULT_TTL
    heartbeat_interval: float | None = None
    #: Seconds between looks while another holder runs the same identity.
    wait_poll: float = 1.0
    wait_timeout: float | None = None
    job_timeout: float | None = None
    #: Longest gap between job status looks (None: the launcher's ``poll_interval``, which
    #: ``[backends.<name>] poll_interval`` sets). Cancel requests do not wait for a look:
    #: ``run_job`` checks them every quarter second in between.
    poll: float | None = None
    #: Re-read every output byte when checking reuse (default: trust the snapshot stat cache).
    deep_verify: bool = False
    launcher_overrides: dict[str, Any] = field(default_factory=dict)
    #: The pipeline run this one runs again (``openlab rerun``); a Prefect retry finds its own
    #: from the flow run id.
    retry_of: str | None = None

    def forced(self, stage: str) -> bool:
        return self.force is True or (not isinstance(self.force, bool) and stage in self.force)


@dataclass(frozen=True)
class StageTransition:
    """A stage changing phase; what the hooks (Prefect logs, cards, progress bars) see."""

    pipeline_run_id: str
    stage: str
    state: str
    identity: str | None = None
    stage_run_id: str | None = None
    reason: str = ""
    result: StageResult | None = None
    at: dt.datetime = field(default_factory=utcnow)

    def line(self) -> str:
        """``pretrain COMPLETED in 5.2 s, job 4711 on marin-west (it ran because: ...)``: the
        transition as a log line. A completed stage says how long it took and which job on which
        cluster did it; the reason it ran (given again when it ends) is put in brackets, where it
        read as the reason it completed."""
        if self.state == "COMPLETED" and self.result is not None:
            where = f" on {self.result.cluster}" if self.result.cluster else ""
            job = f", job {self.result.job_id}{where}" if self.result.job_id else ""
            why = f" (it ran because: {self.reason})" if self.reason else ""
            took = f"{self.result.seconds:.1f} s"
            if stopped := self.result.stopped_seconds:  # the last job's time alone hid the others'
                total = self.result.seconds + sum(stopped)
                took += f", {total:.1f} s in all over {len(stopped) + 1} jobs ({len(stopped)} stopped and run again)"
            return f"{self.stage} COMPLETED in {took}{job}{why}"
        return f"{self.stage} {self.state}{': ' + self.reason if self.reason else ''}"


@dataclass
class PipelineHooks:
    """Callbacks for the layer above (terminal display, Prefect flow).

    Every callback may be called from a background thread (log pump, lease heartbeat);
    an exception in a hook is logged and otherwise ignored — a display must not kill a run.
    """

    #: ``(stage, line)`` for each line of a running job's log.
    on_log: Callable[[str, str], None] | None = None
    #: Each :class:`StageTransition`.
    on_transition: Callable[[StageTransition], None] | None = None
    #: ``(stage, done, total)`` parsed from ``step N/M`` in job logs.
    on_progress: Callable[[str, int, int], None] | None = None
    #: Polled while waiting and while a job runs; True cancels (e.g. Prefect cancellation), and a
    #: text cancels saying why (recorded as the stage's reason: "the sweep was interrupted").
    should_cancel: Callable[[], bool | str] | None = None


@dataclass
class StageResult:
    """What one :func:`execute_stage` call did."""

    stage: str
    state: str  # COMPLETED | REUSED | FAILED | CANCELLED
    stage_run_id: str
    identity: str
    identity_fields: dict[str, Any]
    out_dir: Path
    outputs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    #: Identity fields that differ from the last completed run of this stage.
    changes: list[str] = field(default_factory=list)
    reused_from: str | None = None
    attempt_id: str | None = None
    job_id: str | None = None
    #: Where that job ran (the attempt's :attr:`~orchestrator.lineage.models.Attempt.cluster`).
    cluster: str | None = None
    seconds: float = 0.0
    #: The seconds of each earlier job of this stage in this pipeline run that was stopped from
    #: outside, or by its limit after saving, and went on in the next (:func:`execute_stage_resuming`).
    stopped_seconds: tuple[float, ...] = ()
    #: For a PREEMPTED result, what stopped the job: ``"preemption"`` (from outside: a scheduler, an
    #: eviction, a signal) or ``"time-limit"`` (its own limit, after saving its checkpoint anew).
    stopped_by: str | None = None
    #: For a PREEMPTED result, whether the job saved its checkpoint anew, so the next attempt gets
    #: further: such stops do not count towards ``[pipeline] preemption_retries``.
    progress_saved: bool = False
    #: The exit code of the stage's last job (its attempt's), when it ran one and one was reported:
    #: with the reason it tells a job that refused its config from one that broke (:func:`why_not_retried`).
    exit_code: int | None = None

    @property
    def ok(self) -> bool:
        return self.state in ("COMPLETED", "REUSED")

    @property
    def output(self) -> dict[str, Any]:
        return dict(self.outputs.get("out") or {})

    @property
    def content_hash(self) -> str | None:
        return self.output.get("content_hash")

    @property
    def input_hash(self) -> str | None:
        """The hash downstream identities use (volatile files excluded)."""
        return self.output.get("input_hash") or self.content_hash

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "state": self.state,
            "stage_run_id": self.stage_run_id,
            "identity": self.identity,
            "out_dir": str(self.out_dir),
            "outputs": self.outputs,
            "metrics": self.metrics,
            "reason": self.reason,
            "changes": list(self.changes),
            "reused_from": self.reused_from,
            "attempt_id": self.attempt_id,
            "job_id": self.job_id,
            "cluster": self.cluster,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class PipelineContext:
    """One pipeline run in progress: shared by every :func:`execute_stage` call of that run.

    Thread-safe for stages running in different threads (Prefect's task runner).
    """

    pipeline: Pipeline
    configs: dict[str, dict[str, Any]]
    options: RunOptions
    hooks: PipelineHooks
    settings: Settings
    store: LineageStore
    pipeline_run: PipelineRun
    commit: Commit
    environment: Environment
    provenance: Provenance
    tree_hashes: dict[str, str]
    env_values: dict[str, str]
    recipe: ResolvedRecipe | None = None
    issue_id: str | None = None
    results: dict[str, StageResult] = field(default_factory=dict)
    #: stage -> stage run id of this pipeline run, so a retry adds an attempt to the same stage run.
    stage_runs: dict[str, str] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    owns_store: bool = False
    #: ``[pipeline] preemption_retries`` as read when the run started (:func:`execute_stage_resuming`).
    preemption_retries: int = DEFAULT_PREEMPTION_RETRIES
    #: stage -> the seconds of each of its jobs stopped and run again (:attr:`StageResult.stopped_seconds`).
    stopped_seconds: dict[str, list[float]] = field(default_factory=dict)
    #: The pipeline run's own lease (:func:`orchestrator.pipeline.reconcile.pipeline_lease_key`): its
    #: heartbeat says this process still looks after the run; released when the run is closed.
    lease: leases.HeldLease | None = None
    #: The image every job runs in (by digest where known) on container backends: then a stage's
    #: environment identity is the image, not this process's packages. None on local and Slurm.
    environment_image: str | None = None
    #: The same by backend, for the run's and each one a stage names for itself (``StageSpec.backend``).
    environment_images: dict[str, str | None] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.pipeline_run.id

    def backend_of(self, spec: StageSpec) -> str:
        """Where ``spec``'s job runs: the stage's own backend, else the run's."""
        return spec.backend or self.options.backend

    def image_of(self, spec: StageSpec) -> str | None:
        """The image ``spec``'s job runs in (None off containers): its environment identity."""
        return self.environment_images.get(self.backend_of(spec), self.environment_image)

    def emit(self, stage: str, state: str, **kw: Any) -> None:
        """Send a transition to the hook and, when an issue is linked, refresh its card."""
        event = StageTransition(pipeline_run_id=self.id, stage=stage, state=state, **kw)
        level = logging.WARNING if state in ("FAILED", "CANCELLED", "PREEMPTED") else logging.INFO
        transition_log.log(level, "%s", event.line())
        _call_hook(self.hooks.on_transition, event)
        if self.issue_id and state not in ("CHECKING",):
            publish_issue_card(self)


def _call_hook(fn: Callable[..., Any] | None, *args: Any) -> None:
    if fn is None:
        return
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a display must not kill a run
        log.exception("pipeline hook %s failed", getattr(fn, "__name__", fn))


def publish_issue_card(ctx: PipelineContext) -> None:
    """Refresh the run's lineage card on its experiment issue; never fails the pipeline."""
    try:
        from orchestrator.links.github import publish_card
    except ImportError:
        return
    try:
        publish_card(ctx.store, ctx.id, settings=ctx.settings)
    except Exception as exc:  # noqa: BLE001 - GitHub problems are recorded by the linker and queued
        log.warning("could not publish the lineage card for %s: %s", ctx.id, exc)


# -- environment fields --------------------------------------------------------------------------


def stage_environment(spec: StageSpec, image: str | None, values: Mapping[str, str]) -> dict[str, str]:
    """The environment part of a stage's identity: the job image where jobs run in one (its
    interpreter and packages are what the job sees), else the stage's declared fields of this host.
    One rule for the run and for its dry run, so `openlab explain` predicts what a run will do."""
    return {"image": image} if image else {f: values[f] for f in spec.environment_fields}


def image_code_record(launcher: Launcher, image: str | None, repo_root: Path) -> dict[str, Any] | None:
    """Where jobs run the code inside their image, check that it is this tree's code (else raise
    before anything is recorded) and return the finding for the run's lineage; None elsewhere.
    Shared by the run and its dry run, which must refuse alike."""
    if not launcher.runs_image_code():
        return None
    from orchestrator.provenance.image import check_image_code

    ref = launcher.image_ref(image) or ""
    mode = str(launcher.config.get("image_code_check", "require"))
    return check_image_code(launcher.name, ref, launcher.image_labels(image), repo_root, mode)


@dataclass(frozen=True)
class BackendEnvironment:
    """What a backend's jobs run in: the image (their environment identity on containers; None on
    local and Slurm) and the finding of :func:`image_code_record`."""

    image: str | None
    image_code: dict[str, Any] | None


def backend_environments(
    pipeline: Pipeline, backend: str, settings: Settings, **launcher_overrides: Any
) -> dict[str, BackendEnvironment]:
    """The run's ``backend`` first, then every other backend a stage names for itself: each one's
    launcher resolved and its image checked, so a missing image, a stopped engine or an image of
    other code is refused before anything is recorded. Shared by the run and its dry run."""
    from orchestrator.launchers import get_launcher

    others = sorted({s.backend for s in pipeline.stages if s.backend and s.backend != backend})
    out: dict[str, BackendEnvironment] = {}
    for name in (backend, *others):
        launcher = get_launcher(name, settings, **launcher_overrides)
        out[name] = BackendEnvironment(
            launcher.environment_image(pipeline.image), image_code_record(launcher, pipeline.image, pipeline.repo_root)
        )
    return out


def environment_values(provenance: Provenance, fields: Sequence[str]) -> dict[str, str]:
    """Values of declared environment fields: captured ones by name, ``pkg:NAME`` by version."""
    import importlib.metadata as md

    captured = provenance.environment.to_dict()
    out: dict[str, str] = {}
    for name in fields:
        if name.startswith("pkg:"):
            try:
                out[name] = md.version(name[4:])
            except md.PackageNotFoundError:
                out[name] = "absent"
        elif name in captured:
            value = captured[name]
            out[name] = json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else str(value)
        else:
            raise ConfigError(f"unknown environment field {name!r}; {choices(name, sorted(captured))} or pkg:NAME")
    return out


# -- starting and finishing a pipeline run ------------------------------------------------------


def start_pipeline(
    pipeline: Pipeline,
    configs: Mapping[str, Mapping[str, Any]],
    *,
    options: RunOptions | None = None,
    hooks: PipelineHooks | None = None,
    recipe: ResolvedRecipe | None = None,
    settings: Settings | None = None,
    store: LineageStore | None = None,
    reconcile_first: bool = True,
) -> PipelineContext:
    """Reconcile stale runs, capture provenance, record the pipeline run; return its context.

    The run holds a lease of its own from before its row exists until :func:`finish_pipeline`
    closes it, so a reconciler in another process can tell a run whose orchestrator is alive
    (live lease) from one whose orchestrator crashed (expired lease), even between stages.
    """
    options = options or RunOptions()
    hooks = hooks or PipelineHooks()
    settings = settings or load_settings()
    missing = [s for s in pipeline.order if s not in configs]
    if missing:
        raise ConfigError(f"pipeline {pipeline.name}: no config for stage(s) {', '.join(missing)}")
    pipeline.check_forced(options.force)
    if options.issue:
        from orchestrator.links.github import check_issue_option

        check_issue_option(options.issue, settings)
    from orchestrator.launchers.base import known_backend, launcher_class

    # `Slurm` is recorded as `slurm`, so `--backend slurm` filters find the run
    options = replace(options, backend=known_backend(options.backend))
    for spec in pipeline.stages:  # an unknown backend, or a stage of several tasks its backend cannot run: refused now
        why = launcher_class(spec.backend or options.backend).cannot_run(spec.nodes, spec.tasks_per_node)
        if why:
            raise ConfigError(f"stage {spec.name}: {why}")
    preemptions = preemption_retries(settings)
    owns = store is None
    store = store or LineageStore.open(settings)
    try:
        ctx = _open_pipeline_run(pipeline, configs, options, hooks, recipe, settings, store, owns, reconcile_first)
        ctx.preemption_retries = preemptions
        return ctx
    except BaseException:
        if owns:  # refused before the context took the store: do not leave its engine open
            store.close()
        raise


def _open_pipeline_run(
    pipeline: Pipeline,
    configs: Mapping[str, Mapping[str, Any]],
    options: RunOptions,
    hooks: PipelineHooks,
    recipe: ResolvedRecipe | None,
    settings: Settings,
    store: LineageStore,
    owns: bool,
    reconcile_first: bool,
) -> PipelineContext:
    """start_pipeline past its config checks: everything that needs the store."""
    from orchestrator.lineage.record import record_environment, record_git
    from orchestrator.pipeline.reconcile import pipeline_lease_key, reconcile_all
    from orchestrator.provenance import capture

    if reconcile_first:
        reconcile_all(store, settings=settings)
    # Resolved before anything is recorded: a missing image or a stopped engine is a clear
    # error now, not a failed stage later.
    envs = backend_environments(pipeline, options.backend, settings, **options.launcher_overrides)
    environment_image = envs[options.backend].image
    image_code = envs[options.backend].image_code
    image_code_by_backend = {
        b: e.image_code for b, e in envs.items() if b != options.backend and e.image_code is not None
    }
    github_required = False
    if options.issue:  # a bad [github] setting is refused before the run is recorded, not as its failure
        from orchestrator.links.github import GithubConfig

        github_required = GithubConfig.from_settings(settings).required
    prov = capture(pipeline.repo_root, pipeline.code_paths(), settings=settings)
    tree_hashes = pipeline.code_tree(prov.git.tree_hashes, prov.git.reason)  # refused before anything is recorded
    all_env_fields = sorted({f for s in pipeline.stages for f in s.environment_fields})
    env_values = environment_values(prov, all_env_fields)
    params: dict[str, Any] = {
        **options.params,
        "pipeline": pipeline.name,
        "force": sorted(options.force) if not isinstance(options.force, bool) else options.force,
        "issue": options.issue,
        "repo_root": str(pipeline.repo_root),
    }
    if options.issue and options.issue_required:  # what a rerun asks again (`openlab rerun`)
        params["issue_required"] = True
    if image_code is not None:
        params["image_code"] = image_code
    if image_code_by_backend:
        params["image_code_by_backend"] = image_code_by_backend
    stage_backends = {s.name: s.backend for s in pipeline.stages if s.backend and s.backend != options.backend}
    if stage_backends:
        params["stage_backends"] = stage_backends
    if recipe is not None:
        params["recipe"] = recipe.lineage()
    retried = _retried_run(store, options.flow_run_id)
    if retried is None and options.retry_of:
        retried = store.require(PipelineRun, options.retry_of)
    if retried is not None:
        params["retry_of"] = retried.id
    run_id = new_id(PipelineRun.id_prefix)
    lease = leases.try_hold(
        store,
        pipeline_lease_key(run_id),
        leases.new_holder(run_id),
        ttl=options.lease_ttl,
        heartbeat_interval=options.heartbeat_interval,
    )
    try:
        with store.transaction() as tx:
            commit = record_git(tx, prov.git)
            environment = record_environment(tx, prov.environment)
            run = tx.add(
                PipelineRun(
                    id=run_id,
                    name=recipe.name if recipe is not None else pipeline.name,
                    recipe=recipe.recipe.name if recipe is not None else None,
                    replica=recipe.replica if recipe is not None else None,
                    backend=options.backend,
                    trigger=options.trigger,
                    user=current_user(),
                    command=options.command,
                    flow_run_id=options.flow_run_id,
                    params=params,
                    state="RUNNING",
                )
            )
            tx.relate("wasAssociatedWith", run, commit, role="code")
            tx.relate("wasAssociatedWith", run, environment, role="environment")
            if retried is not None:
                tx.relate("wasInformedBy", run, retried, role="retry-of")
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    ctx = PipelineContext(
        pipeline=pipeline,
        configs={k: dict(v) for k, v in configs.items()},
        options=options,
        hooks=hooks,
        settings=settings,
        store=store,
        pipeline_run=run,
        commit=commit,
        environment=environment,
        provenance=prov,
        tree_hashes=tree_hashes,
        env_values=env_values,
        recipe=recipe,
        owns_store=owns,
        lease=lease,
        environment_image=environment_image,
        environment_images={b: e.image for b, e in envs.items()},
    )
    if options.issue:
        from orchestrator.links.github import resolve_issue

        try:
            required = options.issue_required or github_required
            issue = resolve_issue(store, options.issue, run, required=required, settings=settings)
        except BaseException as exc:  # a required issue that cannot be linked: close the run, do not strand it
            finish_pipeline(ctx, "FAILED", f"{type(exc).__name__}: {exc}")
            raise
        ctx.issue_id = issue.id
        publish_issue_card(ctx)
    log.info("pipeline run %s started (%s, backend %s)", run.id, run.name, options.backend)
    return ctx


def _retried_run(store: LineageStore, flow_run_id: str | None) -> PipelineRun | None:
    """The pipeline run an earlier execution of the same Prefect flow run made, if any.

    Prefect retries a flow run in place (the UI's *Retry* on a failed run, a flow's own
    ``retries``): the same flow run id executes again and starts a new pipeline run. Linking the
    two (``params.retry_of`` and ``wasInformedBy``, role ``retry-of``) keeps the recovery from
    reading as a new, unrelated run; what the retry reuses (completed stages) and resumes (a
    training stage's checkpoint, by identity) follows from the stage identities as always.
    """
    if not flow_run_id:
        return None
    earlier = store.list(PipelineRun, flow_run_id=flow_run_id, order_by=col(PipelineRun.started_at).desc(), limit=1)
    return earlier[0] if earlier else None


def pipeline_state(ctx: PipelineContext) -> str:
    """COMPLETED when every stage completed or was reused, else FAILED / CANCELLED."""
    states = [ctx.results[s].state if s in ctx.results else None for s in ctx.pipeline.order]
    if any(s == "CANCELLED" for s in states):
        return "CANCELLED"
    if any(s in ("FAILED", "PREEMPTED") for s in states) or any(s is None for s in states):
        return "FAILED"
    return "COMPLETED"


def finish_pipeline(ctx: PipelineContext, state: str | None = None, error: str | None = None) -> PipelineRun:
    """Close the pipeline run (COMPLETED / FAILED / CANCELLED), give up its lease, refresh its card.

    The state is written before the lease is released, so a reconciler never sees this run
    RUNNING without a live lease while this process still looks after it.
    """
    final = state or pipeline_state(ctx)
    try:
        with ctx.store.transaction() as tx:
            ctx.pipeline_run = tx.update(ctx.pipeline_run, state=final, ended_at=utcnow(), error=error)
        if ctx.recipe is not None and ctx.recipe.preregistered:
            from orchestrator.preregistration import record_preregistration

            for check in record_preregistration(ctx.store, ctx.id, ctx.recipe.preregistered):
                log.info("pre-registered %s", check.line())
            ctx.pipeline_run = ctx.store.require(PipelineRun, ctx.id)
    finally:
        if ctx.lease is not None:
            ctx.lease.release()
            ctx.lease = None
    log.info("pipeline run %s %s", ctx.id, final)
    if ctx.issue_id:
        publish_issue_card(ctx)
    if ctx.owns_store:
        ctx.store.close()
    return ctx.pipeline_run


# -- identity and reuse --------------------------------------------------------------------------


def upstream_results(
    ctx: PipelineContext, spec: StageSpec, given: Mapping[str, StageResult] | None
) -> dict[str, StageResult]:
    """The results ``spec`` reads, by input name: a stage's identity is computed from its inputs'
    content, so an input that has not completed is an error here, not a missing hash later."""
    out: dict[str, StageResult] = {}
    for key, stage in spec.inputs.items():
        result = (given or {}).get(stage) or ctx.results.get(stage)
        if result is None or not result.ok:
            raise ConfigError(f"stage {spec.name}: input {key} needs stage {stage} to have completed first")
        out[key] = result
    return out


def stage_identity(ctx: PipelineContext, spec: StageSpec, upstream: Mapping[str, StageResult]) -> StageIdentity:
    """The stage's identity from its config, inputs' content, code tree hashes and environment."""
    return compute_identity(
        spec.name,
        identity_config(ctx.configs[spec.name], spec.tasks),
        inputs={key: str(res.input_hash) for key, res in upstream.items()},
        code={p: ctx.tree_hashes[p] for p in spec.code_paths},
        environment=stage_environment(spec, ctx.image_of(spec), ctx.env_values),
    )


def would_reuse(ctx: PipelineContext, stage: str) -> bool:
    """Whether :func:`execute_stage` would reuse ``stage`` were it called now.

    A look without the identity's lease, for callers that prepare differently for a stage that
    will launch a job (the flows give only such a stage the tags Prefect's concurrency limits
    count): :func:`execute_stage` decides again under the lease, so it is a forecast, right
    unless a concurrent run or gc changes the identity's record in between.
    """
    spec = ctx.pipeline.stage(stage)
    if ctx.options.forced(spec.name):
        return False
    identity = stage_identity(ctx, spec, upstream_results(ctx, spec, None))
    return find_reusable(ctx.store, identity.digest, ctx.settings)[0] is not None


def changes_since_last(ctx: PipelineContext, stage: str, identity: StageIdentity) -> tuple[list[str], str]:
    """Identity fields changed since the last completed run of ``stage``, and a one-line reason.

    A stage run again with the same identity (forced, or its outputs no longer verify) changed
    nothing: compared with the closest run of another identity it would list that run's
    differences, as if they were why it ran."""
    same = latest_completed(ctx.store, identity.digest)
    if same is not None:
        return [], unchanged_since(identity.digest, same)
    previous = closest_completed(
        ctx.store,
        stage,
        identity.fields(),
        exclude_identity=identity.digest,
        recipe=ctx.pipeline_run.recipe,
        replica=ctx.pipeline_run.replica,
    )
    if previous is None:
        return [], "no earlier completed run of this stage"
    changes = describe_changes(diff_identities(previous.identity_fields, identity.fields()))
    return changes, f"changed since {previous.id}: " + "; ".join(changes[:6]) + (" ..." if len(changes) > 6 else "")


def _record_reuse(
    ctx: PipelineContext, spec: StageSpec, identity: StageIdentity, original: StageRun, reason: str, started: float
) -> StageResult:
    now = utcnow()
    with ctx.store.transaction() as tx:
        run = tx.add(
            StageRun(
                id=new_id(StageRun.id_prefix),
                pipeline_run_id=ctx.id,
                stage=spec.name,
                identity=identity.digest,
                identity_fields=identity.fields(),
                state="REUSED",
                reused_from=original.id,
                outputs=dict(original.outputs),
                metrics=dict(original.metrics),
                started_at=now,
                ended_at=now,
            )
        )
        # One edge: the reused run points at the run that produced the outputs (whose own
        # edges say which code, environment and inputs made them). Kept minimal: reuse must stay cheap.
        tx.relate("wasInformedBy", run, original, role="reused")
    return conclude_stage(
        ctx,
        spec,
        identity,
        run.id,
        "REUSED",
        reason,
        started,
        out_dir=output_dir(ctx.settings, spec.name, identity.digest),
        outputs=dict(original.outputs),
        metrics=dict(original.metrics),
        reused_from=original.id,
    )


def conclude_stage(
    ctx: PipelineContext,
    spec: StageSpec,
    identity: StageIdentity,
    stage_run_id: str,
    state: str,
    reason: str,
    started: float,
    *,
    out_dir: Path,
    changes: Sequence[str] = (),
    outputs: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    reused_from: str | None = None,
    attempt: Any = None,
    stopped_by: str | None = None,
    progress_saved: bool = False,
) -> StageResult:
    """The one way a stage ends in this pipeline run: build its result, keep it, announce it.

    Every ending (reused, completed, failed, cancelled) must leave the same trace — a result
    in ``ctx.results`` that downstream stages and :func:`pipeline_state` read, and one
    transition for the hooks — so it is written once. A stage that did not complete keeps
    its stage run id in ``ctx.stage_runs``: a retry then adds an attempt to the same run.
    """
    result = StageResult(
        stage=spec.name,
        state=state,
        stage_run_id=stage_run_id,
        identity=identity.digest,
        identity_fields=identity.fields(),
        out_dir=out_dir,
        outputs=dict(outputs or {}),
        metrics=dict(metrics or {}),
        reason=reason,
        changes=list(changes),
        reused_from=reused_from,
        attempt_id=getattr(attempt, "id", None),
        job_id=getattr(attempt, "job_id", None),
        cluster=getattr(attempt, "cluster", None),
        exit_code=getattr(attempt, "exit_code", None),
        seconds=time.monotonic() - started,
        stopped_seconds=tuple(ctx.stopped_seconds.get(spec.name, ())),
        stopped_by=stopped_by,
        progress_saved=progress_saved,
    )
    with ctx.lock:
        ctx.results[spec.name] = result
        if result.ok:
            ctx.stage_runs.pop(spec.name, None)
    ctx.emit(spec.name, state, identity=identity.digest, stage_run_id=stage_run_id, reason=reason, result=result)
    return result


# -- running a stage --------------------------------------------------------------------------------


def _cancel_requested(ctx: PipelineContext, extra: Callable[[], bool | str] | None) -> str | None:
    """Why a ``should_cancel`` hook asks to cancel (the text it returned, else "cancel requested"),
    or None while none does."""
    for fn in (extra, ctx.hooks.should_cancel):
        if fn is not None:
            try:
                asked = fn()
            except Exception:  # noqa: BLE001
                log.exception("should_cancel hook failed")
                continue
            if asked:
                return asked if isinstance(asked, str) else "cancel requested"
    return None


def _write_config(
    ctx: PipelineContext, spec: StageSpec, identity: str, upstream: Mapping[str, StageResult], stage_run: StageRun
) -> tuple[Path, bool]:
    """Write the job's config (inputs resolved to folders, W&B section if the stage tracks); return (path, uses W&B).

    The flag tells the caller whether to read a W&B run back after the job: only when the
    stage declared that it tracks *and* a project is configured can a missing run be a failure.
    """
    config = dict(ctx.configs[spec.name])
    if upstream:
        config["inputs"] = {key: str(res.output.get("path") or res.out_dir) for key, res in upstream.items()}
    wandb = _wandb_section(ctx, spec, identity, stage_run) if spec.tracks_wandb else None
    if wandb:
        config["wandb"] = wandb
    path = output_dir(ctx.settings, spec.name, identity).with_suffix(".config.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{stage_run.id}.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True))
    tmp.replace(path)
    return path, bool(wandb)


def _completed_before(ctx: PipelineContext, stage: str, identity: str, stage_run_id: str) -> bool:
    """Whether another stage run of this stage and identity completed: this one re-does it."""
    runs = ctx.store.list(StageRun, stage=stage, identity=identity, state="COMPLETED")
    return any(r.id != stage_run_id for r in runs)


def _keep_unsynced_wandb(ctx: PipelineContext, out_dir: Path) -> None:
    """Before a forced re-run deletes ``out_dir``: its offline W&B runs never uploaded go to
    ``$OPENLAB_HOME/wandb-unsynced`` (their records follow), where ``openlab wandb sync`` finds them."""
    try:
        from orchestrator.links.wandb import keep_unsynced
    except ImportError:
        return
    try:
        kept = keep_unsynced(ctx.store, out_dir, ctx.settings.home / "wandb-unsynced")
    except Exception as exc:  # noqa: BLE001 - the re-run goes on; what could not be kept is said
        log.warning("could not keep the W&B runs in %s before the forced re-run deletes it: %s", out_dir, exc)
        return
    if kept:
        log.warning("kept %d W&B run(s) not yet uploaded in %s (wandb sync uploads them)", len(kept), kept[0].parent)


def _wandb_section(ctx: PipelineContext, spec: StageSpec, identity: str, stage_run: StageRun) -> dict[str, Any] | None:
    """The ``wandb:`` section of the stage config (links layer); None when no W&B project is configured.

    The run id derives from the stage identity, so a retried or resumed attempt continues the same W&B run.
    """
    try:
        from orchestrator.links import wandb as links_wandb
    except ImportError:
        return None
    recipe_wandb = ctx.recipe.wandb if ctx.recipe is not None else {}
    project = recipe_wandb.get("project") or ctx.settings.section("wandb").get("project")
    if not project:
        return None
    issue_number = None
    if ctx.issue_id and "#" in ctx.issue_id:
        try:
            issue_number = int(ctx.issue_id.rsplit("#", 1)[1])
        except ValueError:
            issue_number = None
    data = ctx.results.get("data")
    from orchestrator.lineage.verify import anchor_of
    from orchestrator.recipes import set_words

    anchor = anchor_of(ctx.store, ctx.id)  # the run's start, published with its W&B runs too
    try:
        return links_wandb.stage_wandb_settings(
            identity,
            pipeline_run_id=ctx.id,
            stage=spec.name,
            project=project,
            entity=recipe_wandb.get("entity"),
            commit_sha=ctx.commit.sha,
            issue_number=issue_number,
            snapshot_id=data.output.get("snapshot_id") if data is not None else None,
            backend=ctx.backend_of(spec),
            replica=ctx.pipeline_run.replica,
            trigger=ctx.pipeline_run.trigger,
            sweep=ctx.pipeline_run.sweep.get("id"),
            redo_of=stage_run.id if _completed_before(ctx, spec.name, identity, stage_run.id) else None,
            lineage_ids={
                "stage_run_id": stage_run.id,
                "user": ctx.pipeline_run.user,  # the account that started the run (W&B's own user is the key's)
                "commit": ctx.commit.id,
                "environment": ctx.environment.id,
                "issue": ctx.issue_id,
                "lineage_anchor": str(anchor) if anchor is not None else None,
                # the values this run set over its recipe (`run --set`): the experiment, in W&B's run overview
                # (a value that is a secret's, masked: W&B's servers are no place for it, as lineage is not)
                "run_set": [scrub(w) for w in set_words(ctx.recipe.run_set)]
                if ctx.recipe is not None and ctx.recipe.run_set
                else None,
            },
            settings=ctx.settings,
        )
    except Exception as exc:  # noqa: BLE001 - W&B is optional: the stage runs without it
        log.warning("no W&B settings for %s: %s", spec.name, exc)
        return None


def _record_wandb(ctx: PipelineContext, stage_run: StageRun, out_dir: Path) -> None:
    """Link the stage run to the W&B run its job logged to (and how that run ended); also for a
    failed or preempted stage, whose curves up to the failure are what a person debugs with."""
    try:
        from orchestrator.links import wandb as links_wandb
    except ImportError:
        return
    try:
        links_wandb.record_wandb_run(ctx.store, stage_run, out_dir, job_ended=True)
    except Exception as exc:  # noqa: BLE001 - optional link
        log.warning("could not record the W&B run of %s: %s", stage_run.stage, exc)


def execute_stage(
    ctx: PipelineContext,
    stage: str | StageSpec,
    *,
    upstream: Mapping[str, StageResult] | None = None,
    should_cancel: Callable[[], bool | str] | None = None,
) -> StageResult:
    """Reuse or run one stage of ``ctx``'s pipeline; see the module docstring.

    ``upstream`` (stage name -> result) overrides results kept in ``ctx`` (for flows that
    pass results between tasks). Raises :class:`StageFailed` / :class:`StageCancelled`
    when the stage does not complete; calling again for the same stage in the same
    pipeline run (a Prefect retry) adds an attempt to the same stage run.
    """
    started = time.monotonic()
    spec = stage if isinstance(stage, StageSpec) else ctx.pipeline.stage(stage)
    inputs = upstream_results(ctx, spec, upstream)
    identity = stage_identity(ctx, spec, inputs)
    digest = identity.digest
    ctx.emit(spec.name, "CHECKING", identity=digest)
    forced = ctx.options.forced(spec.name)
    original: StageRun | None = None
    why = ""
    if not forced:  # verified before the lease: re-hashing outputs is the slow part, and most stages are reused
        original, why = find_reusable(ctx.store, digest, ctx.settings, deep=ctx.options.deep_verify)
    with ctx.lock:
        stage_run_id = ctx.stage_runs.get(spec.name) or new_id(StageRun.id_prefix)
        ctx.stage_runs[spec.name] = stage_run_id
    holder = leases.new_holder(ctx.id)
    held: leases.HeldLease | None = None
    waited_since: float | None = None
    while held is None:
        asked = _cancel_requested(ctx, should_cancel)  # (not `why`: that is why the stage is not reused)
        if asked:
            raise StageCancelled(f"stage {spec.name}: cancelled while waiting for its lease: {asked}")
        held = leases.try_hold(
            ctx.store,
            digest,
            holder,
            ttl=ctx.options.lease_ttl,
            heartbeat_interval=ctx.options.heartbeat_interval,
            stage_run_id=stage_run_id,
        )
        if held is not None:
            break
        if waited_since is None:
            waited_since = time.monotonic()
            other = leases.current(ctx.store, digest)
            who = other.holder if other is not None else "another run"
            ctx.emit(spec.name, "WAITING", identity=digest, reason=f"identity {digest[:16]} is being run by {who}")
        elif ctx.options.wait_timeout is not None and time.monotonic() - waited_since > ctx.options.wait_timeout:
            raise StageFailed(
                f"stage {spec.name}: gave up after {ctx.options.wait_timeout:g}s waiting for identity "
                f"{digest[:16]}, held by another run"
            )
        time.sleep(ctx.options.wait_poll)
    try:
        # Under the lease nobody else writes this identity's folder and gc cannot delete it, so the
        # reuse is decided and recorded here, before the lease goes.
        look_again = waited_since is not None  # the holder we waited for may have completed it (even forced)
        if original is not None and not still_reusable(ctx.store, digest, original):
            original, look_again = None, True  # gc removed it, or a forced re-run replaced it, meanwhile
        if original is None and look_again:
            original, why = find_reusable(ctx.store, digest, ctx.settings, deep=ctx.options.deep_verify)
        if original is not None:
            reason = f"waited, then {why}" if waited_since is not None else why
            return _record_reuse(ctx, spec, identity, original, reason, started)
        return _run_stage(ctx, spec, identity, inputs, stage_run_id, held, should_cancel, forced, started, why)
    finally:
        held.release()


def _run_stage(
    ctx: PipelineContext,
    spec: StageSpec,
    identity: StageIdentity,
    inputs: Mapping[str, StageResult],
    stage_run_id: str,
    held: leases.HeldLease,
    should_cancel: Callable[[], bool | str] | None,
    forced: bool,
    started: float,
    not_reused: str = "",
) -> StageResult:
    from orchestrator.launchers.attempts import interruption_reason, run_job
    from orchestrator.launchers.base import JobSpec, JobState, get_launcher

    digest = identity.digest
    out_dir = output_dir(ctx.settings, spec.name, digest)
    changes, why = changes_since_last(ctx, spec.name, identity)
    if not_reused.startswith(NO_LONGER_VERIFY):  # the same identity completed, but its outputs are gone or changed
        why = not_reused
    if forced:
        why = f"forced; {why}"
    existing = ctx.store.get(StageRun, stage_run_id)
    # What earlier completed runs recorded in this folder is about to be deleted (forced) or
    # written over (its bytes no longer verified): say so on their records, in the transaction
    # that starts this run. A retry's folder is its own stage run's leftovers, nothing recorded.
    replaced = live_records_at(ctx.store, out_dir) if existing is None else []
    with ctx.store.transaction() as tx:
        if replaced:
            how = "forced re-run" if forced else "re-run, the recorded outputs no longer verifying,"
            replaced_why = f"replaced by a {how} of the same identity: stage run {stage_run_id} of {ctx.id}"
            mark_removed(tx, replaced, utcnow(), replaced_why)
        if existing is not None:  # a retry within the same pipeline run: same stage run, new attempt
            run = tx.update(
                existing, state="RUNNING", error=None, ended_at=None, identity=digest, identity_fields=identity.fields()
            )
        else:
            run = tx.add(
                StageRun(
                    id=stage_run_id,
                    pipeline_run_id=ctx.id,
                    stage=spec.name,
                    identity=digest,
                    identity_fields=identity.fields(),
                    state="RUNNING",
                )
            )
        tx.relate("wasAssociatedWith", run, ctx.commit, role="code")
        tx.relate("wasAssociatedWith", run, ctx.environment, role="environment")
        for key, res in inputs.items():
            art_id = res.output.get("artifact_id")
            art = tx.get(Artifact, art_id) if art_id else None
            if art is not None:
                tx.relate("used", run, art, role=key)
            snap_id = res.output.get("snapshot_id")
            if snap_id:
                from orchestrator.lineage.models import DataSnapshot

                snap = tx.get(DataSnapshot, snap_id)
                if snap is not None:
                    tx.relate("used", run, snap, role=key)
    ctx.emit(spec.name, "RUNNING", identity=digest, stage_run_id=run.id, reason=why)

    # Forced, or a completed run's recorded outputs here no longer verify (changed from outside openlab):
    # start from an empty folder. Left in place, a training stage found its (edited) final checkpoint,
    # "resumed" at the last step, trained nothing and recorded the tampered weights as a fresh result.
    # What a failed run left where openlab had replaced or removed the outputs stays: it goes on from it.
    if (forced or replaced) and out_dir.exists() and existing is None:
        _keep_unsynced_wandb(ctx, out_dir)
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path, uses_wandb = _write_config(ctx, spec, digest, inputs, run)
    backend = ctx.backend_of(spec)
    job = JobSpec(
        name=f"openlab-{spec.name}-{digest[:12]}",
        command=spec.render_command(
            python=default_python(backend, ctx.settings, in_image=ctx.image_of(spec) is not None),
            config=config_path,
            out=out_dir,
        ),
        image=ctx.pipeline.image,
        env={
            "OPENLAB_STAGE": spec.name,
            "OPENLAB_STAGE_RUN": run.id,
            "OPENLAB_PIPELINE_RUN": ctx.id,
            "OPENLAB_IDENTITY": digest,
        },
        workdir=str(ctx.pipeline.repo_root),
        artifact_root=ctx.settings.artifacts_dir,
        cpus=spec.cpus,
        memory=spec.memory,
        gpus=spec.gpus,
        time_limit=spec.time_limit,
        warn_before_limit=warn_before_limit(spec),
        nodes=spec.nodes,
        tasks_per_node=spec.tasks_per_node,
        options=dict(spec.backend_options.get(backend) or {}),
        labels={
            "openlab.io/stage": spec.name,
            "openlab.io/stage-run": run.id,
            "openlab.io/pipeline-run": ctx.id,
            "openlab.io/identity": digest[:32],
        },
    )
    launcher = get_launcher(backend, ctx.settings, **ctx.options.launcher_overrides)
    saved_before = checkpoint_mark(out_dir, spec)
    cancel_reason: list[str] = []

    def cancel() -> bool:
        if held.should_cancel():
            cancel_reason[:] = [held.lost_reason or "lease lost"]
            return True
        asked = _cancel_requested(ctx, should_cancel)
        if asked:
            cancel_reason[:] = [asked]
            return True
        return False

    def on_log(line: str) -> None:
        _call_hook(ctx.hooks.on_log, spec.name, line)
        if ctx.hooks.on_progress is not None:
            match = _PROGRESS.search(line)
            if match:
                _call_hook(ctx.hooks.on_progress, spec.name, int(match.group(1)), int(match.group(2)))

    attempt = None
    try:
        attempt, status = run_job(
            ctx.store,
            launcher,
            job,
            stage_run_id=run.id,
            on_log=on_log if (ctx.hooks.on_log or ctx.hooks.on_progress) else None,
            timeout=ctx.options.job_timeout,
            should_cancel=cancel,
            poll=ctx.options.poll,
        )
    except BaseException as exc:
        # run_job already cancelled the job and closed the attempt; close the stage run the same way
        stopped = interruption_reason(exc)
        state = "CANCELLED" if stopped else "FAILED"
        reason = stopped or f"{type(exc).__name__}: {exc}"
        result = _finish_failed(ctx, spec, run, identity, out_dir, state, reason, None, started, changes)
        if isinstance(exc, OpenlabError) and not isinstance(exc, StageFailed):
            raise StageFailed(f"stage {spec.name}: {reason}", result) from exc
        raise

    if status.state is JobState.SUCCEEDED and not cancel_reason:
        try:
            return _finish_completed(
                ctx, spec, run, identity, inputs, out_dir, attempt, started, changes, why, uses_wandb=uses_wandb
            )
        except BaseException as exc:  # the stage run must not stay RUNNING, whatever stops us
            stopped = interruption_reason(exc)
            if stopped:
                reason = f"{stopped} while recording the outputs of job {attempt.job_id}"
            else:
                reason = f"job succeeded but its outputs could not be recorded: {type(exc).__name__}: {exc}"
            state = "CANCELLED" if stopped else "FAILED"
            result = _finish_failed(ctx, spec, run, identity, out_dir, state, reason, attempt, started, changes)
            if stopped:
                raise
            raise StageFailed(f"stage {spec.name} failed: {reason}", result) from exc
    if status.state is JobState.CANCELLED or cancel_reason:
        reason = cancel_reason[0] if cancel_reason else (status.reason or "job cancelled")
        result = _finish_failed(ctx, spec, run, identity, out_dir, "CANCELLED", reason, attempt, started, changes)
        raise StageCancelled(f"stage {spec.name} cancelled: {reason}", result)
    # Stopped from outside, or by its time limit after saving its checkpoint anew: run again from it.
    preempted = status.state is JobState.PREEMPTED
    saved_after = checkpoint_mark(out_dir, spec)
    if preempted or stopped_with_progress(status, saved_before, saved_after):
        progress = saved_after is not None and saved_after != saved_before  # the next attempt goes on from it
        if progress:
            _record_progress_saved(ctx, attempt.id)
        how = f"preempted: {status.reason}" if preempted else f"{status.reason} after saving {spec.checkpoint} anew"
        reason = f"job {attempt.job_id} {how}" + ("" if preempted else ": going on from it")
        result = _finish_failed(
            ctx,
            spec,
            run,
            identity,
            out_dir,
            "PREEMPTED",
            reason,
            attempt,
            started,
            changes,
            stopped_by="preemption" if preempted else "time-limit",
            progress_saved=progress,
        )
        raise StagePreempted(f"stage {spec.name} {reason}", result)
    reason = f"job {attempt.job_id} {status.state}" + (
        f" (exit {status.exit_code})" if status.exit_code is not None else ""
    )
    if status.reason:
        reason += f": {status.reason}"
    if attempt.log_path:
        reason += f"; log: {attempt.log_path}"
    result = _finish_failed(ctx, spec, run, identity, out_dir, "FAILED", reason, attempt, started, changes)
    raise StageFailed(f"stage {spec.name} failed: {reason}", result)


def _record_progress_saved(ctx: PipelineContext, attempt_id: str) -> None:
    """Mark a stopped job that saved its checkpoint anew (:attr:`Attempt.progress_saved`): the
    hours it ran are not lost, whatever ended it."""
    try:
        with ctx.store.transaction() as tx:
            attempt = tx.get(Attempt, attempt_id)
            if attempt is not None:
                tx.update(attempt, progress_saved=True)
    except Exception:  # noqa: BLE001 - the stop matters more than its accounting
        log.exception("could not record that attempt %s saved its progress", attempt_id)


def _finish_failed(
    ctx: PipelineContext,
    spec: StageSpec,
    run: StageRun,
    identity: StageIdentity,
    out_dir: Path,
    state: str,
    reason: str,
    attempt: Any,
    started: float,
    changes: list[str],
    *,
    stopped_by: str | None = None,
    progress_saved: bool = False,
) -> StageResult:
    try:
        with ctx.store.transaction() as tx:
            run = tx.update(run, state=state, error=reason, ended_at=utcnow())
    except Exception:  # noqa: BLE001 - the original failure matters more
        log.exception("could not record the end of stage run %s", run.id)
    if attempt is not None and (out_dir / "wandb").is_dir():  # its job logged to W&B before it ended
        _record_wandb(ctx, run, out_dir)
    return conclude_stage(
        ctx,
        spec,
        identity,
        run.id,
        state,
        reason,
        started,
        out_dir=out_dir,
        changes=changes,
        attempt=attempt,
        stopped_by=stopped_by,
        progress_saved=progress_saved,
    )


def _finish_completed(
    ctx: PipelineContext,
    spec: StageSpec,
    run: StageRun,
    identity: StageIdentity,
    inputs: Mapping[str, StageResult],
    out_dir: Path,
    attempt: Any,
    started: float,
    changes: list[str],
    why: str,
    *,
    uses_wandb: bool = False,
) -> StageResult:

    hashed = hash_output(out_dir, ctx.settings, spec.volatile)
    snap = hashed.pop("_snapshot")
    metrics = read_metrics(out_dir)
    with ctx.store.transaction() as tx:
        outputs = record_outputs(tx, spec, run, out_dir, hashed, snap)
        run = tx.update(run, state="COMPLETED", outputs=outputs, metrics=metrics, error=None, ended_at=utcnow())
    if uses_wandb:
        _record_wandb(ctx, run, out_dir)
    return conclude_stage(
        ctx,
        spec,
        identity,
        run.id,
        "COMPLETED",
        why,
        started,
        out_dir=out_dir,
        changes=changes,
        outputs=outputs,
        metrics=metrics,
        attempt=attempt,
    )


# -- whole pipelines ----------------------------------------------------------------------------------


@dataclass
class PipelineResult:
    """The outcome of :func:`run_pipeline`."""

    pipeline_run: PipelineRun
    results: dict[str, StageResult]
    state: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"

    def to_dict(self) -> dict[str, Any]:
        run = self.pipeline_run
        return {
            "pipeline_run_id": run.id,
            "name": run.name,
            "recipe": run.recipe,
            "replica": run.replica,
            "backend": run.backend,
            "state": self.state,
            "error": self.error,
            "stages": [r.to_dict() for r in self.results.values()],
        }


def _whole_number(settings: Settings | None, key: str, default: int) -> int:
    raw = (settings or load_settings()).section("pipeline").get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, int | str) or not str(raw).strip().isdigit():
        raise ConfigError(f"invalid [pipeline] {key} {raw!r}: use a whole number, 0 or more (e.g. {default})")
    return int(raw)


def stage_retries(settings: Settings | None = None) -> int:
    """How many times a failed stage is retried: ``[pipeline] stage_retries`` (an int, 0 or more)."""
    return _whole_number(settings, "stage_retries", DEFAULT_STAGE_RETRIES)


def preemption_retries(settings: Settings | None = None) -> int:
    """How many times a preempted stage is run again: ``[pipeline] preemption_retries`` (0 or more)."""
    return _whole_number(settings, "preemption_retries", DEFAULT_PREEMPTION_RETRIES)


def execute_stage_resuming(ctx: PipelineContext, name: str) -> StageResult:
    """:func:`execute_stage`, run again each time its job is preempted, or stopped by its own time
    limit after saving its checkpoint anew. Each run is a new attempt of the same stage run; the
    attempt that was stopped is recorded PREEMPTED (a time-limited one FAILED, with its reason) and
    a training stage resumes from the checkpoint it wrote when it was signalled.

    ``[pipeline] preemption_retries`` (read when the pipeline started) bounds the stops *in a row
    that saved nothing*: a job preempted every time before it can save, or that dies by SIGTERM on
    its own, would otherwise run for ever. A stop after which the checkpoint was saved anew starts
    the count afresh, so a training longer than a cluster's wall-time cap runs as a chain of as many
    jobs as it needs, as a Slurm user's chain of dependent jobs does. Failures and cancellations
    pass through: retrying those is the caller's (``stage_retries``, Prefect's)."""
    limit = ctx.preemption_retries
    in_a_row = 0  # stops since the checkpoint was last saved anew
    while True:
        try:
            return execute_stage(ctx, name)
        except StagePreempted as exc:  # announced PREEMPTED; the next attempt resumes
            if exc.result is not None:
                with ctx.lock:
                    ctx.stopped_seconds.setdefault(name, []).append(exc.result.seconds)
            if exc.result is not None and exc.result.progress_saved:
                in_a_row = 0
                transition_log.info("%s: going on from its checkpoint after: %s", name, exc)
                continue
            in_a_row += 1
            if in_a_row > limit:
                times = f"{in_a_row} time{'s' if in_a_row > 1 else ''}"
                message = (
                    f"{exc}; stopped {times} in a row without saving progress, "
                    f"the limit ([pipeline] preemption_retries = {limit})"
                )
                result = _give_up_preempted(ctx, name, exc.result, message)
                stage_run_id = result.stage_run_id if result else None
                ctx.emit(name, "FAILED", stage_run_id=stage_run_id, reason=message, result=result)
                raise StagePreempted(message, result) from exc
            transition_log.info("%s: resuming (%d of %d) after: %s", name, in_a_row, limit, exc)


def _give_up_preempted(ctx: PipelineContext, name: str, result: StageResult | None, message: str) -> StageResult | None:
    """Close a stage run left PREEMPTED as FAILED: nothing will run it again in this pipeline run."""
    if result is None:
        return None
    try:
        with ctx.store.transaction() as tx:
            run = tx.get(StageRun, result.stage_run_id)
            if run is not None and run.state == "PREEMPTED":
                tx.update(run, state="FAILED", error=message)
    except Exception:  # noqa: BLE001 - the preemption is what matters; the row says PREEMPTED
        log.exception("could not record the end of stage run %s", result.stage_run_id)
    failed = replace(result, state="FAILED", reason=message)
    with ctx.lock:
        ctx.results[name] = failed
    return failed


#: The exit code with which openlab's workloads refuse their input before any compute
#: (``workloads/moe/__main__.py``: a ``WorkloadError`` is printed as one line and the job exits 2).
CONFIG_REFUSED_EXIT_CODE = 2
#: The line such a workload prints for a config it refuses (``error: config: model.context=128 is
#: longer than the data ...``), as :func:`orchestrator.launchers.attempts.error_line` puts it in the reason.
_CONFIG_REFUSED = re.compile(r"(?:^|[\s:])(error: config: .*?)(?:; log: .*)?$")


def why_not_retried(exc: BaseException) -> str | None:
    """The line that says why a stage that ended with ``exc`` is not retried, or None when a retry
    may end otherwise (a transient failure, a node that died, a job stopped too often in a row).

    The one decision behind both retry loops, ``openlab run --retries`` (:func:`run_stages`) and the
    flows' Prefect task retries, so a stage is retried the same from a terminal and from the UI. Not
    retried: a cancelled stage (by request, or its lease was taken over), and a job that refused its
    own config (the workload's ``error: config: ...`` line and exit code 2): a new attempt runs the
    same config and fails the same way, after queueing for a node again, and the run's log says so
    twice (what a lab saw: a pretrain whose ``model.context`` was longer than the data, run twice).
    """
    if not isinstance(exc, StageFailed):
        return None
    result = exc.result
    stage = result.stage if result is not None else "the stage"
    if isinstance(exc, StageCancelled):
        return f"{stage} is not retried: it was cancelled, not failed"
    if isinstance(exc, StagePreempted) or result is None or result.state != "FAILED":
        return None
    refused = _CONFIG_REFUSED.search(result.reason or "")
    if result.exit_code == CONFIG_REFUSED_EXIT_CODE and refused:
        return (
            f"{stage} is not retried: its job refused its config (exit {result.exit_code}, {refused.group(1)}); "
            "a retry would run the same config, so fix the recipe or the values set for this run"
        )
    return None


def _execute_with_retries(ctx: PipelineContext, name: str, retries: int) -> None:
    """execute_stage, again after a failure, up to ``retries`` times: each retry is a new attempt of
    the same stage run, and a training stage resumes from its last checkpoint (its output folder
    is its identity's). A preempted stage is run again apart from these retries
    (:func:`execute_stage_resuming`); a stage :func:`why_not_retried` rules out (cancelled, a config
    its job refused) is never retried, and the line that says why is logged."""
    for tried in range(retries + 1):
        try:
            execute_stage_resuming(ctx, name)
            return
        except StageFailed as exc:
            if tried == retries:
                raise
            why = why_not_retried(exc)
            if why is not None:
                if not isinstance(exc, StageCancelled):  # a cancel says so itself, and was asked for
                    log.warning("%s", why)
                raise
            ctx.emit(name, "RETRYING", reason=f"retry {tried + 1} of {retries} after: {exc}")


def run_stages(ctx: PipelineContext, stages: Sequence[str] | None = None, *, retries: int = 0) -> PipelineResult:
    """Execute the stages of a started pipeline in order (a failed one up to ``retries`` more
    times), then close the run."""
    error: str | None = None
    state: str | None = None
    try:
        for name in stages or ctx.pipeline.order:
            _execute_with_retries(ctx, name, retries)
    except StageCancelled as exc:
        state, error = "CANCELLED", str(exc)
    except StageFailed as exc:
        state, error = "FAILED", str(exc)
    except Exception as exc:
        state, error = "FAILED", f"{type(exc).__name__}: {exc}"
        finish_pipeline(ctx, state, error)
        raise
    except BaseException as exc:  # stopped from outside (Ctrl-C, SIGTERM, cancellation): see interruption_reason
        from orchestrator.launchers.attempts import interruption_reason

        state, error = "CANCELLED", interruption_reason(exc)
        finish_pipeline(ctx, state, error)
        raise
    for name in ctx.pipeline.order:
        if name not in ctx.results:
            ctx.emit(name, "SKIPPED", reason="an earlier stage did not complete")
    run = finish_pipeline(ctx, state, error)
    return PipelineResult(pipeline_run=run, results=dict(ctx.results), state=run.state, error=error)


def run_pipeline(
    pipeline: Pipeline,
    configs: Mapping[str, Mapping[str, Any]],
    *,
    options: RunOptions | None = None,
    hooks: PipelineHooks | None = None,
    recipe: ResolvedRecipe | None = None,
    settings: Settings | None = None,
    store: LineageStore | None = None,
) -> PipelineResult:
    """Start, execute every stage, and close a pipeline run (stops at the first failed stage)."""
    ctx = start_pipeline(pipeline, configs, options=options, hooks=hooks, recipe=recipe, settings=settings, store=store)
    return run_stages(ctx)


def start_recipe(
    recipe: str | Path | ResolvedRecipe,
    replica: str | None = None,
    *,
    options: RunOptions | None = None,
    hooks: PipelineHooks | None = None,
    settings: Settings | None = None,
    store: LineageStore | None = None,
    repo_root: Path | None = None,
) -> PipelineContext:
    """Resolve a recipe replica and start the MoE pipeline for it (the flows layer's entry point):
    the replica's stages, by default the training chain data .. eval."""
    from orchestrator.recipes import resolve

    resolved = recipe if isinstance(recipe, ResolvedRecipe) else resolve(recipe, replica, root=repo_root)
    pipeline = moe_pipeline(repo_root, stages=resolved.stages, resources=resolved.resources)
    return start_pipeline(
        pipeline, resolved.stage_configs, options=options, hooks=hooks, recipe=resolved, settings=settings, store=store
    )


def run_recipe(
    recipe: str | Path | ResolvedRecipe,
    replica: str | None = None,
    *,
    options: RunOptions | None = None,
    hooks: PipelineHooks | None = None,
    settings: Settings | None = None,
    store: LineageStore | None = None,
    repo_root: Path | None = None,
) -> PipelineResult:
    """Run a recipe replica end to end (what ``openlab run`` does)."""
    ctx = start_recipe(
        recipe, replica, options=options, hooks=hooks, settings=settings, store=store, repo_root=repo_root
    )
    return run_stages(ctx)
