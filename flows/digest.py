"""The daily digest as a deployment: one summary comment per experiment issue, every morning.

People who follow an experiment on its GitHub issue should not have to read a card per run to
know how the last day went. This flow runs :func:`orchestrator.links.digest.post_digests` (what
``openlab github digest`` runs): each issue with a pipeline run in the window gets today's digest
comment, created once and edited if the flow runs again the same day. Each issue's outcome is a
line in the flow's log and a row of a markdown artifact. Without a GitHub token or network the
digests are queued for ``openlab github sync``, which is not a failure; an issue GitHub refuses
outright (gone, no permission) fails the flow run so someone looks. The schedule is ``[prefect]
digest_cron`` (07:00 UTC by default, after the nightlies).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State

from orchestrator.links.digest import DEFAULT_SINCE


def digest_run_name() -> str:
    """``digest since 24h`` (``digest of lab/x#3 since 7d (dry run)``): the run list says which
    digest ran, not two random words."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    issues = params.get("issues") or []
    name = "digest" + (f" of {', '.join(issues)}" if issues else "") + f" since {params.get('since') or DEFAULT_SINCE}"
    return name + (" (dry run)" if params.get("dry_run") else "")


@flow(
    name="github-digest",
    description="Post or update today's digest comment on each experiment issue with pipeline runs in the window.",
    flow_run_name=digest_run_name,
)
def github_digest(
    since: str = DEFAULT_SINCE, issues: list[str] | None = None, dry_run: bool = False
) -> dict[str, Any] | State[Any]:
    """Summarise each experiment issue's pipeline runs of the window in one comment per issue and day.

    Args:
        since: Start of the window: a span back from now (24h, 7d) or a date (2026-12-01T07:00).
        issues: Only these issues (owner/repo#N, or #N with [github] repo); empty: every issue with runs.
        dry_run: Render the digests into the log and the artifact; post and record nothing.
    """
    from prefect.artifacts import create_markdown_artifact

    from flows.pipeline import failed_run
    from orchestrator.cards import md_cell
    from orchestrator.errors import OpenlabError
    from orchestrator.lineage.store import LineageStore
    from orchestrator.links.digest import digest_summary, post_digests

    logger = get_run_logger()
    try:  # "7 days" for since, a malformed issue: one line naming the field, not a traceback
        with LineageStore.open() as store:
            report = post_digests(store, since=since, issues=issues or (), dry_run=dry_run)
    except OpenlabError as exc:
        return failed_run(exc)
    for digest in report.digests:
        (logger.warning if digest.outcome in ("queued", "failed") else logger.info)(digest.line())
    for line in report.quiet_lines():
        logger.info(line)
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(digest_summary(report).items()))
    headline = (
        f"digest {report.window.day} ({report.window.text()}): {counts}"
        if report.digests
        else f"digest {report.window.day}: no pipeline run linked to an issue from {report.window.text()}"
    )
    logger.info(headline)
    rows = [
        "| issue | outcome | runs | comment |",
        "|---|---|---|---|",
        *(
            f"| {md_cell(d.issue_id)} | {md_cell(d.outcome + (f': {d.error}' if d.error else ''))} | "
            f"{md_cell(', '.join(f'`{r.run.id}`' for r in d.runs))} | {f'[comment]({d.url})' if d.url else '—'} |"
            for d in report.digests
        ),
    ]
    markdown = [f"**{headline}**", "", *(rows if report.digests else [])]
    if dry_run:
        markdown += ["", *(f"<details><summary>{d.issue_id}</summary>\n\n{d.body}\n</details>" for d in report.digests)]
    create_markdown_artifact(key="github-digest", markdown="\n".join(markdown), description=headline)
    failed = [d for d in report.digests if d.outcome == "failed"]
    if failed:  # GitHub refused them for good (no right to comment, a locked issue): one line, not a traceback
        said = "; ".join(f"{d.issue_id}: {d.error}" for d in failed)
        return failed_run(OpenlabError(f"{len(failed)} digest(s) not posted: {said}"))
    return {**report.to_dict(), "digests": [d.to_dict(body=False) for d in report.digests]}


__all__ = ["digest_run_name", "github_digest"]
