"""Lineage cards: a pipeline run or stage run rendered as markdown.

The same card is the body of the experiment issue's comment (GitHub) and the Prefect
markdown artifact, so people discussing a run and people watching it see the same
facts. Rendering is split in two so the output depends on lineage records only:
:func:`collect_pipeline` / :func:`collect_stage` read the records, and
:func:`render_pipeline` / :func:`render_stage` turn them into text without touching
the store, the clock or the environment (the same records always give the same card).

Nothing secret is ever on a card: it shows ids, URLs and metrics that are already
in lineage, and lineage never holds tokens.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlmodel import col

from orchestrator.identity import source_file
from orchestrator.lineage.compare import Aggregate, Comparison, asked_word
from orchestrator.lineage.diff import Section
from orchestrator.lineage.models import (
    Attempt,
    Commit,
    DataSnapshot,
    GithubIssue,
    LineageRecord,
    PipelineRun,
    StageRun,
    WandbRun,
)
from orchestrator.lineage.store import LineageStore
from orchestrator.lineage.usage import attempt_hours
from orchestrator.preregistration import outcome_lines
from orchestrator.recipes import set_words

if TYPE_CHECKING:  # the pipeline imports the cards: only for the hint
    from orchestrator.pipeline.sweep import SweepPlan

#: Hosts whose remotes are turned into web commit links (GitHub Enterprise hosts can be added).
DEFAULT_GITHUB_HOSTS: tuple[str, ...] = ("github.com",)

#: How many metrics a stage shows; the rest stay in lineage.
MAX_METRICS = 8

_STATE_ICONS = {
    "COMPLETED": "✅",
    "REUSED": "♻️",
    "RUNNING": "⏳",
    "PENDING": "🕓",
    "FAILED": "❌",
    "CANCELLED": "⛔",
    "LOST": "❓",
    "PREEMPTED": "⏸️",
}


@dataclass
class StageView:
    """Everything a card says about one stage run, gathered from lineage."""

    stage: StageRun
    attempts: list[Attempt] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    snapshots: list[DataSnapshot] = field(default_factory=list)
    wandb_runs: list[WandbRun] = field(default_factory=list)


@dataclass
class PipelineView:
    """A pipeline run with its stages and the entities linked to it."""

    run: PipelineRun
    stages: list[StageView] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    snapshots: list[DataSnapshot] = field(default_factory=list)
    issues: list[GithubIssue] = field(default_factory=list)
    #: The event that recorded the run's start (``SEQ:HASH``), which the card publishes.
    anchor: str | None = None
    #: The event that recorded the run's end (its state, its error), once it ended: published with the
    #: start's, it proves a failure's record was not deleted afterwards, as the start's alone cannot.
    end_anchor: str | None = None


# -- reading lineage ------------------------------------------------------------------------------
def _linked(store: LineageStore, record_id: str) -> dict[str, list[LineageRecord]]:
    """Records related to ``record_id`` in either direction, by kind, in relation order, unique."""
    from orchestrator.lineage.models import RECORD_TYPES

    out: dict[str, list[LineageRecord]] = {}
    seen: set[str] = set()
    for rel in store.relations(record_id):
        other_kind, other_id = (
            (rel.object_kind, rel.object_id) if rel.subject_id == record_id else (rel.subject_kind, rel.subject_id)
        )
        model = RECORD_TYPES.get(other_kind)
        if model is None or other_id in seen:
            continue
        found = store.get(model, other_id)
        if found is not None:
            seen.add(other_id)
            out.setdefault(other_kind, []).append(found)
    return out


def collect_stage(store: LineageStore, stage_run_id: str) -> StageView:
    """Gather one stage run, its attempts and its linked commits, snapshots and W&B runs."""
    stage = store.require(StageRun, stage_run_id)
    linked = _linked(store, stage.id)
    attempts = store.list(Attempt, stage_run_id=stage.id, order_by=col(Attempt.number))
    return StageView(
        stage=stage,
        attempts=attempts,
        commits=linked.get(Commit.kind, []),  # type: ignore[arg-type]
        snapshots=linked.get(DataSnapshot.kind, []),  # type: ignore[arg-type]
        wandb_runs=linked.get(WandbRun.kind, []),  # type: ignore[arg-type]
    )


def collect_pipeline(store: LineageStore, pipeline_run_id: str) -> PipelineView:
    """Gather a pipeline run, its stage runs (in start order) and what is linked to them."""
    from orchestrator.lineage.verify import anchor_of

    run = store.require(PipelineRun, pipeline_run_id)
    linked = _linked(store, run.id)
    stages = store.list(StageRun, pipeline_run_id=run.id, order_by=col(StageRun.started_at))
    anchor = anchor_of(store, run.id)
    end = anchor_of(store, run.id, last=True) if run.ended_at is not None else None
    return PipelineView(
        run=run,
        stages=[collect_stage(store, s.id) for s in stages],
        commits=linked.get(Commit.kind, []),  # type: ignore[arg-type]
        snapshots=linked.get(DataSnapshot.kind, []),  # type: ignore[arg-type]
        issues=linked.get(GithubIssue.kind, []),  # type: ignore[arg-type]
        anchor=str(anchor) if anchor is not None else None,
        end_anchor=str(end) if end is not None and end != anchor else None,
    )


# -- formatting helpers (pure) --------------------------------------------------------------------
_SCP_REMOTE = re.compile(r"^(?:[\w.-]+@)?(?P<host>[\w.-]+):(?P<path>[^/].*)$")


def commit_url(
    remote_url: str | None, sha: str | None, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS
) -> str | None:
    """The web URL of a commit when its remote is on a GitHub host, else ``None``.

    Accepts ``git@github.com:o/r.git``, ``ssh://git@github.com/o/r``, ``https://github.com/o/r.git``;
    credentials embedded in an https remote are dropped, never shown.
    """
    if not remote_url or not sha:
        return None
    url = remote_url.strip()
    host = path = None
    if "://" in url:
        rest = url.split("://", 1)[1]
        hostpart, _, path = rest.partition("/")
        host = hostpart.rsplit("@", 1)[-1].split(":", 1)[0]
    else:
        m = _SCP_REMOTE.match(url)
        if m:
            host, path = m.group("host"), m.group("path")
    if not host or not path or host.lower() not in {h.lower() for h in github_hosts}:
        return None
    path = path.strip("/")
    if path.endswith(".git"):
        path = path[:-4]
    if path.count("/") != 1:
        return None
    return f"https://{host}/{path}/commit/{sha}"


#: Triggers a person starts from their own account (``prefect``: a flow called in their own Python,
#: as ``make demo`` does); the others run as the account serving the flows.
_BY_HAND = ("terminal", "adopt", "prefect")


def how_started(run: PipelineRun) -> str | None:
    """``terminal, by `ada` ``, ``ui, served by `svc` `` or ``automation "re-run on regress", served
    by `svc` ``: the trigger and the account, worded as what the account did. Prefect's open-source
    server knows no user, so for a run started there the account is the one serving the flows,
    not whoever pressed Run."""
    if not run.trigger and not run.user:
        return None
    text = run.trigger or "unknown trigger"
    automation = ((run.params or {}).get("prefect") or {}).get("automation")
    if automation:
        text += f' "{automation}"'
    if run.user:
        text += f", by `{run.user}`" if run.trigger in _BY_HAND else f", served by `{run.user}`"
    return text


def md_cell(value: Any) -> str:
    """Recorded text safe inside a markdown table cell or line: a ``|`` or a newline would break the
    row, and a ``<`` opens HTML (a proxy's error page in a stage's error began ``<!--``, and the rest
    of the card was a comment nobody saw), so it is written ``&lt;``, which reads as ``<``."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def format_metric(value: Any) -> str:
    """Numbers with 4 significant digits; other values as text."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping) or isinstance(value, list):
        return "…"
    return str(value)


def key_metrics(stage: StageView, limit: int = MAX_METRICS) -> dict[str, Any]:
    """User metrics of a stage: the stage's own metrics first, then W&B summary values.

    W&B's bookkeeping keys (``_step``, ``_runtime``, ``_timestamp``, ``_wandb``) are left out.
    """
    merged: dict[str, Any] = {}
    for run in stage.wandb_runs:
        merged.update({k: v for k, v in (run.summary or {}).items() if not k.startswith("_")})
    merged.update({k: v for k, v in (stage.stage.metrics or {}).items() if not k.startswith("_")})
    scalars = {k: v for k, v in merged.items() if isinstance(v, (int, float, str, bool))}
    return dict(sorted(scalars.items())[:limit])


def commit_text(commit: Commit, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS) -> str:
    """A commit's short sha, linked to its web page when its remote is on GitHub, and whether it was dirty."""
    short = (commit.sha or commit.id)[:8]
    link = commit_url(commit.remote_url, commit.sha, github_hosts)
    text = f"[`{short}`]({link})" if link else f"`{short}`"
    if commit.dirty:
        patch = f" patch `{commit.patch_hash[:12]}`" if commit.patch_hash else ""
        text += f" (dirty{patch})"
    return text


