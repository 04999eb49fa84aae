"""``openlab run`` and ``openlab explain``: the replica pipeline from a terminal, without Prefect.

Both call the same library as the Prefect flows (:mod:`orchestrator.pipeline`), so a
terminal run and a UI run reuse each other's stages and record the same lineage.
``run`` shows a live line per stage (state, progress, last log line) and ends with the
lineage summary; ``explain`` is the dry run: per stage run / reuse / wait / depends, and
which identity fields changed since the last completed run of that stage.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from orchestrator.cli.output import ACTION_STYLE, STATE_STYLE, console, describe_asks, err_console, narrow, print_json

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

RecipeArg = Annotated[str, typer.Argument(help="Recipe file or name in recipes/ (e.g. marin-535b-a23b).")]
ReplicaOpt = Annotated[
    str | None, typer.Option("--replica", "-r", help="Named replica (e.g. tiny, small); default: full scale.")
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]
BackendOpt = Annotated[
    str | None,
    typer.Option(
        "--backend", "-b", help="local, docker, slurm or kubernetes; default: [backends] default, else local."
    ),
]
UntilOpt = Annotated[
    str | None,
    typer.Option("--until", help="Stop after this stage: it and the stages it reads from (e.g. tokenize)."),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Set a recipe value for this run only, over the replica's own (repeatable; the value is YAML: "
        "pretrain.lr=0.02, dispatch.scheme=ragged, pretrain.mixture='{code: 0.5, prose: 0.5}').",
    ),
]

ForceOpt = Annotated[bool, typer.Option("--force", help="Re-run every stage, even reusable ones.")]
ForceStageOpt = Annotated[list[str] | None, typer.Option("--force-stage", help="Re-run this stage (repeatable).")]
RetriesOpt = Annotated[
    int | None,
    typer.Option(
        "--retries", min=0, help="Retry a failed stage this many times (default: [pipeline] stage_retries, 1)."
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Print every job log line.")]


def _force_value(force: bool, force_stage: list[str] | None) -> bool | frozenset[str]:
    if force:
        return True
    return frozenset(force_stage) if force_stage else False


class _Display:
    """A rich progress line per stage, fed by pipeline hooks (called from worker threads)."""

    def __init__(self, stages: list[str], verbose: bool) -> None:
        self.verbose = verbose
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.fields[stage]:<10}"),
            TextColumn("{task.fields[state]}"),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[detail]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, TaskID] = {
            s: self.progress.add_task(s, stage=s, state="[dim]PENDING[/]", detail="", total=None, start=False)
            for s in stages
        }
        self.lock = threading.Lock()

    def transition(self, event: Any) -> None:
        with self.lock:
            task = self.tasks.get(event.stage)
            if task is None:
                return
            style = STATE_STYLE.get(event.state, "")
            detail = escape(event.reason[:90]) if event.reason else ""
            if event.state == "RETRYING":  # the bar starts over for the new attempt
                self.progress.reset(task, start=False)
            self.progress.update(task, state=f"[{style}]{event.state}[/]", detail=detail)
            if event.state in ("CHECKING", "RUNNING"):
                self.progress.start_task(task)
            if event.state in ("REUSED", "COMPLETED", "FAILED", "CANCELLED", "SKIPPED"):
                total = self.progress.tasks[task].total or 1
                self.progress.update(task, total=total, completed=total)
                self.progress.stop_task(task)

    def log(self, stage: str, line: str) -> None:
        with self.lock:
            task = self.tasks.get(stage)
            if task is not None:
                self.progress.update(task, detail=escape(line.strip()[:90]))
            if self.verbose:
                self.progress.console.print(f"[dim]{stage:>10} |[/] {escape(line)}", highlight=False)

    def advance(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            task = self.tasks.get(stage)
            if task is not None:
                self.progress.update(task, total=total, completed=done)


def _job_where(r: Any) -> str:
    """``4711 on west``: a stage's job and the cluster it ran on (its id alone names nothing)."""
    return f"{r.job_id} on {r.cluster}" if r.job_id and r.cluster else r.job_id or ""


