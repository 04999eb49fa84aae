"""``openlab sweep``: a grid of recipe values from a terminal, one pipeline run per combination.

The terminal's ``replica-sweep/sweep`` (:mod:`flows.sweep`), without a Prefect server: ``openlab
sweep marin-535b-a23b -r tiny -b slurm --grid pretrain.lr=0.005,0.01,0.02`` runs the replica three
times, each run the one ``openlab run --set pretrain.lr=...`` would make, side by side, with a live
line per run, then prints ``openlab lineage compare`` of them: what each set beside what it measured.
The runs themselves are :mod:`orchestrator.pipeline.sweep`'s.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import RenderableType
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column
from rich.text import Text

from orchestrator.cli.lineage import OverOpt
from orchestrator.cli.output import (
    ACTION_STYLE,
    STATE_STYLE,
    console,
    describe_asks,
    err_console,
    narrow,
    print_json,
    say,
)
from orchestrator.cli.run import BackendOpt, JsonFlag, RecipeArg, ReplicaOpt, RetriesOpt, UntilOpt

if TYPE_CHECKING:
    from orchestrator.lineage.compare import Aggregate, Comparison
    from orchestrator.pipeline import PipelineHooks, StageTransition
    from orchestrator.pipeline.sweep import SweepPlan, Trial
    from orchestrator.recipes import ResolvedRecipe
    from orchestrator.settings import Settings

#: A stage that has ended one way or another: the bar counts it.
_ENDED = ("REUSED", "COMPLETED", "FAILED", "CANCELLED", "SKIPPED")


class _Spinner(SpinnerColumn):
    """A spinner while a run goes on; once it has ended, the mark it was given (a failed run's bar
    is not full, and rich spins until a bar is)."""

    def render(self, task: Task) -> RenderableType:
        mark = task.fields.get("mark")
        return Text(mark) if mark is not None else super().render(task)


class _Display:
    """A rich progress line per run of the sweep: what it set, its stage now, stages done of all."""

    def __init__(self, trials: list[Trial]) -> None:
        columns = [
            _Spinner(),
            TextColumn("{task.fields[label]}", table_column=Column(no_wrap=True, overflow="ellipsis", max_width=40)),
            TextColumn("{task.fields[state]}", table_column=Column(no_wrap=True)),
            BarColumn(bar_width=10 if narrow() else 18),
            MofNCompleteColumn(),
        ]
        if not narrow():  # the last log line: room for it in a wide terminal only
            columns.append(TextColumn("{task.fields[detail]}", table_column=Column(no_wrap=True, overflow="ellipsis")))
        self.progress = Progress(*columns, TimeElapsedColumn(), console=console, transient=False)
        labels = short_labels([t.swept or t.sets for t in trials])
        self.tasks: dict[int, TaskID] = {
            t.number: self.progress.add_task(
                t.label,
                label=escape(f"{t.number}. {label}"),
                state="[dim]queued[/]",
                detail="",
                total=len(t.recipe.stages),
                start=False,
            )
            for t, label in zip(trials, labels, strict=True)
        }
        self.lock = threading.Lock()

    def hooks(self, trial: Trial) -> PipelineHooks:
        from orchestrator.pipeline import PipelineHooks

        task = self.tasks[trial.number]

        def transition(event: StageTransition) -> None:
            with self.lock:
                self.progress.start_task(task)
                detail = escape(event.reason[:80]) if event.reason else ""
                self.progress.update(task, state=_styled(f"{event.stage} {event.state}", event.state), detail=detail)
                if event.state in _ENDED:
                    self.progress.advance(task)

        def log(stage: str, line: str) -> None:
            with self.lock:
                self.progress.update(task, detail=escape(f"{stage} | {line.strip()}"[:80]))

        return PipelineHooks(on_transition=transition, on_log=log)

    def ended(self, trial: Trial) -> None:
        with self.lock:
            task = self.tasks[trial.number]
            why = trial.why or ""
            mark = "✓" if trial.state == "COMPLETED" else "✗"
            self.progress.update(task, state=_styled(trial.state, trial.state), detail=escape(why[:80]), mark=mark)
            self.progress.stop_task(task)


def short_labels(combinations: list[dict[str, object]]) -> list[str]:
    """Each run's values with its keys cut to the shortest dotted tail no other key of the grid
    shares (``max_bytes_per_domain=150000 seed=1``; ``pretrain.lr`` stays whole beside
    ``midtrain.lr``), so that in a narrow terminal the value that tells runs apart still shows."""
    from orchestrator.recipes import set_value_word

    keys = list(dict.fromkeys(k for combination in combinations for k in combination))

    def short(key: str) -> str:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(other != key and (other == tail or other.endswith("." + tail)) for other in keys):
                return tail
        return key

    names = {key: short(key) for key in keys}
    return [" ".join(f"{names[k]}={set_value_word(v)}" for k, v in c.items()) for c in combinations]


def _styled(text: str, state: str) -> str:
    """``text`` in the colour of ``state`` (dim for a state without one: NOT STARTED)."""
    return f"[{STATE_STYLE.get(state) or 'dim'}]{escape(text)}[/]"


def _lines_hooks(trial: Trial, count: int) -> PipelineHooks:
    """Hooks that print each stage transition as a line naming its run (a pipe, a log file)."""
    from orchestrator.pipeline import PipelineHooks

    prefix = f"sweep {trial.number}/{count} ({trial.label}): "
    return PipelineHooks(
        on_transition=lambda e: err_console.print(prefix + e.line(), markup=False, highlight=False, soft_wrap=True)
    )


def sweep(
    recipe: RecipeArg,
    grid: Annotated[
        list[str] | None,
        typer.Option(
            "--grid",
            "-g",
            metavar="KEY=V1,V2,...",
            help="Values to try for a recipe key, as a YAML list whose brackets may be left out: "
            "pretrain.lr=0.005,0.01,0.02, dispatch.scheme=ragged,waterfilling. Several --grid keys try every "
            "combination (at most 64 runs).",
        ),
    ] = None,
    sample: Annotated[
        list[str] | None,
        typer.Option(
            "--sample",
            metavar="KEY=DIST",
            help="Draw a recipe key's value at random, --count times: uniform(A,B), loguniform(A,B) (learning "
            "rates), int(A,B) (both ends included) or choice(V1,V2,...). Crossed with --grid: every grid "
            "combination runs the same draws.",
        ),
    ] = None,
    count: Annotated[
        int | None, typer.Option("--count", min=1, help="How many different draws of the --sample values to run.")
    ] = None,
    sample_seed: Annotated[
        int,
        typer.Option(
            "--sample-seed", help="Seed of the draws: the same seed draws the same values (and reuses their runs)."
        ),
    ] = 0,
    replica: ReplicaOpt = None,
    backend: BackendOpt = None,
    set_values: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Set a recipe value for every run of the sweep, as `openlab run --set` does (repeatable).",
        ),
    ] = None,
    issue: Annotated[
        str | None, typer.Option("--issue", help="Experiment issue owner/repo#N (or #N) every run is linked to.")
    ] = None,
    require_issue: Annotated[
        bool, typer.Option("--require-issue", help="Stop each run before any job starts if the issue cannot be linked.")
    ] = False,
    until: UntilOpt = None,
    at_once: Annotated[
        int,
        typer.Option(
            "--at-once",
            min=0,
            help="How many runs at a time; 0 (the default) starts them all at once. Their jobs share this "
            "machine on the local and docker backends: --at-once 1 runs one after another.",
        ),
    ] = 0,
    retries: RetriesOpt = None,
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help="Metrics to compare the runs on, as in `lineage compare` ('eval/*/loss', 'eval:eval/*/loss'). "
            "Default: eval's losses and repro's late-window drops "
            "(runs that stopped before them: their last stage's held-out losses).",
        ),
    ] = None,
    sort: Annotated[
        str | None, typer.Option("--sort", help="Order the comparison by this metric, smallest first.")
    ] = None,
    over: OverOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Say, per run and stage, run or reuse (a stage two runs share is run once), and how many jobs the "
            "sweep would start; start nothing, record nothing.",
        ),
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Run RECIPE's replica once per combination of the --grid values (and per draw of the --sample ones),
    side by side, then compare the runs.

    Each run is the one `openlab run --set KEY=VALUE` would make (its own lineage, card and W&B runs); stages
    they share, such as data and tokenize when only a training value is swept, run once and are reused by
    the others. Every combination is checked against the recipe before any run starts. Ctrl-C cancels the
    runs and their jobs. Exit 0 when every run completed, 1 otherwise.
    """
    from orchestrator.cli.lineage import print_comparison
    from orchestrator.errors import ConfigError
    from orchestrator.lineage.compare import Aggregate
    from orchestrator.pipeline import PipelineHooks, RunOptions, stage_retries
    from orchestrator.pipeline.sweep import check_over, plan_sweep, run_sweep
    from orchestrator.provenance.invocation import command_line
    from orchestrator.recipes import Sampling, parse_grid, parse_samples, parse_sets
    from orchestrator.settings import load_settings

    swept = parse_grid(grid or [])
    sampling = Sampling.asked(parse_samples(sample or []), count, sample_seed)
    if sampling is None and not swept:
        raise ConfigError("give the values to try: --grid KEY=V1,V2,... or --sample KEY=DIST --count N")
    check_over(over or [], {**swept, **(sampling.samplers if sampling else {})})
    trials = plan_sweep(recipe, replica, swept, parse_sets(set_values or []), sampling=sampling, until=until)
    settings = load_settings()
    if issue:  # refused once, before any run is recorded (each run would fail on it alike)
        from orchestrator.links.github import check_issue_option

        check_issue_option(issue, settings)
    options = RunOptions(
        backend=backend or settings.default_backend,
        issue=issue,
        issue_required=require_issue,
        trigger="terminal",
        command=command_line(),
    )
    retries = stage_retries(settings) if retries is None else retries
    first = trials[0].recipe
    if dry_run:
        from orchestrator.pipeline.sweep import explain_sweep

        planned = explain_sweep(trials, backend=options.backend, settings=settings)
        if json_out:
            print_json(planned.to_dict())
        else:
            _print_plan(planned, first, options.backend)
        return
    if not json_out:
        say(
            f"sweep {trials[0].sweep['id']}: {len(trials)} runs of {first.name} on {options.backend}"
            + (f", {at_once} at a time" if at_once else "")
        )

    interrupted = False
    try:  # Ctrl-C: run_sweep has cancelled the runs; what ended is still compared below
        if json_out or not console.is_terminal:
            run_sweep(
                trials,
                options=options,
                hooks_for=(lambda t: PipelineHooks()) if json_out else (lambda t: _lines_hooks(t, len(trials))),
                at_once=at_once,
                retries=retries,
                settings=settings,
                on_end=None if json_out else _say_ended,
            )
        else:
            display = _Display(trials)
            with display.progress:
                try:
                    run_sweep(
                        trials,
                        options=options,
                        hooks_for=display.hooks,
                        at_once=at_once,
                        retries=retries,
                        settings=settings,
                        on_end=display.ended,
                    )
                finally:  # stopped: those that never started say so, not "queued"
                    for trial in trials:
                        if trial.stopped:
                            display.ended(trial)
    except KeyboardInterrupt:
        interrupted = True

    comparison, sort_error = _compare(trials, metric, sort, over, settings)
    if json_out:
        print_json(
            {
                "sweep": trials[0].sweep.get("id"),
                "trials": [t.to_dict() for t in trials],
                "comparison": comparison.to_dict() if comparison is not None else None,
            }
        )
    else:
        for trial in trials:
            why = trial.why
            if why:
                err_console.print(
                    f"run {trial.number} ({trial.label}) {trial.state}: {why}",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,  # whole, as the log path in it is copied
                )
        if comparison is not None:
            print_comparison(comparison, metric is None)
            again = (comparison.of if isinstance(comparison, Aggregate) else comparison).command(
                metric or (), sort, over or ()
            )
            console.print(f"again: {again}", markup=False, highlight=False, soft_wrap=True)
    if sort_error:  # the runs are compared as they are: an hour of sweep is not lost to a misspelt column
        err_console.print(f"error: {sort_error}", markup=False, highlight=False)
    if interrupted:
        err_console.print("interrupted: the runs that had not ended were cancelled", markup=False, highlight=False)
        raise typer.Exit(130)
    raise typer.Exit(0 if all(t.state == "COMPLETED" for t in trials) and not sort_error else 1)