def wandb_text(run: WandbRun) -> str:
    """A W&B run as a link when it has a URL, else its id and where its offline files are; how it
    ended when that was not ``finished`` (a failed or crashed run's curve is why one opens it)."""
    ended = f" {run.state}" if run.state and run.state != "finished" else ""
    if run.url:
        return f"[{run.run_id}]({run.url}){ended}"
    where = f" `{run.local_dir}`" if run.local_dir else ""
    return f"`{run.run_id}` ({run.mode}{ended}{where})"


def state_icon(state: str | None) -> str:
    """The emoji a card shows beside a run or stage state (empty for a state it does not know)."""
    return _STATE_ICONS.get((state or "").upper(), "")


def _asked_used(a: Attempt) -> str:
    """``; asked 8 CPUs, 32G; used 1.9 CPUs on average, peak 3.1 GiB`` (the parts lineage has)."""
    asked = a.resources or {}
    parts = []
    if asked.get("cpus"):
        parts.append(f"{asked['cpus']} CPUs")
    if asked.get("gpus"):
        parts.append(f"{asked['gpus']} GPUs")
    if asked.get("memory"):
        parts.append(str(asked["memory"]))
    text = f"; asked {', '.join(parts)}" if parts else ""
    used = a.used or {}
    if used:
        bits = []
        wall = attempt_hours(a) * 3600 if a.ended_at else 0.0
        if used.get("cpu_seconds") is not None and wall > 0:
            bits.append(f"{float(used['cpu_seconds']) / wall:.2f} CPUs on average")
        if used.get("max_rss_bytes") is not None:
            bits.append(f"peak {int(used['max_rss_bytes']) / 2**30:.2f} GiB")
        if bits:
            text += f"; used {', '.join(bits)}"
    return text