def _summary_table(result: Any) -> Table:
    table = Table(title=f"pipeline run {result.pipeline_run.id}: {result.state}", title_justify="left")
    for column in ("stage", "state", "stage run", "identity", "reused from / job", "s", "why"):
        table.add_column(column, overflow="fold")
    for r in result.results.values():
        style = STATE_STYLE.get(r.state, "")
        table.add_row(
            r.stage,
            f"[{style}]{r.state}[/]",
            r.stage_run_id,
            r.identity[:16],
            r.reused_from or _job_where(r),
            f"{r.seconds:.2f}",
            escape(r.reason),
        )
    return table


def _summary_blocks(result: Any) -> None:
    """The run's summary for a narrow terminal: per stage a line with its state, stage run id and
    seconds, then its identity and what it reused or which job ran it, then why; ids whole."""
    from rich.padding import Padding
    from rich.text import Text

    console.print(Text(f"pipeline run {result.pipeline_run.id}: {result.state}", style="italic"))
    for r in result.results.values():
        console.print(
            Text.assemble(
                (f"{r.stage:<10}", "bold"),
                (f"{r.state:<10}", STATE_STYLE.get(r.state, "")),
                f"{r.stage_run_id}  {r.seconds:.2f} s",
            )
        )
        source = f"reused from {r.reused_from}" if r.reused_from else (f"job {_job_where(r)}" if r.job_id else "")
        console.print(Padding(Text(f"identity {r.identity[:16]}" + (f" · {source}" if source else "")), (0, 0, 0, 4)))
        if r.reason:
            console.print(Padding(Text(r.reason), (0, 0, 0, 4)))


@app.command("run")
def run(
    recipe: RecipeArg,
    replica: ReplicaOpt = None,
    backend: BackendOpt = None,
    issue: Annotated[str | None, typer.Option("--issue", help="Experiment issue owner/repo#N (or #N).")] = None,
    require_issue: Annotated[
        bool, typer.Option("--require-issue", help="Stop before any job starts if the issue cannot be linked.")
    ] = False,
    force: ForceOpt = False,
    force_stage: ForceStageOpt = None,
    until: UntilOpt = None,
    set_values: SetOpt = None,
    retries: RetriesOpt = None,
    verbose: VerboseOpt = False,
    json_out: JsonFlag = False,
) -> None:
    """Run RECIPE's pipeline here (data .. eval, or the stages the replica names), reusing what is done."""
    from orchestrator.pipeline import RunOptions, stage_retries
    from orchestrator.provenance.invocation import command_line
    from orchestrator.recipes import parse_sets, resolve
    from orchestrator.settings import load_settings

    resolved = resolve(recipe, replica, sets=parse_sets(set_values or [])).until(until)
    settings = load_settings()
    options = RunOptions(
        backend=backend or settings.default_backend,
        issue=issue,
        issue_required=require_issue,
        force=_force_value(force, force_stage),
        trigger="terminal",
        command=command_line(),
    )
    _run_here(resolved, options, stage_retries(settings) if retries is None else retries, verbose, json_out)


