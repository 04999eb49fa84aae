"""A sweep without a server: one pipeline run per combination of values, several at a time.

What ``replica-sweep/sweep`` does from the Prefect UI (:mod:`flows.sweep`), for ``openlab sweep``
at a terminal: each trial is an ordinary pipeline run, the one ``openlab run --set`` would make,
with its own record, lineage card and ``run_set``. The trials run in threads of this process, at
most ``at_once`` at a time: their jobs are what run side by side (on Slurm or Kubernetes, on
other machines), so the threads only wait on them. Stages that trials share (data and tokenize,
when only a training value is swept) are run by one, the others waiting on its lease and reusing
it, as with two ``openlab run`` at once.

Every trial is resolved, so checked against the recipe, before any starts: a misspelt key or a
value of the wrong type stops the sweep with nothing run. A stop (Ctrl-C) reaches every running
trial through its ``should_cancel`` hook, so each cancels its jobs and is recorded CANCELLED, and
no trial still queued starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, OpenlabError, choices
from orchestrator.lineage.models import new_id
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.execute import PipelineHooks, PipelineResult, RunOptions, run_stages, start_recipe
from orchestrator.pipeline.plan import StagePlan
from orchestrator.recipes import ResolvedRecipe, Sampling, resolve, set_words, sweep_trials
from orchestrator.settings import Settings, load_settings

log = logging.getLogger(__name__)

#: Why a stopped sweep's runs were cancelled, as their stages record it.
STOPPED = "the sweep was stopped"
#: Seconds between the main thread's looks at the trials (it must stay awake for Ctrl-C).
POLL_SECONDS = 0.5


#: A sweep's id: ``swp_`` and 20 hex digits, like a lineage record's.
SWEEP_PREFIX = "swp"


def sweep_params(sweep_id: str, number: int, count: int, sampling: Sampling | None = None) -> dict[str, Any]:
    """What a run of a sweep records as ``params.sweep`` (:attr:`PipelineRun.sweep`): which
    sweep, and which of its runs: ``lineage list --sweep ID`` and ``lineage compare --sweep ID``
    find the sweep's runs by it, its stages' W&B runs are tagged with it. A sweep that sampled
    values records how (``sampled``: distributions, count, seed), so the same draws can be made again."""
    return {"id": sweep_id, "run": number, "of": count, **({"sampled": sampling.to_dict()} if sampling else {})}


@dataclass
class Trial:
    """One combination of a sweep's values and what became of its run."""

    #: 1-based, in the grid's order (the first key varying slowest).
    number: int
    #: Every value set for this run: the combination and the values set for all.
    sets: dict[str, Any]
    recipe: ResolvedRecipe
    #: The combination alone: what tells this run from the sweep's others.
    swept: dict[str, Any] = field(default_factory=dict)
    #: ``params.sweep`` of this run (:func:`sweep_params`).
    sweep: dict[str, Any] = field(default_factory=dict)
    result: PipelineResult | None = None
    #: Why the run did not start, or stopped outside its stages (an unreachable backend, a bad
    #: issue); None when ``result`` says it all.
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)
    #: Set when the sweep was stopped before this run could start.
    stopped: bool = False

    @property
    def label(self) -> str:
        """``pretrain.lr=0.02 seed=1``: the values this run tries (those set for all are left out)."""
        return " ".join(set_words(self.swept or self.sets))

    @property
    def state(self) -> str:
        """The run's state; FAILED when it could not start, NOT STARTED when the sweep was stopped first."""
        if self.result is not None:
            return self.result.state
        if self.error is not None:
            return "FAILED"
        return "NOT STARTED"

    @property
    def why(self) -> str | None:
        """Why the run did not complete (None when it did, or is yet to end)."""
        if self.result is not None:
            return self.result.error
        if self.error is None and not self.started.is_set():
            return "the sweep was stopped before it started" if self.stopped else None
        return self.error

    @property
    def pipeline_run_id(self) -> str | None:
        return self.result.pipeline_run.id if self.result is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "sweep": self.sweep.get("id"),
            "set": self.sets,
            "swept": self.swept,
            "state": self.state,
            "pipeline_run_id": self.pipeline_run_id,
            "error": self.why,
        }