def _job_text(attempts: list[Attempt]) -> str:
    if not attempts:
        return "—"
    last = attempts[-1]
    job = f"{last.backend}:{last.job_id}" if last.job_id else last.backend
    where = f" on `{last.cluster}`" if last.cluster else ""  # which cluster: job ids repeat across them
    suffix = f" (attempt {last.number})" if len(attempts) > 1 or last.number > 1 else ""
    return f"`{job}`{where}{suffix}"


def _verdict_lines(verdict: Mapping[str, Any] | None) -> list[str]:
    if not verdict:
        return []
    status = verdict_status(verdict)
    lines = [f"**Nightly verdict:** {status or 'recorded'}"]
    for key, value in sorted(verdict.items()):
        if key in {"status", "verdict", "result"}:
            continue
        lines.append(f"- {key}: {format_metric(value) if not isinstance(value, (dict, list)) else md_cell(value)}")
    return lines


def verdict_status(verdict: Mapping[str, Any] | None) -> str | None:
    """``passed``, ``regressed`` or ``failed`` from a verdict record, whatever key it uses."""
    if not verdict:
        return None
    for key in ("status", "verdict", "result"):
        value = verdict.get(key)
        if isinstance(value, str) and value:
            return value.lower()
    if verdict.get("regressed") is True:
        return "regressed"
    if verdict.get("passed") is True:
        return "passed"
    if verdict.get("passed") is False:
        return "regressed"
    return None


def _stage_row(view: StageView, github_hosts: Iterable[str]) -> str:
    s = view.stage
    icon = _STATE_ICONS.get(s.state, "")
    ran = f"reused from `{s.reused_from[:12]}`" if s.reused_from else ("reused" if s.state == "REUSED" else "run")
    commits = ", ".join(commit_text(c, github_hosts) for c in view.commits) or "—"
    snaps = ", ".join(f"`{d.id[:12]}`" for d in view.snapshots) or "—"
    wandb = ", ".join(wandb_text(r) for r in view.wandb_runs) or "—"
    metrics = ", ".join(f"{k}={format_metric(v)}" for k, v in key_metrics(view).items()) or "—"
    cells = [
        s.stage,
        f"{icon} {s.state}".strip(),
        ran,
        f"`{s.identity[:12]}`",
        commits,
        snaps,
        _job_text(view.attempts),
        wandb,
        metrics,
    ]
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"


