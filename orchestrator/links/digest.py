"""The daily digest: one comment per experiment issue and UTC day summarising its pipeline runs.

Marin's GitHub bot posts a daily summary on each experiment issue, so the people who follow an
experiment read one comment a day instead of a card per run. This module does the same from
lineage alone: for a window (the last 24 h by default) it gathers every pipeline run linked to
an issue (``wasAssociatedWith``, as ``lineage list --issue`` finds them) that started or ended in
the window, or was still running when it ended, and renders, per run: recipe and replica, backend,
state, commit (short sha and subject), per-stage states, each failure with its one-line reason,
key metrics (eval losses, ``moe/drop_fraction``, the drops replica's late-window medians),
pre-registered predictions met or missed, the nightly verdict, W&B runs, and the hours its jobs
used (:mod:`orchestrator.lineage.usage`).

Why it is built this way:

- *One comment per issue and day.* The body starts with ``<!-- openlab:digest=YYYY-MM-DD -->``
  (the UTC date of the window's end) and the comment's id is recorded
  (:class:`~orchestrator.lineage.models.GithubDigest`); digesting again the same day edits that
  comment, and a crash between creating it and recording its id is repaired by finding the
  marker, as for the per-run card. Posting goes through :class:`GithubLinker`, so rate limits,
  the offline queue (``openlab github sync``) and token scrubbing are the card's.
- *Quiet issues get nothing.* An issue with no run in the window is not commented on.
- *Rendering is pure.* :func:`collect_digests` reads lineage, :func:`render_digest` turns what
  it read into text, so ``--dry-run`` shows exactly what would be posted.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, or_
from sqlmodel import col, select

from orchestrator.cards import (
    DEFAULT_GITHUB_HOSTS,
    PipelineView,
    collect_pipeline,
    commit_text,
    format_metric,
    how_started,
    state_icon,
    verdict_status,
    wandb_text,
)
from orchestrator.errors import ConfigError
from orchestrator.lineage.diff import stage_metrics
from orchestrator.lineage.listing import RecordFilter, parse_when
from orchestrator.lineage.models import (
    Attempt,
    Commit,
    GithubDigest,
    GithubIssue,
    PipelineRun,
    Relation,
    as_utc,
    utcnow,
)
from orchestrator.lineage.store import LineageStore
from orchestrator.lineage.usage import Usage, usage
from orchestrator.links.github import MAX_BODY, GithubLinker
from orchestrator.links.refs import parse_issue_ref
from orchestrator.preregistration import outcome_lines
from orchestrator.recipes import set_words
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

#: The window a digest covers unless told otherwise: the last day.
DEFAULT_SINCE = "24h"

#: The metrics a digest shows per run (the card has them all): eval losses, the MoE drop
#: fraction, and the drops replica's per-arm late-window medians.
KEY_METRIC = re.compile(r"^eval/.*loss$|(^|/)moe/drop_fraction$|(^|/)late_median_drop$")

#: How many key metrics one run shows at most.
MAX_RUN_METRICS = 10

#: How long a failure's reason may be on a digest line.
MAX_REASON = 200

_FAILED_STATES = frozenset({"FAILED", "CANCELLED", "LOST", "PREEMPTED"})
_ACTIVE_STATES = ("RUNNING", "PENDING")


def digest_marker(day: str) -> str:
    """The hidden HTML marker that identifies an issue's digest comment of one UTC day."""
    return f"<!-- openlab:digest={day} -->"


def digest_record_id(issue_id: str, day: str) -> str:
    """Deterministic lineage id of the (issue, day) digest comment."""
    return "ghd_" + hashlib.sha256(f"{issue_id}@digest={day}".encode()).hexdigest()[:20]


@dataclass(frozen=True)
class DigestWindow:
    """The span a digest covers, ``[start, end)``; its day is the UTC date of ``end``."""

    start: dt.datetime
    end: dt.datetime

    @property
    def day(self) -> str:
        return f"{self.end.astimezone(dt.UTC):%Y-%m-%d}"

    def text(self) -> str:
        return f"{_minutes(self.start, ' ')} to {_minutes(self.end, ' ')} UTC"

    def since_arg(self) -> str:
        """The window's start as ``--since`` of ``openlab lineage list`` reads it."""
        return _minutes(self.start, "T")