def check_over(over: Sequence[str], grid: Mapping[str, Any], option: str = "--over") -> None:
    """Refuse, before anything runs, to take a sweep's comparison over a value its grid (or its
    sampling: pass both keys) does not vary: that would be found only when the runs had ended."""
    for key in over:
        if key.removeprefix("set.") not in grid:
            raise ConfigError(f"{option} {key!r}: not a key of the grid; {choices(key, list(grid), label='grid keys')}")


def plan_sweep(
    recipe: str | Path,
    replica: str | None,
    grid: Mapping[str, Any],
    fixed: Mapping[str, Any] | None = None,
    *,
    sampling: Sampling | None = None,
    until: str | None = None,
    named: tuple[str, str, str, str] = ("--grid", "--set", "--sample", "--until"),
    root: Path | None = None,
) -> list[Trial]:
    """The trials of a sweep, each resolved against the recipe (so checked) before any runs, under
    one new sweep id: the grid's combinations, each crossed with ``sampling``'s draws when given.
    ``named``: what the grid, the values fixed for all, the sampled ones and the last stage are called
    where they were given, for errors (``grid``, ``overrides``, ``samples`` and ``until`` in the run form).
    ``root``: the tree whose recipe runs (a git ref's worktree), as :func:`~orchestrator.recipes.resolve` reads it."""
    combinations = sweep_trials(grid, fixed, sampling)
    sampled = sampling.samplers if sampling is not None else {}
    sweep_id = new_id(SWEEP_PREFIX)
    trials = []
    for number, sets in enumerate(combinations, 1):
        swept = {key: sets[key] for key in (*grid, *sampled)}
        sets_from = {key: named[0] if key in grid else named[2] if key in sampled else named[1] for key in sets}
        resolved = resolve(recipe, replica, root=root, sets=sets, sets_from=sets_from).until(until, named[3])
        params = sweep_params(sweep_id, number, len(combinations), sampling)
        trials.append(Trial(number, sets, resolved, swept, params))
    return trials


@dataclass
class SweepPlan:
    """The dry run of a sweep: per run, per stage, what it would do; and the jobs it would start."""

    trials: list[Trial]
    #: Run number -> stage -> ``run``, ``reuse``, ``wait`` (another holder runs it now), or
    #: ``shared`` (an earlier run of this sweep runs the same identity; this one would reuse it).
    actions: dict[int, dict[str, str]]
    #: Run number -> its stages' plans, as ``openlab explain`` gives them.
    plans: dict[int, list[StagePlan]]
    #: Stage -> how many jobs the sweep would start for it (each identity once).
    jobs: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sweep": self.trials[0].sweep.get("id") if self.trials else None,
            "trials": [
                {
                    "number": t.number,
                    "set": t.sets,
                    "swept": t.swept,
                    "stages": self.actions[t.number],
                    "plans": [p.to_dict() for p in self.plans[t.number]],
                }
                for t in self.trials
            ],
            "jobs": self.jobs,
        }