def _compare(
    trials: list[Trial], metric: list[str] | None, sort: str | None, over: list[str] | None, settings: Settings
) -> tuple[Comparison | Aggregate | None, str | None]:
    """``lineage compare`` of the runs the sweep made (None when none started), taken over the
    values asked and sorted when asked, and why that could not be done (the runs compared as
    they are)."""
    from orchestrator.errors import ConfigError
    from orchestrator.lineage.compare import DEFAULT_METRICS, compare_runs
    from orchestrator.lineage.models import PipelineRun
    from orchestrator.lineage.store import LineageStore

    ids = [t.result.pipeline_run.id for t in trials if t.result is not None]
    if not ids:
        return None, None
    with LineageStore.open(settings) as store:  # the runs as recorded now, closed
        comparison = compare_runs(store, [store.require(PipelineRun, i) for i in ids], metric or DEFAULT_METRICS)
    try:
        shown = comparison.over(over) if over else comparison
        return (shown.sorted_by(sort) if sort else shown), None
    except ConfigError as exc:
        return comparison, str(exc)


def _print_plan(planned: SweepPlan, recipe: ResolvedRecipe, backend: str) -> None:
    """The dry run: a row per run with each stage's action (below 110 columns: a line per run),
    then the jobs the sweep would start, per stage, with what each asks of its backend."""
    from orchestrator.cli.output import compact_table

    trials = planned.trials
    stages = list(recipe.stages)
    labels = short_labels([t.swept or t.sets for t in trials])
    say(f"sweep dry run: {len(trials)} runs of {recipe.name} on {backend}; nothing is started or recorded")
    if narrow():
        for trial, label in zip(trials, labels, strict=True):
            actions = planned.actions[trial.number]
            say(f"{trial.number}. {label}: " + ", ".join(f"{s} {actions.get(s, '-')}" for s in stages))
    else:
        table = compact_table("openlab sweep --dry-run")
        table.add_column("run", no_wrap=True)
        for stage in stages:
            table.add_column(stage, no_wrap=True)
        for trial, label in zip(trials, labels, strict=True):
            actions = planned.actions[trial.number]
            cells = [actions.get(s, "-") for s in stages]
            table.add_row(
                escape(f"{trial.number}. {label}"),
                *(f"[{ACTION_STYLE.get(a, '')}]{a}[/]" if a in ACTION_STYLE else a for a in cells),
            )
        console.print(table)
    if not planned.jobs:
        say("it would start no job: every stage of every run is reused")
        return
    total = sum(planned.jobs.values())
    say(f"it would start {total} job{'s' if total != 1 else ''}:")
    for stage in stages:
        if planned.jobs.get(stage):
            asks = describe_asks(recipe.resources.get(stage) or {}) if recipe.resources else "-"
            say(f"  {stage}: {planned.jobs[stage]}" + (f" (each asks {asks})" if asks != "-" else ""))
    say("shared: an earlier run of the sweep runs that stage; this one reuses it once it has")


def _say_ended(trial: Trial) -> None:
    err_console.print(f"sweep run {trial.number} ({trial.label}) {trial.state}", markup=False, highlight=False)


__all__ = ["sweep"]