def _minutes(when: dt.datetime, sep: str) -> str:
    """``when`` in UTC to the minute, as ``--since`` reads it back: ``2026-12-01T07:00``, and
    ``0001-01-01T00:00`` for a window from the beginning (``%Y`` writes year 1 as ``1``)."""
    return when.astimezone(dt.UTC).replace(tzinfo=None).isoformat(sep=sep, timespec="minutes")


def digest_window(since: str | None = None, *, until: dt.datetime | None = None) -> DigestWindow:
    """The window from ``since`` (``24h``, ``7d``, ``2026-12-01T07:00``: as ``lineage list --since``
    reads it) to ``until`` (now). Raises :class:`ConfigError` for text it cannot read or a window
    that is empty."""
    end = as_utc(until or utcnow())
    start = parse_when(DEFAULT_SINCE if since is None else since, now=end)  # an empty --since is refused
    if start >= end:
        raise ConfigError(
            f"--since {since!r} is not before {end:%Y-%m-%d %H:%M} UTC: give a span back from now (24h, 7d) "
            "or an earlier date"
        )
    return DigestWindow(start=start, end=end)


@dataclass
class RunDigest:
    """What a digest says about one pipeline run, gathered from lineage."""

    view: PipelineView
    #: Key metrics, ``name -> (value, stage that reported it)``; a later stage's value wins.
    metrics: dict[str, tuple[float, str]] = field(default_factory=dict)
    usage: Usage | None = None
    #: One line per failed, cancelled, lost or preempted stage: ``(stage, reason)``.
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def run(self) -> PipelineRun:
        return self.view.run

    def commits(self) -> list[Commit]:
        """The run's commits, then its stages' (a stage may have run at another commit), once each."""
        seen: dict[str, Commit] = {c.id: c for c in self.view.commits}
        for stage in self.view.stages:
            for commit in stage.commits:
                seen.setdefault(commit.id, commit)
        return list(seen.values())

    def to_dict(self) -> dict[str, Any]:
        run = self.run
        checks = (run.preregistration or {}).get("checks", [])
        return {
            "pipeline_run": run.id,
            "recipe": run.recipe,
            "replica": run.replica,
            "run_set": run.run_set,
            "backend": run.backend,
            "trigger": run.trigger,
            "user": run.user,
            "state": run.state,
            "started_at": as_utc(run.started_at).isoformat(),
            "ended_at": as_utc(run.ended_at).isoformat() if run.ended_at else None,
            "commits": [c.sha or c.id for c in self.commits()],
            "stages": {s.stage.stage: s.stage.state for s in self.view.stages},
            "failures": [{"stage": s, "reason": r} for s, r in self.failures],
            "metrics": {name: value for name, (value, _) in self.metrics.items()},
            "predictions": {c.get("metric"): c.get("outcome") for c in checks},
            "verdict": verdict_status(run.verdict),
            "wandb": sorted({w.url or w.run_id for s in self.view.stages for w in s.wandb_runs}),
            "usage": self.usage.to_dict() if self.usage else None,
        }


@dataclass
class IssueDigest:
    """One issue's digest for one window: its runs, the body, and what posting it did."""

    issue_id: str
    window: DigestWindow
    runs: list[RunDigest]
    body: str = ""
    #: Runs whose section did not fit under GitHub's comment limit.
    left_out: int = 0
    #: ``dry run``, ``created``, ``edited``, ``unchanged``, ``queued`` or ``failed``.
    outcome: str = ""
    url: str | None = None
    error: str | None = None

    @property
    def day(self) -> str:
        return self.window.day

    def content_hash(self) -> str:
        """The body's hash without the window's own times: the comment is edited when the runs or what
        they say changed, not because the same day's digest was rendered again a minute later."""
        body = self.body.replace(self.window.text(), "").replace(self.window.since_arg(), "")
        return hashlib.sha256(body.encode()).hexdigest()

    def line(self) -> str:
        """What happened to this digest, in one line (a terminal, a flow log)."""
        where = f" {self.url}" if self.url else ""
        why = f": {self.error}" if self.error else ""
        more = f", {self.left_out} left out" if self.left_out else ""
        return f"{self.issue_id}: digest {self.day} {self.outcome} ({len(self.runs)} run(s){more}){where}{why}"

    def to_dict(self, *, body: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "issue": self.issue_id,
            "day": self.day,
            "since": self.window.start.isoformat(),
            "until": self.window.end.isoformat(),
            "runs": [r.to_dict() for r in self.runs],
            "left_out": self.left_out,
            "outcome": self.outcome,
            "url": self.url,
            "error": self.error,
        }
        if body:
            out["body"] = self.body
        return out