def explain_sweep(
    trials: list[Trial],
    *,
    backend: str,
    settings: Settings | None = None,
    store: LineageStore | None = None,
    repo_root: Path | None = None,
) -> SweepPlan:
    """What the sweep would run, without running or recording anything: each run's ``explain``,
    with the stages two runs share counted once. A stage whose identity is not known until an
    upstream stage runs (``depends``) is told apart by its config and its upstream stages', since
    the code and environment are the same for every run of the sweep."""
    from orchestrator.hashing import hash_json
    from orchestrator.pipeline.dag import moe_pipeline
    from orchestrator.pipeline.plan import explain_recipe

    settings = settings or load_settings()
    owns = store is None
    store = store or LineageStore.open_to_plan(settings)
    try:
        actions: dict[int, dict[str, str]] = {}
        plans: dict[int, list[StagePlan]] = {}
        jobs: dict[str, int] = {}
        started: set[str] = set()  # the identities (or stand-ins) some earlier run of the sweep starts
        for trial in trials:
            plans[trial.number] = explain_recipe(
                trial.recipe, backend=backend, settings=settings, store=store, repo_root=repo_root
            )
            specs = moe_pipeline(repo_root, stages=trial.recipe.stages, resources=trial.recipe.resources).stages
            keys: dict[str, str] = {}
            actions[trial.number] = {}
            for spec, plan in zip(specs, plans[trial.number], strict=True):
                keys[spec.name] = plan.identity or hash_json(
                    {
                        "stage": spec.name,
                        "config": trial.recipe.stage_configs[spec.name],
                        "inputs": {key: keys[up] for key, up in spec.inputs.items()},
                    }
                )
                action = plan.action
                if action in ("run", "depends"):
                    action = "shared" if keys[spec.name] in started else "run"
                    if action == "run":
                        started.add(keys[spec.name])
                        jobs[spec.name] = jobs.get(spec.name, 0) + 1
                actions[trial.number][spec.name] = action
        return SweepPlan(trials, actions, plans, jobs)
    finally:
        if owns:
            store.close()


def run_sweep(
    trials: list[Trial],
    *,
    options: RunOptions,
    hooks_for: Callable[[Trial], PipelineHooks],
    at_once: int = 0,
    retries: int = 0,
    stop: threading.Event | None = None,
    settings: Settings | None = None,
    on_end: Callable[[Trial], None] | None = None,
) -> list[Trial]:
    """Run the trials, ``at_once`` at a time (0: all at once), each as ``openlab run`` would.

    ``hooks_for(trial)`` gives each run its hooks (its display). Setting ``stop``, or an
    interruption of the calling thread (Ctrl-C), cancels the running trials (each records its
    run CANCELLED once its jobs are cancelled) and starts no other; the interruption is raised
    again once they have ended. A trial that fails does not stop the others. ``on_end(trial)`` is
    called as each run ends (from its thread), for a display.
    """
    if at_once < 0:
        raise ConfigError(f"sweep: at once must be 0 (all at once) or more, got {at_once}")
    stop = stop or threading.Event()

    def run_one(trial: Trial) -> None:
        if stop.is_set():  # stopped while this one waited for a place
            trial.stopped = True
            return
        hooks = hooks_for(trial)
        own = hooks.should_cancel
        hooks = replace(hooks, should_cancel=lambda: STOPPED if stop.is_set() else bool(own and own()))
        trial.started.set()
        ctx = None
        try:
            mine = replace(options, params={**options.params, "sweep": trial.sweep}) if trial.sweep else options
            ctx = start_recipe(trial.recipe, options=mine, hooks=hooks, settings=settings)
            trial.result = run_stages(ctx, retries=retries)
        except OpenlabError as exc:  # refused before its stages ran: the others go on
            trial.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - one trial's crash must not end the others; recorded FAILED
            log.exception("sweep run %d (%s) failed", trial.number, trial.label)
            trial.error = f"{type(exc).__name__}: {exc}"
            if ctx is not None:  # run_stages closed its run FAILED: keep it in the sweep's table
                trial.result = PipelineResult(ctx.pipeline_run, dict(ctx.results), "FAILED", trial.error)
        finally:
            if on_end is not None:
                try:
                    on_end(trial)
                except Exception:  # noqa: BLE001 - a display must not change what the run did
                    log.exception("sweep on_end hook failed")

    with ThreadPoolExecutor(max_workers=at_once or len(trials) or 1, thread_name_prefix="sweep") as pool:
        futures = [pool.submit(run_one, trial) for trial in trials]
        try:
            while not all(f.done() for f in futures):
                wait(futures, timeout=POLL_SECONDS)
        except BaseException:  # Ctrl-C: cancel the running trials, start no other, then say so
            stop.set()
            wait(futures)
            raise
    return trials


__all__ = [
    "STOPPED",
    "SWEEP_PREFIX",
    "SweepPlan",
    "Trial",
    "check_over",
    "explain_sweep",
    "plan_sweep",
    "run_sweep",
    "sweep_params",
]
