"""Commit statuses: the nightly's verdict as a check mark on the commit it tested.

A lab reads main's history on GitHub. The nightly replica judges one commit a night, so the
verdict belongs on that commit, as GitHub shows CI: a status with the context
``openlab/nightly (RECIPE/REPLICA)``, ``success`` for a passing (or first, baseline) nightly and
``failure`` for a regression, its description the verdict's first words and its link the
regression issue when there is one (:mod:`orchestrator.links.regressions`). Scanning the commit
list then shows where the metric moved.

Only a clean commit gets a status: a run from a dirty tree tested code no commit holds. Like the
other GitHub updates it never fails the nightly: without a token or network it is queued
(action ``status``) for ``openlab github sync``; a commit GitHub does not know (never pushed) is
one line and not retried. ``[github] commit_statuses = false`` turns it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from orchestrator.lineage.models import GithubIssue, PipelineRun, Relation
from orchestrator.lineage.store import LineageStore
from orchestrator.links.github import GithubLinker, _Failure
from orchestrator.links.refs import IssueRef
from orchestrator.nightly import Verdict
from orchestrator.settings import Settings, load_settings

log = logging.getLogger(__name__)

#: The queue action of a commit status (``GithubUpdate.issue_id`` holds the repository).
ACTION = "status"
#: GitHub keeps at most 140 characters of a status description.
MAX_DESCRIPTION = 140


@dataclass
class StatusReport:
    """``posted``, ``none`` (nothing to post, and why), ``off``, ``queued`` or ``failed``."""

    action: str
    state: str | None = None
    sha: str | None = None
    error: str | None = None

    def line(self) -> str:
        what = f" {self.state} on {self.sha[:12]}" if self.state and self.sha else ""
        why = f": {self.error}" if self.error else ""
        return f"commit status{what}: {self.action}{why}"


def context_of(run: PipelineRun) -> str:
    """The status context: one per recipe and replica, so each nightly has its own line."""
    return f"openlab/nightly ({run.recipe}/{run.replica})"


def _regression_issue_url(store: LineageStore, run: PipelineRun) -> str | None:
    for rel in store.list(Relation, where=[Relation.subject_id == run.id, Relation.role == "regression"]):
        issue = store.get(GithubIssue, rel.object_id)
        if issue is not None and issue.url:
            return issue.url
    return None


def report_status(
    store: LineageStore,
    pipeline_run_id: str,
    *,
    settings: Settings | None = None,
    linker: GithubLinker | None = None,
) -> StatusReport:
    """Post the verdict of nightly ``pipeline_run_id`` as a status on the commit it tested."""
    settings = settings or load_settings()
    linker = linker or GithubLinker(store, settings=settings)
    repo = linker.config.repo
    if not repo or not linker.config.commit_statuses:
        return StatusReport("off")
    run = store.require(PipelineRun, pipeline_run_id)
    if not run.verdict:
        return StatusReport("none", error="the run has no nightly verdict")
    verdict = Verdict.from_dict(run.verdict)
    commit = verdict.commit or ""
    if not commit or "+" in commit or commit.startswith("no-git"):
        return StatusReport(
            "none", error=f"not a clean commit ({commit or 'none recorded'}): no commit holds that code"
        )
    state = "failure" if verdict.status == "regressed" else "success"
    description = (verdict.message or verdict.status)[:MAX_DESCRIPTION]
    target = _regression_issue_url(store, run)
    where = IssueRef(repo, 0)
    try:
        if not linker.has_token:
            raise linker._missing_token()
        gh_commit = linker.client().get_repo(repo).get_commit(commit)
        kwargs = {"state": state, "description": description, "context": context_of(run)}
        if target:
            kwargs["target_url"] = target
        linker._call(where, lambda: gh_commit.create_status(**kwargs))
    except _Failure as failure:
        linker._enqueue(ACTION, where, run.id, failure, issue_id=repo)
        if failure.status == 422:
            failure.message = f"GitHub does not know commit {commit[:12]} in {repo} (was it pushed?)"
        log.warning("commit status of %s not posted: %s", run.id, failure.message)
        return StatusReport("queued" if failure.retryable else "failed", state, commit, failure.message)
    linker._mark_done(ACTION, where, run.id, issue_id=repo)
    return StatusReport("posted", state, commit)


__all__ = ["ACTION", "StatusReport", "context_of", "report_status"]