# -- reading lineage ------------------------------------------------------------------------------
def _runs_in_window(store: LineageStore, window: DigestWindow, issue_ids: Sequence[str] | None) -> dict[str, list[str]]:
    """Pipeline run ids per issue id: runs linked to the issue that started or ended in the window,
    or that were still running at its end (a week-long pretrain is news every day it runs)."""
    start, end = window.start, window.end
    active = or_(
        and_(col(PipelineRun.started_at) >= start, col(PipelineRun.started_at) < end),
        and_(col(PipelineRun.ended_at) >= start, col(PipelineRun.ended_at) < end),
        and_(
            col(PipelineRun.ended_at).is_(None),
            col(PipelineRun.state).in_(_ACTIVE_STATES),
            col(PipelineRun.started_at) < end,
        ),
    )
    stmt = (
        select(Relation.object_id, Relation.subject_id)
        .join(PipelineRun, col(PipelineRun.id) == col(Relation.subject_id))
        .where(
            Relation.relation == "wasAssociatedWith",
            Relation.subject_kind == PipelineRun.kind,
            Relation.object_kind == GithubIssue.kind,
            Relation.role != "regression",  # a regression issue gets the nightlies' own comments
            active,
        )
        .order_by(col(PipelineRun.started_at))
    )
    if issue_ids is not None:
        stmt = stmt.where(col(Relation.object_id).in_(list(issue_ids)))
    out: dict[str, list[str]] = {}
    with store.session() as session:
        for issue_id, run_id in session.exec(stmt).all():
            runs = out.setdefault(issue_id, [])
            if run_id not in runs:
                runs.append(run_id)
    return out


def _first_line(text: str | None, limit: int = MAX_REASON) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _failures(view: PipelineView) -> list[tuple[str, str]]:
    """Each stage that did not complete, with why (its error, else its last attempt's reason)."""
    out = []
    for sv in view.stages:
        stage = sv.stage
        if stage.state not in _FAILED_STATES:
            continue
        last: Attempt | None = sv.attempts[-1] if sv.attempts else None
        reason = _first_line(stage.error) or _first_line(last.reason if last else None)
        if not reason and last is not None and last.exit_code is not None:
            reason = f"exit {last.exit_code}"
        out.append((stage.stage, reason or stage.state.lower()))
    if not out and view.run.state in _FAILED_STATES and view.run.error:
        out.append(("run", _first_line(view.run.error)))
    return out


def _key_metrics(store: LineageStore, view: PipelineView) -> dict[str, tuple[float, str]]:
    found: dict[str, tuple[float, str]] = {}
    for sv in view.stages:  # in start order, so the last stage that reports a metric wins
        for name, value in stage_metrics(store, sv.stage).items():
            if KEY_METRIC.search(name):
                found[name] = (value, sv.stage.stage)
    return dict(sorted(found.items())[:MAX_RUN_METRICS])


def collect_digests(
    store: LineageStore, window: DigestWindow, issue_ids: Sequence[str] | None = None
) -> list[IssueDigest]:
    """Every issue (or the ones named) with runs in ``window``, each with its runs gathered; the
    bodies are not rendered yet (:func:`render_digest`). Issues without activity are left out."""
    by_issue = _runs_in_window(store, window, issue_ids)
    digests = []
    for issue_id in sorted(by_issue):
        spent = {
            u.group: u for u in usage(store, RecordFilter(issue=issue_id), by="pipeline_run", now=window.end).groups
        }
        runs = []
        for run_id in by_issue[issue_id]:
            view = collect_pipeline(store, run_id)
            runs.append(
                RunDigest(
                    view=view, metrics=_key_metrics(store, view), usage=spent.get(run_id), failures=_failures(view)
                )
            )
        digests.append(IssueDigest(issue_id=issue_id, window=window, runs=runs))
    return digests


# -- rendering (pure) -----------------------------------------------------------------------------
def _hours(value: float) -> str:
    return f"{value:.2f} h"


def _run_title(run: PipelineRun) -> str:
    what = run.recipe or run.name or run.id
    if run.replica:
        what += f" / {run.replica}"
    on = f" on `{run.backend}`" if run.backend else ""
    return f"#### {state_icon(run.state)} `{run.id}`: {what}{on}: {run.state}".replace("####  ", "#### ")


