"""Regression issues: a nightly that regresses opens a GitHub issue; the next good nightly closes it.

The nightly's verdict (:mod:`orchestrator.nightly`) fails its flow run and fires an event, but a
failed flow run is easy to miss and an event needs an Automation someone set up. A lab tracks
work in issues, so the regression becomes one: in ``[github] repo``, labelled
``openlab:regression``, titled with the recipe, replica and metrics, its body the table of what
moved (last good value, this value, what the recipe allows), both commits with the compare link
of the range to bisect, and the ``openlab lineage diff`` that names every identity field that
changed between the two runs.

- *One open issue per recipe and replica.* Its body carries ``<!-- openlab:regression=R/P -->``;
  a nightly that regresses while it is open comments on it ("still regressed at …") instead of
  opening another, so a week of red nightlies is one issue with seven comments.
- *Closed by the evidence.* The first nightly of that recipe and replica that passes comments
  "passed again at …" and closes the issue (``state_reason: completed``).
- *Idempotent.* Each comment (and the issue's body) carries the run's own marker
  ``<!-- openlab:regression-run=ID -->``, so sending the same verdict twice (a crash, a
  queued retry) changes nothing.
- *Never fails the nightly.* No token, no network, a rate limit: the report is queued
  (:class:`~orchestrator.lineage.models.GithubUpdate`, action ``regression``) and ``openlab
  github sync`` sends it, rendered again from the verdict in lineage.
- *In lineage.* The issue is recorded as a :class:`~orchestrator.lineage.models.GithubIssue` and
  every run that reported to it is related to it (``wasAssociatedWith``, role ``regression``), so
  ``lineage trace`` of a nightly leads to its regression issue.

``[github] regression_issues = false`` turns it off; ``[github] regression_label`` renames the label.
"""

from __future__ import annotations

import logging
import shlex
import urllib.parse
from dataclasses import dataclass
from typing import Any

from orchestrator.lineage.models import GithubIssue, PipelineRun
from orchestrator.lineage.store import LineageStore
from orchestrator.links.github import GithubLinker, _Failure
from orchestrator.links.refs import IssueRef
from orchestrator.nightly import Verdict, asked_ref, short_commit
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

#: The queue action of a regression report (``GithubUpdate.issue_id`` holds the repository).
ACTION = "regression"


def regression_marker(
    recipe: str | None, replica: str | None, backend: str | None = None, ref: str | None = None
) -> str:
    """The hidden line that names a regression issue's nightly: its recipe and replica, and the backend
    and git ref it runs on, as its baseline is kept (:func:`orchestrator.nightly.previous_nightly`).
    Without the last two, a nightly run from the UI on a fix branch, passing against its own baseline,
    commented "passed again" on main's issue and closed it while main was still red. ``backend`` and
    ``ref`` left out: the marker issues had before they were named, still read (:func:`_find_open`)."""
    where = f" on {backend or '-'} at {ref}" if ref is not None else ""
    return f"<!-- openlab:regression={recipe or '-'}/{replica or '-'}{where} -->"


def _marker_of(run: PipelineRun) -> str:
    return regression_marker(run.recipe, run.replica, run.backend, asked_ref(run))


def _find_open(open_issues: list[Any], run: PipelineRun) -> Any:
    """The open regression issue of ``run``'s nightly: by its own marker, else (an issue opened before
    markers named the backend and ref) by the recipe and replica alone, for the nightly of main."""
    marker = _marker_of(run)
    found = next((i for i in open_issues if marker in (i.body or "")), None)
    if found is None and asked_ref(run) in ("main", "HEAD"):
        legacy = regression_marker(run.recipe, run.replica)
        found = next((i for i in open_issues if legacy in (i.body or "")), None)
    return found


def run_marker(pipeline_run_id: str) -> str:
    """The hidden line that says a run's verdict was already reported (issue body or comment)."""
    return f"<!-- openlab:regression-run={pipeline_run_id} -->"


@dataclass
class RegressionReport:
    """What reporting one nightly's verdict did.

    ``action``: ``opened``, ``commented`` (still regressed), ``closed`` (passed again),
    ``already`` (this run was reported before), ``none`` (nothing to say: passed with no open
    issue, a baseline), ``off`` (no repository, or turned off), ``queued`` or ``failed``.
    """

    action: str
    issue_id: str | None = None
    url: str | None = None
    error: str | None = None

    def line(self) -> str:
        where = f" {self.issue_id}" if self.issue_id else ""
        url = f" ({self.url})" if self.url else ""
        why = f": {self.error}" if self.error else ""
        return f"regression issue{where}: {self.action}{url}{why}"


def web_url(linker: GithubLinker) -> str:
    """GitHub's web root for the configured API (``https://github.com``, or an Enterprise host)."""
    base = linker.config.base_url.rstrip("/")
    parsed = urllib.parse.urlparse(base)
    if parsed.hostname == "api.github.com":
        return "https://github.com"
    root = base.removesuffix("/api/v3")
    return root if root != base else f"{parsed.scheme}://{parsed.netloc}"