_TABLE_HEAD = (
    "| stage | status | run/reused | identity | commit | data snapshot | job | W&B | key metrics |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


# -- rendering (pure) -----------------------------------------------------------------------------
def render_pipeline(view: PipelineView, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS) -> str:
    """Markdown card of a pipeline run from gathered records (no I/O)."""
    hosts = tuple(github_hosts)
    run = view.run
    title = run.name or run.recipe or run.id
    lines = [f"### openlab pipeline run `{run.id}`: {md_cell(title)}", ""]
    facts = [f"**State:** {_STATE_ICONS.get(run.state, '')} {run.state}".replace("  ", " ")]
    if run.recipe:
        facts.append(f"**Recipe:** `{run.recipe}`")
    if run.replica:
        facts.append(f"**Replica:** `{run.replica}`")
    if run.backend:
        facts.append(f"**Backend:** `{run.backend}`")
    started = how_started(run)
    if started:
        facts.append(f"**Trigger:** {started}")
    if (run.params or {}).get("retry_of"):
        facts.append(f"**Retry of:** `{run.params['retry_of']}`")
    facts.append(f"**Started:** {run.started_at:%Y-%m-%d %H:%M:%S} UTC")
    if run.ended_at:
        facts.append(f"**Ended:** {run.ended_at:%Y-%m-%d %H:%M:%S} UTC")
    lines.append(" · ".join(facts))
    commits = list(view.commits)
    for sv in view.stages:
        commits.extend(c for c in sv.commits if c.id not in {x.id for x in commits})
    if run.run_set:  # values this run set over its recipe (`--set`, the flow's overrides): the experiment
        lines += ["", "**Set for this run:** " + ", ".join(f"`` {w} ``" for w in set_words(run.run_set))]
    if run.sweep:  # one run of a sweep: which, and how to see the sweep's runs side by side
        sweep = run.sweep
        lines += [
            "",
            f"**Sweep:** run {sweep.get('run')} of {sweep.get('of')} of `{sweep.get('id')}` "
            f"(`` openlab lineage compare --sweep {sweep.get('id')} ``)",
        ]
    if run.command:  # what to type to do it again (secrets were masked when it was recorded)
        lines += ["", f"**Command:** `` {shlex.join(run.command)} ``"]  # a double fence: a ` inside stays code
    if commits:
        lines += ["", "**Commit:** " + ", ".join(commit_text(c, hosts) for c in commits)]
    snaps = list(view.snapshots)
    for sv in view.stages:
        snaps.extend(d for d in sv.snapshots if d.id not in {x.id for x in snaps})
    if snaps:
        lines += ["", "**Data snapshots:** " + ", ".join(f"`{d.id[:16]}`" for d in snaps)]
    if view.issues:
        issues = [f"[{i.id}]({i.url})" if i.url else f"{i.id} (unresolved)" for i in view.issues]
        lines += ["", "**Experiment issue:** " + ", ".join(issues)]
    verdict = _verdict_lines(run.verdict)
    if verdict:
        lines += ["", *verdict]
    predicted = outcome_lines(run.preregistration)
    if predicted:
        lines += ["", "**Pre-registered:**", *(f"- {md_cell(line)}" for line in predicted)]
    lines += ["", _TABLE_HEAD]
    lines += [_stage_row(sv, hosts) for sv in view.stages] or ["| _no stages yet_ |  |  |  |  |  |  |  |  |"]
    errors = [(sv.stage.stage, sv.stage.error) for sv in view.stages if sv.stage.error]
    if errors:
        lines += ["", "**Errors:**", *(f"- `{name}`: {md_cell(err)[:300]}" for name, err in errors)]
    if view.anchor:
        lines += [
            "",
            f"**Lineage anchor:** `{view.anchor}`, the event that recorded this run's start (its recipe and "
            "pre-registration included); `openlab lineage verify --anchor` with it, or `--github-anchors`, "
            "proves the log still holds it.",
        ]
    if view.end_anchor:
        lines += [f"**End anchor:** `{view.end_anchor}`, the event that recorded how it ended ({view.run.state})."]
    return "\n".join(lines) + "\n"


def render_stage(view: StageView, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS) -> str:
    """Markdown card of one stage run from gathered records (no I/O)."""
    hosts = tuple(github_hosts)
    s = view.stage
    lines = [f"### openlab stage `{s.stage}` (`{s.id}`)", "", _TABLE_HEAD, _stage_row(view, hosts), ""]
    lines.append(f"- identity: `{s.identity}`")
    if s.pipeline_run_id:
        lines.append(f"- pipeline run: `{s.pipeline_run_id}`")
    adopted = (s.outputs.get("out") or {}).get("adopted_from") if isinstance(s.outputs, dict) else None
    if adopted:
        by = (s.outputs.get("out") or {}).get("adopted_by") or "someone"
        lines.append(f"- adopted from `{md_cell(adopted)}` by {md_cell(by)} (not made by a job openlab ran)")
    for a in view.attempts:
        exit_text = f", exit {a.exit_code}" if a.exit_code is not None else ""
        reason = f", {md_cell(a.reason)}" if a.reason else ""
        lines.append(
            f"- attempt {a.number}: `{a.backend}` job `{a.job_id or '—'}`{f' on `{a.cluster}`' if a.cluster else ''}"
            f" {a.state}{exit_text}{reason}{_asked_used(a)}"
        )
    metrics = key_metrics(view, limit=10_000)
    if metrics:
        lines += ["", "| metric | value |", "|---|---|"]
        lines += [f"| {md_cell(k)} | {md_cell(format_metric(v))} |" for k, v in metrics.items()]
    if s.error:
        lines += ["", f"**Error:** {md_cell(s.error)[:500]}"]
    return "\n".join(lines) + "\n"


def pipeline_card(store: LineageStore, pipeline_run_id: str, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS) -> str:
    """Markdown lineage card of a pipeline run (stages, commits, snapshots, W&B, metrics, verdict)."""
    return render_pipeline(collect_pipeline(store, pipeline_run_id), github_hosts)


def stage_card(store: LineageStore, stage_run_id: str, github_hosts: Iterable[str] = DEFAULT_GITHUB_HOSTS) -> str:
    """Markdown lineage card of one stage run (identity, attempts and jobs, W&B, all metrics)."""
    return render_stage(collect_stage(store, stage_run_id), github_hosts)


_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _short(value: Any) -> str:
    """A changed field's value for a card: a commit or content hash cut to 12 characters."""
    if value is None:
        return "—"
    text = str(value)
    return f"`{text[:12]}`" if _HASH.fullmatch(text) else f"`{md_cell(text)}`"


def render_changes(sections: Iterable[Section], before: str, after: str, limit: int = 25) -> list[str]:
    """What went in differently between two pipeline runs (:func:`orchestrator.lineage.diff.diff_records`),
    as markdown lines for a nightly's verdict: per stage the fields that changed, a source file named
    rather than its two tree hashes. At most ``limit`` lines of fields; the command prints them all."""
    lines = [f"**What went in differently** since `{before}` (`openlab lineage diff {before} {after}`):", ""]
    shown = 0
    unchanged: list[str] = []
    for section in sections:
        if not section.fields:
            unchanged.append(section.name)
            continue
        if section.only_in:  # a stage only one of the two runs had
            where = f"only in `{before}`" if section.only_in == before else "only in this run"
            lines.append(f"- **{md_cell(section.name)}**: {where}")
            continue
        code = [f for c in section.fields if (f := source_file(str(c["path"])))]
        rest = [c for c in section.fields if source_file(str(c["path"])) is None]
        parts = [f"`{md_cell(c['path'])}` {_short(c['old'])} → {_short(c['new'])}" for c in rest]
        if code:
            touched = ""
            if section.commits:  # where to bisect: the commits between the runs that changed that code
                shown_commits = [f"`{sha[:7]}` {md_cell(subject[:72])}" for sha, subject in section.commits[:3]]
                more = f" and {len(section.commits) - 3} more" if len(section.commits) > 3 else ""
                touched = f" (changed by {', '.join(shown_commits)}{more})"
            if section.undone:  # this run is on an older commit or another branch: changes it lacks
                lacked = [f"`{sha[:7]}` {md_cell(subject[:72])}" for sha, subject in section.undone[:3]]
                more = f" and {len(section.undone) - 3} more" if len(section.undone) > 3 else ""
                touched += f" (lacks {', '.join(lacked)}{more}, which `{before}` had)"
            parts.insert(0, "source " + ", ".join(f"`{md_cell(p)}`" for p in code) + touched)
        if shown + len(parts) > limit:
            parts = parts[: max(limit - shown, 0)] + ["…"]
        shown += len(parts)
        lines.append(f"- **{md_cell(section.name)}**: " + "; ".join(parts))
    if unchanged:
        lines.append(f"- unchanged: {', '.join(unchanged)}")
    return lines


def render_comparison(comparison: Comparison | Aggregate, title: str, patterns: Iterable[str] = ()) -> str:
    """A sweep's (or any runs') comparison (:func:`orchestrator.lineage.compare.compare_runs`) as a
    markdown table: one row a run, the values that vary among them, then the metrics; taken over a
    value (:meth:`~orchestrator.lineage.compare.Comparison.over`), one row a group of runs."""
    if isinstance(comparison, Aggregate):
        return _render_aggregate(comparison, title, patterns)
    head = ["run", "state", *comparison.varies, *(comparison.label(c) for c in comparison.columns)]
    lines = [f"### {md_cell(title)}", "", "| " + " | ".join(md_cell(h) for h in head) + " |"]
    lines.append("|" + "---|" * (2 + len(comparison.varies)) + "---:|" * len(comparison.columns))
    for row in comparison.rows:
        asked = [asked_word(row.asked, k) for k in comparison.varies]
        numbers = [format(row.metrics[c], ".6g") if c in row.metrics else "-" for c in comparison.columns]
        lines.append("| " + " | ".join(md_cell(x) for x in (f"`{row.run.id}`", row.run.state, *asked, *numbers)) + " |")
    if comparison.note:
        lines += ["", md_cell(comparison.note)]
    lines += ["", f"`` {comparison.command(patterns)} `` prints it again; `-m '*'` with every metric."]
    return "\n".join(lines) + "\n"


def _render_aggregate(aggregate: Aggregate, title: str, patterns: Iterable[str]) -> str:
    of = aggregate.of
    head = [*aggregate.varies, "runs", *(of.label(c) for c in of.columns)]
    lines = [f"### {md_cell(title)}", "", "| " + " | ".join(md_cell(h) for h in head) + " |"]
    lines.append("|" + "---|" * len(aggregate.varies) + "---:|" * (1 + len(of.columns)))
    for group in aggregate.groups:
        asked = [asked_word(group.rows[0].asked, k) for k in aggregate.varies]
        cells = [*asked, str(len(group.rows)), *(group.spread(c) for c in of.columns)]
        lines.append("| " + " | ".join(md_cell(x) for x in cells) + " |")
    lines += ["", md_cell(aggregate.legend)]
    if of.note:
        lines += ["", md_cell(of.note)]
    command = of.command(patterns, over=aggregate.over)
    lines += ["", f"`` {command} `` prints it again; without `--over`, a row per run."]
    return "\n".join(lines) + "\n"


def render_sweep_plan(planned: SweepPlan, title: str) -> str:
    """A sweep's dry run (:func:`orchestrator.pipeline.sweep.explain_sweep`) as markdown: a row per
    run with each stage's action, then the jobs it would start per stage."""
    trials = planned.trials
    stages = list(trials[0].recipe.stages) if trials else []
    lines = [f"### {md_cell(title)}", "", "| run | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    for trial in trials:
        values = " ".join(set_words(trial.swept or trial.sets))
        actions = planned.actions[trial.number]
        lines.append(
            f"| {trial.number}. `` {md_cell(values)} `` | " + " | ".join(actions.get(s, "-") for s in stages) + " |"
        )
    total = sum(planned.jobs.values())
    jobs = ", ".join(f"{stage} {planned.jobs[stage]}" for stage in stages if planned.jobs.get(stage))
    lines += [
        "",
        f"Nothing was started. It would start {total} job{'s' if total != 1 else ''}" + (f": {jobs}." if jobs else "."),
    ]
    lines += ["`shared`: an earlier run of the sweep runs that stage's identity; this one reuses it once it has."]
    return "\n".join(lines) + "\n"


__all__ = [
    "DEFAULT_GITHUB_HOSTS",
    "PipelineView",
    "StageView",
    "collect_pipeline",
    "collect_stage",
    "commit_text",
    "commit_url",
    "format_metric",
    "key_metrics",
    "pipeline_card",
    "render_changes",
    "render_comparison",
    "render_pipeline",
    "render_sweep_plan",
    "render_stage",
    "stage_card",
    "state_icon",
    "verdict_status",
    "wandb_text",
]