def render_run(rd: RunDigest, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS) -> str:
    """One run's section of a digest (no I/O)."""
    hosts = tuple(github_hosts)
    run = rd.run
    lines = [_run_title(run), ""]
    commits = rd.commits()
    if commits:
        parts = []
        for c in commits:
            subject = _first_line(c.message, 100)
            parts.append(commit_text(c, hosts) + (f" {subject}" if subject else ""))
        lines.append("- **Commit:** " + ", ".join(parts))
    if run.run_set:  # the values it set over its recipe (`openlab run --set`, a sweep's run)
        lines.append("- **Set for this run:** " + ", ".join(f"`{w}`" for w in set_words(run.run_set)))
    if run.sweep:  # one run of a sweep: the command that puts the sweep's runs side by side
        sweep = run.sweep
        lines.append(
            f"- **Sweep:** run {sweep.get('run')} of {sweep.get('of')} of `{sweep.get('id')}` "
            f"(`openlab lineage compare --sweep {sweep.get('id')}`)"
        )
    how = how_started(run)
    if how:
        lines.append(f"- **Trigger:** {how}")
    started = f"{as_utc(run.started_at):%Y-%m-%d %H:%M} UTC"
    if run.ended_at:
        lines.append(f"- **Ran:** {started} to {as_utc(run.ended_at):%Y-%m-%d %H:%M} UTC")
    elif run.state in _ACTIVE_STATES:
        lines.append(f"- **Still running**, started {started}")
    else:
        lines.append(f"- **Started:** {started}")
    if rd.view.stages:
        stages = " · ".join(f"{sv.stage.stage} {state_icon(sv.stage.state)}".strip() for sv in rd.view.stages)
        lines.append(f"- **Stages:** {stages}")
    for stage, reason in rd.failures:
        lines.append(f"- **Failed:** `{stage}`: {reason}")
    if rd.metrics:
        shown = ", ".join(f"{name} {format_metric(value)} ({stage})" for name, (value, stage) in rd.metrics.items())
        lines.append(f"- **Metrics:** {shown}")
    for line in outcome_lines(run.preregistration):
        lines.append(f"- **Pre-registered:** {_first_line(line, 300)}")
    if run.verdict:
        status = verdict_status(run.verdict) or "recorded"
        message = _first_line(str(run.verdict.get("message") or ""), 300)
        lines.append(f"- **Nightly verdict:** {status}" + (f": {message}" if message else ""))
    wandb: dict[str, str] = {}
    for sv in rd.view.stages:
        for w in sv.wandb_runs:
            wandb.setdefault(w.id, f"{wandb_text(w)} ({sv.stage.stage})")
    if wandb:
        lines.append("- **W&B:** " + ", ".join(wandb.values()))
    if rd.usage is not None:
        u = rd.usage
        so_far = " so far" if run.state in _ACTIVE_STATES else ""
        lost = f", {_hours(u.lost_hours)} lost to failed or preempted jobs" if u.lost_hours else ""
        measured = (
            f" ({u.cpu_hours_used:.2f} CPU-hours used of the {u.cpu_hours_asked_measured:.2f} the measured jobs asked)"
            if u.measured
            else ""
        )
        lines.append(
            f"- **Used{so_far}:** {u.attempts} job(s), {_hours(u.wall_hours)} wall, "
            f"{u.gpu_hours:.2f} GPU-hours, {u.cpu_hours:.2f} CPU-hours{measured}{lost}"
        )
    return "\n".join(lines) + "\n"


def _summary(digest: IssueDigest) -> str:
    states: dict[str, int] = {}
    for rd in digest.runs:
        states[rd.run.state] = states.get(rd.run.state, 0) + 1
    counts = ", ".join(f"{n} {state_icon(s)} {s.lower()}".replace("  ", " ") for s, n in sorted(states.items()))
    wall = sum(rd.usage.wall_hours for rd in digest.runs if rd.usage)
    gpu = sum(rd.usage.gpu_hours for rd in digest.runs if rd.usage)
    n = len(digest.runs)
    return (
        f"{n} pipeline run{'s' if n != 1 else ''} from {digest.window.text()}: {counts} · "
        f"{_hours(wall)} wall, {gpu:.2f} GPU-hours"
    )