def _compare(linker: GithubLinker, repo: str, verdict: Verdict) -> str | None:
    before, after = (verdict.previous_commit or ""), (verdict.commit or "")
    if not before or not after or "+" in before or "+" in after or before.startswith("no-git"):
        return None  # a dirty tree or no git: no range GitHub knows
    return f"{web_url(linker)}/{repo}/compare/{before[:12]}...{after[:12]}"


def _table(verdict: Verdict) -> list[str]:
    lines = ["| metric | last good | now | allowed |", "|---|---|---|---|"]
    for check in verdict.checks:
        flag = " ❌" if check.regressed else ""
        lines.append(f"| `{check.metric}`{flag} | {check.previous} | {check.current} | {check.allowed} |")
    return lines


def issue_title(run: PipelineRun, verdict: Verdict) -> str:
    metrics = ", ".join(c.metric for c in verdict.regressions) or ("tracked metrics" if verdict.checks else "failed")
    ref = asked_ref(run)
    branch = f" (at {ref})" if ref not in ("main", "HEAD") else ""  # not main's: said where it is seen first
    return f"Nightly regression: {run.recipe}/{run.replica}{branch}: {metrics}"[:250]


def issue_body(linker: GithubLinker, repo: str, run: PipelineRun, verdict: Verdict) -> str:
    """The new issue: what moved, between which commits, and how to find out why."""
    compare = _compare(linker, repo, verdict)
    against = (
        f"compared with the last good nightly `{verdict.previous_run_id}` at `{short_commit(verdict.previous_commit)}`"
        if verdict.previous_run_id
        else "the first nightly of this recipe and replica, with tracked metrics missing"
    )
    lines = [
        _marker_of(run),
        run_marker(run.id),
        f"The nightly **{run.recipe}/{run.replica}** on {run.backend or 'its backend'} at `{asked_ref(run)}` "
        f"regressed at commit `{short_commit(verdict.commit)}` "
        f"(pipeline run `{run.id}`), {against}.",
        "",
        *_table(verdict),
        "",
        verdict.message,
        "",
    ]
    if verdict.previous_run_id:
        metric_flags = "".join(f" -m {shlex.quote(c.metric)}" for c in verdict.regressions)
        lines += [
            f"- Commits to bisect: {compare}" if compare else "- Commits: not a clean range of pushed commits",
            "- What went in differently, stage by stage, and how the regressed metrics moved: "
            f"`openlab lineage diff {verdict.previous_run_id} {run.id}{metric_flags}`",
        ]
    lines += [
        f"- The run's lineage: `openlab lineage trace {run.id}`",
        "",
        f"- A change that moved these on purpose: `openlab nightly accept {run.id} --reason '...'` makes this run "
        "the baseline the next nightly is judged against, and closes this issue",
        "",
        "openlab comments here while the nightly stays regressed and closes this issue when it passes again.",
    ]
    return "\n".join(lines)


def _comment_body(run: PipelineRun, verdict: Verdict, *, passed: bool) -> str:
    head = (
        f"**Passed again** at commit `{short_commit(verdict.commit)}` (pipeline run `{run.id}`): closing."
        if passed
        else f"**Still regressed** at commit `{short_commit(verdict.commit)}` (pipeline run `{run.id}`)."
    )
    return "\n".join([run_marker(run.id), head, "", *_table(verdict), "", verdict.message])


def accepted_marker(pipeline_run_id: str) -> str:
    """The hidden line that says a run's acceptance as the new baseline was reported."""
    return f"<!-- openlab:regression-accepted={pipeline_run_id} -->"


def _acceptance_body(run: PipelineRun, verdict: Verdict) -> str:
    accepted = verdict.accepted or {}
    return "\n".join(
        [
            accepted_marker(run.id),
            f"**Accepted as the new baseline** by {accepted.get('by')} at {accepted.get('at')}: "
            f"{accepted.get('reason')}",
            "",
            f"Pipeline run `{run.id}` at commit `{short_commit(verdict.commit)}` is the baseline the next nightly of "
            f"{run.recipe}/{run.replica} on {run.backend or 'its backend'} at `{asked_ref(run)}` is judged against: "
            "closing.",
        ]
    )


def _enabled(linker: GithubLinker, settings: Settings | None) -> tuple[str | None, str]:
    """(repository, label), the repository None when regression issues are off."""
    from orchestrator.settings import load_settings

    section = (settings or load_settings()).section("github")
    label = str(section.get("regression_label") or "openlab:regression")
    if not linker.config.regression_issues or not linker.config.repo:
        return None, label
    return linker.config.repo, label


