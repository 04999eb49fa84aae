"""``openlab nightly``: the nightlies' baselines, and accepting a regression as the new normal.

A nightly is judged against the last good nightly of its kind (recipe, replica, backend, asked git
ref; :func:`orchestrator.nightly.previous_nightly`). When a change moves a tracked metric on purpose
(a new routing scheme that drops fewer tokens and costs a little loss), every nightly after it
regresses until someone says the new numbers are the reference: ``accept`` does, with a reason
kept on the run's verdict, and closes the regression issue it opened.
"""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.cli.output import print_json

app = typer.Typer(
    help="Nightly replicas: which run each kind is judged against, and accepting a regression on purpose.",
    no_args_is_help=True,
)


@app.command("accept")
def accept(
    run_id: Annotated[
        str, typer.Argument(metavar="PIPELINE_RUN", help="The regressed nightly's run (prun_…, or a unique prefix).")
    ],
    reason: Annotated[
        str,
        typer.Option(
            "--reason", help="Why the new numbers are right (an issue, a change): kept on the verdict and posted."
        ),
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object for scripts.")] = False,
) -> None:
    """Make the regressed nightly PIPELINE_RUN the baseline the next nightly of its recipe, replica, backend
    and git ref is judged against, and close its regression issue (with [github] repo set). Its verdict
    stays regressed, with who accepted it, when and why."""
    from orchestrator.lineage.store import LineageStore
    from orchestrator.links.regressions import accept_and_report
    from orchestrator.nightly import short_commit
    from orchestrator.provenance.invocation import user_at_host
    from orchestrator.settings import load_settings

    settings = load_settings()
    with LineageStore.open(settings, create=False) as store:
        # the regression issue is closed where one is open; queued, as any GitHub update, when GitHub
        # cannot be reached now (`openlab github sync` sends it)
        verdict, report = accept_and_report(store, run_id, reason=reason, by=user_at_host(), settings=settings)
    if json_out:
        issue = {"action": report.action, "issue": report.issue_id, "url": report.url, "line": report.line()}
        print_json({"verdict": verdict.to_dict(), "regression_issue": issue})
        return
    typer.echo(
        f"{verdict.pipeline_run_id} at commit {short_commit(verdict.commit)} is the baseline of its nightly from now "
        f"on (accepted by {(verdict.accepted or {}).get('by')}: {(verdict.accepted or {}).get('reason')})"
    )
    if report.action != "off":
        typer.echo(report.line())


@app.command("baselines")
def baselines(
    recipe: Annotated[str | None, typer.Option("--recipe", help="Only this recipe's nightlies.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object for scripts.")] = False,
) -> None:
    """Each kind of nightly (recipe/replica on a backend at a git ref): the run the next one is judged against,
    and its latest verdict."""
    from orchestrator.lineage.store import LineageStore
    from orchestrator.nightly import nightly_kinds, short_commit
    from orchestrator.settings import load_settings

    with LineageStore.open(load_settings(), create=False) as store:
        kinds = nightly_kinds(store, recipe=recipe)
    if json_out:
        print_json({"nightlies": kinds})
        return
    if not kinds:
        typer.echo(f"no nightly of {recipe} recorded" if recipe else "no nightly recorded")
        return
    for kind in kinds:
        base = kind["baseline"]
        latest = kind["latest"]
        typer.echo(f"{kind['recipe']}/{kind['replica']} on {kind['backend'] or '-'} at {kind['ref']}")
        if base is None:
            typer.echo("  baseline: none (no nightly of this kind passed yet: the next completed one becomes it)")
        else:
            how = (
                f"accepted by {base['accepted']['by']}: {base['accepted']['reason']}"
                if base["accepted"]
                else base["status"]
            )
            typer.echo(
                f"  baseline: {base['id']} {base['started_at'][:16]} commit {short_commit(base['commit'])} ({how})"
            )
        typer.echo(
            f"  latest:   {latest['id']} {latest['started_at'][:16]} commit {short_commit(latest['commit'])} "
            f"{latest['state']} {latest['status']}"
        )