def render_digest(
    digest: IssueDigest, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS, *, limit: int = MAX_BODY
) -> str:
    """The digest comment's body, marker first, under ``limit`` characters; sets ``left_out``.

    Runs are added in start order while they fit; the rest are counted in a closing line that
    says how to list them, so a busy day never makes GitHub refuse the whole comment.
    """
    head = [digest_marker(digest.day), f"### openlab daily digest: {digest.day}", "", _summary(digest), ""]
    body = "\n".join(head) + "\n"
    since = digest.window.since_arg()
    sections = [render_run(rd, github_hosts) for rd in digest.runs]
    reserve = 300  # room for the line that counts what was left out
    kept = 0
    for section in sections:
        if len(body) + len(section) + 1 > limit - reserve:
            break
        body += section + "\n"
        kept += 1
    digest.left_out = len(sections) - kept
    if digest.left_out:
        body += (
            f"_{digest.left_out} more run(s) left out to stay under GitHub's comment size limit; "
            f"`openlab lineage list --kind pipeline_run --issue '{digest.issue_id}' --since {since}` lists them._\n"
        )
    return body


# -- posting ------------------------------------------------------------------------------------
@dataclass
class DigestReport:
    """What one digest pass did: the window, each issue's digest, the issues named that were quiet."""

    window: DigestWindow
    digests: list[IssueDigest]
    quiet: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "day": self.window.day,
            "since": self.window.start.isoformat(),
            "until": self.window.end.isoformat(),
            "dry_run": self.dry_run,
            "digests": [d.to_dict() for d in self.digests],
            "quiet": self.quiet,
        }

    def quiet_lines(self) -> list[str]:
        return [f"{issue}: no pipeline run in the window, nothing posted" for issue in self.quiet]

    def lines(self) -> list[str]:
        """One line per issue, for a terminal or a flow log."""
        return [d.line() for d in self.digests] + self.quiet_lines()


def post_digests(
    store: LineageStore,
    *,
    since: str | None = None,
    until: dt.datetime | None = None,
    issues: Sequence[str] = (),
    dry_run: bool = False,
    settings: Settings | None = None,
    linker: GithubLinker | None = None,
) -> DigestReport:
    """Digest the window (``since`` back from ``until``, default the last 24 h) on every issue with
    activity, or on ``issues`` (``owner/repo#N`` or ``#N`` with ``[github] repo``) only.

    ``dry_run`` renders and sends nothing (and records nothing). Otherwise each digest is created
    or edited once per issue and UTC day; GitHub problems are recorded and queued, never raised.
    """
    linker = linker or GithubLinker(store, settings=settings)
    window = digest_window(since, until=until)
    wanted = list(dict.fromkeys(parse_issue_ref(ref, linker.config.repo).id for ref in issues)) or None
    digests = collect_digests(store, window, wanted)
    for digest in digests:
        digest.body = linker.scrub(render_digest(digest, linker.config.web_hosts))
        if dry_run:
            digest.outcome = "dry run"
        else:
            linker.publish_digest(digest)
        log.info("%s", digest.line())
    quiet = [i for i in wanted or [] if i not in {d.issue_id for d in digests}]
    return DigestReport(window=window, digests=digests, quiet=quiet, dry_run=dry_run)


def resend_digest(store: LineageStore, issue_id: str, day: str, linker: GithubLinker) -> IssueDigest | None:
    """Send a queued digest for the window it was made for (``openlab github sync``); ``None`` when
    nothing of it is recorded or its runs are gone, which leaves nothing to send."""
    rec = store.get(GithubDigest, digest_record_id(issue_id, day))
    if rec is None:
        return None
    window = DigestWindow(start=as_utc(rec.window_start), end=as_utc(rec.window_end))
    found = collect_digests(store, window, [issue_id])
    if not found:
        return None
    digest = found[0]
    digest.body = linker.scrub(render_digest(digest, linker.config.web_hosts))
    linker.publish_digest(digest)
    return digest


def digest_summary(report: DigestReport) -> Mapping[str, int]:
    """How many digests ended each way (``created: 2, queued: 1``), for a headline."""
    counts: dict[str, int] = {}
    for d in report.digests:
        counts[d.outcome] = counts.get(d.outcome, 0) + 1
    return counts


__all__ = [
    "DEFAULT_SINCE",
    "DigestReport",
    "DigestWindow",
    "IssueDigest",
    "RunDigest",
    "collect_digests",
    "digest_marker",
    "digest_record_id",
    "digest_summary",
    "digest_window",
    "post_digests",
    "render_digest",
    "render_run",
    "resend_digest",
]