@app.command("rerun")
def rerun(
    run_id: Annotated[
        str, typer.Argument(metavar="PIPELINE_RUN", help="The pipeline run to run again (prun_…, or a unique prefix).")
    ],
    backend: Annotated[
        str | None, typer.Option("--backend", "-b", help="Run it on this backend (default: the one it ran on).")
    ] = None,
    force: ForceOpt = False,
    force_stage: ForceStageOpt = None,
    retries: RetriesOpt = None,
    verbose: VerboseOpt = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Say per stage what the rerun would run or reuse, as explain does; run nothing."
        ),
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Run PIPELINE_RUN again here as it was asked (recipe, replica, --set values, --until, backend, issue, sweep),
    recorded as its retry: what completed is reused, a training stage resumes from its checkpoint."""
    from orchestrator.lineage.store import LineageStore
    from orchestrator.pipeline import RunOptions, stage_retries
    from orchestrator.pipeline.rerun import rerun_of
    from orchestrator.provenance.invocation import command_line
    from orchestrator.recipes import set_words
    from orchestrator.settings import load_settings

    settings = load_settings()
    if backend is not None:  # refused alone, before the line that says what would run where
        from orchestrator.launchers.base import known_backend

        backend = known_backend(backend, "--backend")
    with LineageStore.open(settings, create=False) as store:
        again = rerun_of(store, run_id)
    if again.issue:  # a reference it was refused for is said alone, before the rerun's line
        from orchestrator.links.github import check_issue_option

        check_issue_option(again.issue, settings)
    if not json_out:  # what is asked again, as `openlab run` would be typed
        asked = [again.recipe.name.replace(":", " -r ", 1), *(["--until", again.until] if again.until else [])]
        asked += [f"--set {w}" for w in set_words(again.recipe.run_set)]
        err_console.print(
            f"rerun of {again.of.id} ({again.of.state}): {' '.join(asked)} on {backend or again.backend}"
            + (f", issue {again.issue}" if again.issue else "")
            + (f"; it ran git ref {again.git_ref}, this reruns the working tree" if again.git_ref else ""),
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if dry_run:
        from orchestrator.pipeline import explain_recipe

        plans = explain_recipe(again.recipe, force=_force_value(force, force_stage), backend=backend or again.backend)
        _print_plans(again.recipe, plans, json_out)
        return
    options = RunOptions(
        backend=backend or again.backend,
        issue=again.issue,
        issue_required=again.issue_required,
        force=_force_value(force, force_stage),
        trigger="terminal",
        command=command_line(),
        params=again.params,
        retry_of=again.of.id,
    )
    _run_here(again.recipe, options, stage_retries(settings) if retries is None else retries, verbose, json_out)


def _run_here(resolved: Any, options: Any, retries: int, verbose: bool, json_out: bool) -> None:
    """Run ``resolved`` with ``options`` (``run``, ``rerun``): live lines on a terminal, then the lineage summary."""
    from orchestrator.pipeline import PipelineHooks, run_stages, start_recipe
    from orchestrator.preregistration import outcome_lines
    from orchestrator.recipes import set_words

    if json_out or not console.is_terminal:
        hooks = PipelineHooks(
            on_transition=(
                None
                if json_out
                else lambda e: err_console.print(e.line(), markup=False, highlight=False, soft_wrap=True)
            ),
            on_log=(
                (lambda s, line: err_console.print(f"{s} | {line}", highlight=False, markup=False)) if verbose else None
            ),
        )
        ctx = start_recipe(resolved, options=options, hooks=hooks)
        result = run_stages(ctx, retries=retries)
    else:
        display = _Display(list(resolved.stages), verbose)
        hooks = PipelineHooks(on_transition=display.transition, on_log=display.log, on_progress=display.advance)
        with display.progress:
            ctx = start_recipe(resolved, options=options, hooks=hooks)
            result = run_stages(ctx, retries=retries)
    if json_out:
        data = result.to_dict()
        data["commit"] = ctx.commit.id
        data["environment"] = ctx.environment.id
        data["recipe_lineage"] = resolved.lineage()
        data["preregistration"] = result.pipeline_run.preregistration
        print_json(data)
    else:
        if narrow():  # seven columns of ids and prose do not fit: one block per stage
            _summary_blocks(result)
        else:
            console.print(_summary_table(result))
        console.print(
            f"commit {ctx.commit.id} · environment {ctx.environment.id[:16]} · "
            f"recipe {resolved.name} · backend {ctx.options.backend}"
        )
        if resolved.run_set:  # what this run set over its recipe: the experiment, in its summary
            from orchestrator.secrets import scrub

            said = scrub(" ".join(set_words(resolved.run_set)))  # a terminal's scrollback is a log
            console.print("set for this run: " + said, markup=False, highlight=False)
        for line in outcome_lines(result.pipeline_run.preregistration):
            console.print(f"pre-registered {line}", markup=False, highlight=False)
        if result.error:
            err_console.print(f"[bold red]error:[/] {escape(result.error)}", soft_wrap=True)  # a log path: whole
        console.print(f"lineage: [bold]openlab lineage show {result.pipeline_run.id}[/]")
        from orchestrator.lineage.diff import previous_run
        from orchestrator.lineage.models import PipelineRun

        retried = ctx.store.get(PipelineRun, options.retry_of) if options.retry_of else None
        before = retried or previous_run(ctx.store, result.pipeline_run)
        if before is not None:  # what changed since the last run of this replica (the command whole on its line)
            since = "the run it reruns" if retried else "the last run"
            console.print(f"what changed since {since} (add -m 'eval/*' for how the metrics moved):")
            console.print(f"  openlab lineage diff {before.id} {result.pipeline_run.id}", highlight=False)
    raise typer.Exit(0 if result.ok else 1)


@app.command("explain")
def explain(
    recipe: RecipeArg,
    replica: ReplicaOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Plan as if every stage were forced.")] = False,
    force_stage: Annotated[list[str] | None, typer.Option("--force-stage", help="Plan this stage as forced.")] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", "-b", help="Plan for this backend (containers: the image is the environment)."),
    ] = None,
    until: UntilOpt = None,
    set_values: SetOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """Dry run: for each stage, run or reuse, and which identity fields changed since its closest completed run."""
    from orchestrator.pipeline import explain_recipe
    from orchestrator.recipes import parse_sets, resolve
    from orchestrator.settings import load_settings

    resolved = resolve(recipe, replica, sets=parse_sets(set_values or [])).until(until)
    plans = explain_recipe(
        resolved, force=_force_value(force, force_stage), backend=backend or load_settings().default_backend
    )
    _print_plans(resolved, plans, json_out)


def _print_plans(resolved: Any, plans: list[Any], json_out: bool) -> None:
    """The dry run of ``explain`` and ``rerun --dry-run``: a row per stage (below 110 columns, a block)."""
    if json_out:
        print_json({"recipe": resolved.lineage(), "stages": [p.to_dict() for p in plans]})
        return
    if narrow():  # six columns of prose do not fit: one block per stage instead
        _explain_blocks(resolved, plans)
        return
    table = Table(title=f"openlab explain {resolved.name}", title_justify="left")
    columns = ["stage", "action", "identity", "why", "changed fields"]
    if resolved.resources:  # what each job would ask its backend for, when the recipe says
        columns.append("job asks")
    for column in columns:
        table.add_column(column, overflow="fold")
    for p in plans:
        table.add_row(
            p.stage,
            f"[{ACTION_STYLE.get(p.action, '')}]{p.action}[/]",
            (p.identity or "(after upstream)")[:16],
            escape(p.reason),
            escape("\n".join([*p.changes, *(f"by {c}" for c in p.commits)])) or "-",
            *([describe_asks(resolved.resources.get(p.stage) or {})] if resolved.resources else []),
        )
    console.print(table)


def _explain_blocks(resolved: Any, plans: list[Any]) -> None:
    """``explain`` for a narrow terminal: per stage a line with its action, identity and what its
    job asks, then why, then each changed field on its own line. Wrapped by word, so ids stay
    whole (they are what a reader copies into ``lineage show``)."""
    from rich.padding import Padding
    from rich.text import Text

    console.print(Text(f"openlab explain {resolved.name}", style="italic"))
    for p in plans:
        line = Text.assemble(
            (f"{p.stage:<10}", "bold"),
            (f"{p.action:<8}", ACTION_STYLE.get(p.action, "")),
            (p.identity or "(after upstream)")[:16],
        )
        if resolved.resources:
            line.append(f"  asks {describe_asks(resolved.resources.get(p.stage) or {})}")
        console.print(line)
        reason = p.reason
        if p.changes and reason.startswith("changed since "):  # the list below says what, in full
            reason = reason.split(": ", 1)[0] + ":"
        console.print(Padding(Text(reason), (0, 0, 0, 4)))
        for change in p.changes:
            console.print(Padding(Text(f"- {change}"), (0, 0, 0, 4)))
        if p.commits:  # where the code changes came from: the commits since, newest first
            console.print(Padding(Text("changed by:"), (0, 0, 0, 4)))
            for commit in p.commits:
                console.print(Padding(Text(f"- {commit}"), (0, 0, 0, 4)))


__all__ = ["app", "explain", "run"]