def report_verdict(
    store: LineageStore,
    pipeline_run_id: str,
    *,
    settings: Settings | None = None,
    linker: GithubLinker | None = None,
) -> RegressionReport:
    """Open, update or close the regression issue of the nightly ``pipeline_run_id`` from its
    recorded verdict. Never raises for GitHub problems: they are queued (or, when retrying
    cannot help, reported as ``failed``)."""
    linker = linker or GithubLinker(store, settings=settings)
    repo, label = _enabled(linker, settings)
    if repo is None:
        return RegressionReport("off")
    run = store.require(PipelineRun, pipeline_run_id)
    if not run.verdict:
        return RegressionReport("none", error="the run has no nightly verdict")
    verdict = Verdict.from_dict(run.verdict)
    where = IssueRef(repo, 0)  # names the repository in GitHub's error messages until an issue exists
    try:
        report = _report(linker, repo, label, run, verdict, where)
    except _Failure as failure:
        linker._enqueue(ACTION, where, run.id, failure, issue_id=repo)
        action = "queued" if failure.retryable else "failed"
        log.warning("regression issue of %s not updated: %s", run.id, failure.message)
        return RegressionReport(action, error=failure.message)
    linker._mark_done(ACTION, where, run.id, issue_id=repo)
    return report


def accept_and_report(
    store: LineageStore, pipeline_run_id: str, *, reason: str, by: str, settings: Settings | None = None
) -> tuple[Verdict, RegressionReport]:
    """Accept the regressed nightly as the new baseline (:func:`orchestrator.nightly.accept_nightly`) and
    close its regression issue: what ``openlab nightly accept`` and the ``nightly-accept`` flow both do."""
    from orchestrator.nightly import accept_nightly

    verdict = accept_nightly(store, pipeline_run_id, reason=reason, by=by)
    return verdict, report_verdict(store, verdict.pipeline_run_id, settings=settings)


def _report(
    linker: GithubLinker, repo: str, label: str, run: PipelineRun, verdict: Verdict, where: IssueRef
) -> RegressionReport:
    if verdict.status == "baseline":
        return RegressionReport("none")
    if not linker.has_token:
        raise linker._missing_token()
    gh_repo = linker.client().get_repo(repo)
    open_issues = linker._call(where, lambda: list(gh_repo.get_issues(state="open", labels=[label])))
    issue = _find_open(open_issues, run)
    if verdict.accepted:
        return _report_acceptance(linker, repo, gh_repo, run, verdict, issue, where)
    if issue is None and not verdict.passed:
        # GitHub drops the labels of a new issue without a word when the token may not push: found by
        # its label alone, such an issue was opened again every night. Before opening one, every open
        # issue is looked through for the marker (once per red nightly that found none).
        issue = _find_open(linker._call(where, lambda: list(gh_repo.get_issues(state="open"))), run)
    if issue is None and verdict.passed:
        return RegressionReport("none")
    if issue is None:
        body = issue_body(linker, repo, run, verdict)
        title = issue_title(run, verdict)
        issue = linker._call(where, lambda: gh_repo.create_issue(title=title, body=body, labels=[label]))
        _record(linker, repo, issue, run)
        return RegressionReport("opened", f"{repo}#{issue.number}", issue.html_url)
    ref = IssueRef(repo, issue.number)
    already = run_marker(run.id) in (issue.body or "") or any(
        run_marker(run.id) in (c.body or "") for c in linker._call(ref, lambda: list(issue.get_comments()))
    )
    if not already:
        text = _comment_body(run, verdict, passed=verdict.passed)
        linker._call(ref, lambda: issue.create_comment(text))
    if verdict.passed:
        linker._call(ref, lambda: issue.edit(state="closed", state_reason="completed"))
    _record(linker, repo, issue, run)
    action = "already" if already and not verdict.passed else ("closed" if verdict.passed else "commented")
    return RegressionReport(action, ref.id, issue.html_url)


def _report_acceptance(
    linker: GithubLinker, repo: str, gh_repo: Any, run: PipelineRun, verdict: Verdict, issue: Any, where: IssueRef
) -> RegressionReport:
    """Say on the open regression issue that its run was accepted as the new baseline, and close it
    (as not planned: nothing was fixed). No open issue: nothing to say."""
    if issue is None:  # one GitHub dropped the label of is found by its marker
        issue = _find_open(linker._call(where, lambda: list(gh_repo.get_issues(state="open"))), run)
    if issue is None:
        return RegressionReport("none")
    ref = IssueRef(repo, issue.number)
    marker = accepted_marker(run.id)
    if not any(marker in (c.body or "") for c in linker._call(ref, lambda: list(issue.get_comments()))):
        text = _acceptance_body(run, verdict)
        linker._call(ref, lambda: issue.create_comment(text))
    linker._call(ref, lambda: issue.edit(state="closed", state_reason="not_planned"))
    _record(linker, repo, issue, run)
    return RegressionReport("closed", ref.id, issue.html_url)


def _record(linker: GithubLinker, repo: str, issue: Any, run: PipelineRun) -> None:
    """The issue as a lineage record, and the run's link to it."""
    ref = IssueRef(repo, issue.number)
    stored: GithubIssue = linker._record_issue(ref, issue)
    with linker.store.transaction() as tx:
        tx.relate("wasAssociatedWith", run, stored, role="regression")


__all__ = [
    "ACTION",
    "RegressionReport",
    "accept_and_report",
    "accepted_marker",
    "issue_body",
    "issue_title",
    "regression_marker",
    "report_verdict",
    "run_marker",
    "web_url",
]
