"""``openlab github``: the experiment-issue link (resolve, publish the card, flush the queue)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from orchestrator.errors import OpenlabError

app = typer.Typer(
    help="Experiment issues on GitHub: lineage card comments, daily digests, labels and the offline queue.",
    no_args_is_help=True,
)

F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(fn: F) -> F:
    """Report an :class:`OpenlabError` as one line on stderr and exit with its code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OpenlabError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@one_line_errors
def sync() -> None:
    """Send the GitHub updates queued while there was no token, no network or a rate limit."""
    from orchestrator.lineage.store import open_store
    from orchestrator.links.github import GithubLinkError, sync_queue

    with open_store() as store:
        report = sync_queue(store)
    typer.echo(
        f"{report.sent} sent, {report.pending} still queued, {report.failed} failed, "
        f"{report.deferred} waiting for a rate-limit reset"
    )
    if report.errors:
        more = f" (+{len(report.errors) - 1} more; `openlab github queue` lists them)" if len(report.errors) > 1 else ""
        raise GithubLinkError(report.errors[0] + more)


@app.command()
@one_line_errors
def queue() -> None:
    """List queued GitHub updates and why each is waiting."""
    from orchestrator.lineage.models import GithubUpdate
    from orchestrator.lineage.store import open_store

    with open_store() as store:
        entries = [u for u in store.list(GithubUpdate) if u.state != "done"]
    if not entries:
        typer.echo("nothing queued")
        return
    for u in sorted(entries, key=lambda e: e.created_at):
        after = f" after {u.not_before:%Y-%m-%d %H:%M:%S} UTC" if u.not_before else ""
        # a card names its pipeline run; a digest, its day (the last part of its queue id)
        run = (
            f" {u.pipeline_run_id}"
            if u.pipeline_run_id
            else (f" {u.id.rsplit(':', 1)[-1]}" if u.action == "digest" else "")
        )
        typer.echo(f"{u.state:<8} {u.action:<8} {u.issue_id}{run} x{u.attempts}{after}: {u.last_error or ''}")


@app.command()
@one_line_errors
def resolve(
    ref: str = typer.Argument(..., help="owner/repo#N, #N (with [github] repo) or an issue URL"),
    pipeline_run: str | None = typer.Option(None, "--pipeline-run", "-p", help="pipeline run id to link it to"),
    required: bool = typer.Option(False, help="fail (exit 2) unless the issue resolves"),
) -> None:
    """Resolve an experiment issue into lineage (and link it to a pipeline run)."""
    from orchestrator.lineage.store import open_store
    from orchestrator.links.github import resolve_issue

    with open_store() as store:
        issue = resolve_issue(store, ref, pipeline_run, required=required)
    status = f"{issue.state}, {issue.title!r}" if issue.resolved else f"unresolved: {issue.last_error}"
    typer.echo(f"{issue.id} ({status})")


@app.command()
@one_line_errors
def publish(pipeline_run: str = typer.Argument(..., help="pipeline run id")) -> None:
    """Create or update the pipeline run's lineage card comment on its linked issues."""
    from orchestrator.lineage.models import PipelineRun
    from orchestrator.lineage.store import open_store
    from orchestrator.links.github import publish_card

    with open_store() as store:
        store.require(PipelineRun, pipeline_run)
        done = publish_card(store, pipeline_run)
    for rec in done:
        typer.echo(f"{rec.issue_id}: {rec.url}")
    if not done:
        typer.echo("no card posted (no linked issue, or queued: `openlab github queue`)")


@app.command()
@one_line_errors
def digest(
    since: str = typer.Option(
        "24h", "--since", help="Start of the window, back from now (24h, 7d) or a date (2026-12-01T07:00)."
    ),
    issue: list[str] = typer.Option(
        [], "--issue", help="Only this experiment issue (owner/repo#N or #N); repeat for several. Default: all."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the comment bodies; send and record nothing."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts (bodies included)."),
) -> None:
    """Post (or update) today's digest comment on each experiment issue with runs in the window.

    One comment per issue and UTC day, edited when run again the same day; quiet issues get nothing.

    Without a token or network the digests are queued for `openlab github sync`.
    """
    from orchestrator.cli.output import print_json
    from orchestrator.lineage.store import open_store
    from orchestrator.links.digest import digest_window, post_digests
    from orchestrator.links.github import GithubConfig, GithubLinkError, parse_issue_ref

    digest_window(since)  # a mistyped --since or --issue is the error to report, before the store
    default_repo = GithubConfig.from_settings().repo
    for ref in issue:
        parse_issue_ref(ref, default_repo)
    with open_store(create=False) as store:
        report = post_digests(store, since=since, issues=issue, dry_run=dry_run)
    if json_out:
        print_json(report.to_dict())
    elif dry_run:
        for d in report.digests:
            more = f", {d.left_out} left out" if d.left_out else ""
            typer.echo(f"--- {d.issue_id}: digest {d.day}, {len(d.runs)} run(s){more}, {len(d.body)} characters ---")
            typer.echo(d.body)
        for quiet in report.quiet:
            typer.echo(f"--- {quiet}: no pipeline run in the window, nothing to post ---")
    else:
        for line in report.lines():
            typer.echo(line)
    if not report.digests and not json_out:
        typer.echo(f"no pipeline run linked to an issue from {report.window.text()}: nothing to post")
    failed = [d for d in report.digests if d.outcome == "failed"]
    if failed:
        more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
        raise GithubLinkError(f"digest on {failed[0].issue_id} not posted: {failed[0].error}{more}")
