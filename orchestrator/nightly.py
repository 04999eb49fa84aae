"""The nightly regression verdict: compare a run's tracked metrics with the last good nightly.

A nightly replica of main is only useful if someone reads it; the verdict makes the
reading mechanical. For each metric the recipe tracks (eval loss, MoE drop fraction,
...) the current run's value is compared with the value of the previous *successful*
nightly of the same recipe and replica; a change beyond the recipe's tolerance is a
regression, and the message names the metric, both values and both commits so the
morning reader knows where to bisect.

This module is pure library: no Prefect. :func:`evaluate_nightly` reads lineage,
decides, and records the verdict on :attr:`PipelineRun.verdict` in one transaction
(passed, regressed or baseline alike), so the history of verdicts is itself lineage.
The flow (``flows/nightly.py``) turns a regressed verdict into a failed flow run.

"Previous successful nightly" means: a pipeline run of the same recipe and replica
that completed, carries a verdict (so it was a nightly) and whose verdict was not a
regression. A regressed nightly never becomes the baseline; the next run is again
compared with the last good one, so a regression keeps failing until it is fixed, the
tolerance is changed on purpose, or someone accepts the regressed run as the new normal
(:func:`accept_nightly`, ``openlab nightly accept``: a change of routing that moves the drop
fraction by design), with a reason that is kept on its verdict.

Tolerances, noise-scaled ones included, and the check of one metric against its tolerance
live in :mod:`orchestrator.tolerances`, which recipes share; this module re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from sqlmodel import col

from orchestrator.errors import ConfigError, NotFoundError, OpenlabError
from orchestrator.lineage.diff import commit_of, stage_metrics
from orchestrator.lineage.models import PipelineRun, StageRun, utcnow
from orchestrator.lineage.store import LineageStore
from orchestrator.tolerances import (
    MetricCheck,
    Tolerance,
    check_metric,
    parse_tolerances,
)

Status = Literal["passed", "regressed", "baseline"]

#: Verdict statuses that make a nightly usable as the next run's baseline.
GOOD_STATUSES: frozenset[str] = frozenset({"passed", "baseline"})


class NightlyRegression(OpenlabError):
    """A tracked metric moved beyond the recipe's tolerance since the last good nightly."""

    exit_code = 1

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


@dataclass
class Verdict:
    """The nightly's outcome, as recorded on ``PipelineRun.verdict``."""

    status: Status
    pipeline_run_id: str
    commit: str | None
    previous_run_id: str | None = None
    previous_commit: str | None = None
    checks: list[MetricCheck] = field(default_factory=list)
    message: str = ""
    decided_at: str = field(default_factory=lambda: utcnow().isoformat())
    #: Who accepted a regressed run as the new baseline, when and why (``by``, ``at``, ``reason``).
    accepted: dict[str, str] | None = None

    @property
    def passed(self) -> bool:
        return self.status != "regressed"

    @property
    def regressions(self) -> list[MetricCheck]:
        return [c for c in self.checks if c.regressed]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        checks = [MetricCheck(**c) for c in data.get("checks", [])]
        fields = {k: data.get(k) for k in ("status", "pipeline_run_id", "commit", "previous_run_id", "previous_commit")}
        accepted = data.get("accepted")
        return cls(
            **fields,
            checks=checks,
            message=data.get("message", ""),
            decided_at=data.get("decided_at", ""),
            accepted=dict(accepted) if isinstance(accepted, Mapping) else None,
        )


def is_good_verdict(verdict: Mapping[str, Any] | None) -> bool:
    """Whether a recorded verdict makes its run a baseline for the nightlies after it: it passed, it
    was the first, or its regression was accepted as the new normal (:func:`accept_nightly`)."""
    verdict = verdict or {}
    return verdict.get("status") in GOOD_STATUSES or bool(verdict.get("accepted"))


def _fmt(value: float | None) -> str:
    return "missing" if value is None else f"{value:.6g}"


def short_commit(commit: str | None) -> str:
    if not commit:
        return "unknown commit"
    sha, _, dirty = commit.partition("+")
    return f"{sha[:12]}{'+dirty' if dirty else ''}"


def compare_metrics(
    current: Mapping[str, float],
    previous: Mapping[str, float],
    tolerances: Iterable[Tolerance],
    *,
    pipeline_run_id: str,
    commit: str | None,
    previous_run_id: str | None,
    previous_commit: str | None,
) -> Verdict:
    """The verdict for ``current`` against ``previous`` (pure: no lineage access)."""
    checks = [
        check_metric(t, t.lookup(previous), t.lookup(current), t.lookup_stderr(previous), t.lookup_stderr(current))
        for t in tolerances
    ]
    bad = [c for c in checks if c.regressed]
    status: Status = "regressed" if bad else "passed"
    verdict = Verdict(
        status=status,
        pipeline_run_id=pipeline_run_id,
        commit=commit,
        previous_run_id=previous_run_id,
        previous_commit=previous_commit,
        checks=checks,
    )
    between = (
        f"previous successful nightly {previous_run_id} at commit {short_commit(previous_commit)} "
        f"vs this run {pipeline_run_id} at commit {short_commit(commit)}"
    )
    if bad:
        parts = []
        for c in bad:
            change = ""
            if c.delta is not None and c.previous:
                change = f", {c.delta:+.4g} ({c.delta / abs(c.previous):+.2%})"
            allowed = "" if c.allowed is None else f", allowed ±{c.allowed:.4g}"
            parts.append(
                f"{c.metric}: {_fmt(c.previous)} at {short_commit(previous_commit)} -> "
                f"{_fmt(c.current)} at {short_commit(commit)}{change}{allowed} ({c.note})"
            )
        verdict.message = f"nightly regression in {len(bad)} tracked metric(s): " + "; ".join(parts) + f" [{between}]"
    else:
        compared = sum(1 for c in checks if c.previous is not None)
        verdict.message = f"nightly passed: {compared} tracked metric(s) within tolerance [{between}]"
    return verdict


# -- lineage ------------------------------------------------------------------------------


def pipeline_metrics(store: LineageStore, pipeline_run_id: str) -> dict[str, float]:
    """Every metric the run's stages recorded, by name and by ``<stage>/<name>``.

    A reused stage run carries no metrics of its own: they are read from the stage
    run it reused, so an unchanged nightly compares equal to the one it reused.
    """
    stages = store.list(StageRun, pipeline_run_id=pipeline_run_id, order_by=col(StageRun.started_at))
    out: dict[str, float] = {}
    for srun in stages:
        for name, number in stage_metrics(store, srun).items():
            out.setdefault(name, number)
            out[f"{srun.stage}/{name}"] = number
    return out


def pipeline_commit(store: LineageStore, run: PipelineRun) -> str | None:
    """The commit a pipeline run (or, failing that, its stages) was associated with."""
    for subject in [run, *store.list(StageRun, pipeline_run_id=run.id)]:
        found = commit_of(store, subject)
        if found is not None:
            return found.id
    params = run.params or {}
    return params.get("commit") or params.get("git_sha") or params.get("git_ref")


def asked_ref(run: PipelineRun) -> str:
    """The git ref a run was asked to run (the flow's ``git_ref``; ``HEAD`` for a run from a terminal)."""
    return str(((run.params or {}).get("prefect") or {}).get("git_ref") or "HEAD")


def previous_nightly(store: LineageStore, run: PipelineRun) -> PipelineRun | None:
    """The latest earlier completed nightly of the same recipe and replica, on the same backend and
    asked for the same git ref, with a good verdict. A run of the nightly from the UI on a branch,
    or on another backend, is judged against its own kind and never becomes the baseline the next
    scheduled nightly of ``main`` is judged against."""
    candidates = store.list(
        PipelineRun,
        where=[
            PipelineRun.id != run.id,
            col(PipelineRun.started_at) < run.started_at,
            col(PipelineRun.verdict).is_not(None),
        ],
        order_by=col(PipelineRun.started_at).desc(),
        recipe=run.recipe,
        replica=run.replica,
        state="COMPLETED",
    )
    for candidate in candidates:
        if same_nightly(candidate, run) and is_good_verdict(candidate.verdict):
            return candidate
    return None


def same_nightly(a: PipelineRun, b: PipelineRun) -> bool:
    """Whether two nightlies are judged against one baseline: recipe, replica, backend and asked ref."""
    return (a.recipe, a.replica, a.backend, asked_ref(a)) == (b.recipe, b.replica, b.backend, asked_ref(b))


def record_verdict(store: LineageStore, pipeline_run_id: str, verdict: Verdict) -> PipelineRun:
    """Write the verdict onto the pipeline run (one transaction, one logged event)."""
    with store.transaction() as tx:
        run = tx.get(PipelineRun, pipeline_run_id)
        if run is None:
            raise NotFoundError(f"no pipeline run {pipeline_run_id!r} to record a nightly verdict on")
        return tx.update(run, verdict=verdict.to_dict())


def evaluate_nightly(
    store: LineageStore, pipeline_run_id: str, tolerances: Iterable[Tolerance], *, record: bool = True
) -> Verdict:
    """Decide the nightly verdict for a finished pipeline run and record it in lineage.

    Without an earlier good nightly the run becomes the baseline. Raising on a
    regression is left to the caller (see :func:`raise_for_verdict`), so the verdict is
    recorded in both cases before anything fails.
    """
    run = store.get(PipelineRun, pipeline_run_id)
    if run is None:
        raise NotFoundError(f"no pipeline run {pipeline_run_id!r}")
    tolerances = list(tolerances)
    commit = pipeline_commit(store, run)
    current = pipeline_metrics(store, run.id)
    before = previous_nightly(store, run)
    if before is None:
        checks = [check_metric(t, None, t.lookup(current)) for t in tolerances]
        missing = [c.metric for c in checks if c.regressed]
        verdict = Verdict(
            status="regressed" if missing else "baseline",
            pipeline_run_id=run.id,
            commit=commit,
            checks=checks,
            message=(
                f"nightly baseline: no earlier successful nightly of {run.recipe}/{run.replica}; "
                f"this run {run.id} at commit {short_commit(commit)} is the reference from now on"
            ),
        )
    else:
        verdict = compare_metrics(
            current,
            pipeline_metrics(store, before.id),
            tolerances,
            pipeline_run_id=run.id,
            commit=commit,
            previous_run_id=before.id,
            previous_commit=pipeline_commit(store, before),
        )
    if not tolerances:  # compared nothing: a green verdict (and commit status) would guard nothing
        verdict.status = "regressed"
        verdict.message = (
            f"nightly cannot judge: recipe {run.recipe} tracks no metric of the stages replica {run.replica} runs; "
            "add tracked_metrics for them (a nightly that compares nothing would pass whatever it measured). "
            + verdict.message
        )
    unreported = [c.metric for c in verdict.checks if c.current is None]
    if unreported:
        reported = ", ".join(sorted(k for k in current if "/" in k)[:12]) or "none"
        verdict.message = (
            f"nightly cannot judge: tracked metric(s) {', '.join(unreported)} not reported by run {run.id} at commit "
            f"{short_commit(commit)} (reported: {reported}); fix the recipe's tracked_metrics or the stage. "
            + verdict.message
        )
    if record:
        record_verdict(store, run.id, verdict)
    return verdict


def failed_nightly(store: LineageStore, pipeline_run_id: str, error: str, *, record: bool = True) -> Verdict:
    """The verdict of a nightly whose pipeline failed before it could be judged (a stage diverged
    and crashed, a job ran out of memory): regressed, naming the failure, and recorded as any
    verdict is, so the event, the regression issue and the commit's status say it too. Without it
    the worst regression, a training that no longer finishes, paged nobody. Never a baseline."""
    run = store.get(PipelineRun, pipeline_run_id)
    if run is None:
        raise NotFoundError(f"no pipeline run {pipeline_run_id!r}")
    commit = pipeline_commit(store, run)
    verdict = Verdict(
        status="regressed",
        pipeline_run_id=run.id,
        commit=commit,
        message=(
            f"nightly failed before its verdict: {error} (run {run.id} at commit {short_commit(commit)}; "
            "no tracked metric was compared)"
        ),
    )
    if record:
        record_verdict(store, run.id, verdict)
    return verdict


def nightly_kinds(store: LineageStore, *, recipe: str | None = None) -> list[dict[str, Any]]:
    """Each kind of nightly recorded (recipe, replica, backend, asked git ref), with its latest run and
    the run the next one is judged against (``None`` before one passed), newest kinds first."""
    runs = store.list(
        PipelineRun,
        where=[col(PipelineRun.verdict).is_not(None)],
        order_by=col(PipelineRun.started_at).desc(),
        **({"recipe": recipe} if recipe else {}),
    )
    kinds: dict[tuple[Any, ...], dict[str, Any]] = {}
    for run in runs:
        key = (run.recipe, run.replica, run.backend, asked_ref(run))
        entry = kinds.get(key)
        if entry is None:
            entry = kinds[key] = dict(zip(("recipe", "replica", "backend", "ref"), key, strict=True))
            entry.update(latest=_brief(store, run), baseline=None)
        if entry["baseline"] is None and run.state == "COMPLETED" and is_good_verdict(run.verdict):
            entry["baseline"] = _brief(store, run)
    return list(kinds.values())


def _brief(store: LineageStore, run: PipelineRun) -> dict[str, Any]:
    verdict = run.verdict or {}
    return {
        "id": run.id,
        "started_at": run.started_at.isoformat(),
        "state": run.state,
        "status": verdict.get("status"),
        "commit": pipeline_commit(store, run),
        "accepted": verdict.get("accepted"),
    }


def accept_nightly(store: LineageStore, run_id: str, *, reason: str, by: str) -> Verdict:
    """Accept the regressed nightly ``run_id`` as the baseline the next nightly of its kind is judged
    against, recording who, when and why on its verdict (one transaction, one logged event). Its
    status stays ``regressed``: the history says what the numbers did, and that someone chose it.

    Refused in one line, changing nothing: a run that is not a judged nightly, one that did not
    complete (no metrics to judge against), one missing a tracked metric (the next nightly would
    pass that metric unjudged), one that passed already, one accepted already, and one a later good
    nightly of its kind has already replaced (accepting it would change nothing)."""
    from orchestrator.secrets import scrub

    reason = " ".join(reason.split())
    if not reason:
        raise ConfigError("--reason is empty: say why this regression is the new normal (an issue, a change)")
    run = store.find(run_id)
    if not isinstance(run, PipelineRun):
        raise ConfigError(f"{run_id} is a {run.kind}, not a pipeline run: accept takes a nightly's run (prun_…)")
    if not run.verdict:
        raise ConfigError(f"{run.id} has no nightly verdict: only a judged nightly can become the baseline")
    verdict = Verdict.from_dict(run.verdict)
    if verdict.accepted:
        raise ConfigError(
            f"{run.id} was accepted already, by {verdict.accepted.get('by')} at {verdict.accepted.get('at')}: "
            f"{verdict.accepted.get('reason')}"
        )
    if verdict.passed:
        raise ConfigError(f"{run.id}'s nightly {verdict.status}: it is a baseline as it stands, nothing to accept")
    if run.state != "COMPLETED":
        raise ConfigError(
            f"{run.id} is {run.state}: a nightly that did not complete has no results to judge the next one "
            "against; fix it, and the next nightly that completes is judged against the last good one"
        )
    missing = [c.metric for c in verdict.checks if c.current is None]
    if missing or not verdict.checks:
        named = ", ".join(missing) or "every tracked metric (it compared none)"
        raise ConfigError(
            f"{run.id} reported no value of {named}: as a baseline it would let the next nightly pass unjudged; "
            "fix the stage or the recipe's tracked_metrics, and accept a nightly that reports them"
        )
    later = [
        r
        for r in store.list(
            PipelineRun,
            where=[PipelineRun.id != run.id, col(PipelineRun.started_at) > run.started_at],
            recipe=run.recipe,
            replica=run.replica,
            state="COMPLETED",
        )
        if same_nightly(r, run) and is_good_verdict(r.verdict)
    ]
    if later:
        newest = max(later, key=lambda r: r.started_at)
        raise ConfigError(
            f"a later nightly of {run.recipe}/{run.replica}, {newest.id}, is the baseline already: accepting "
            f"{run.id} would change nothing"
        )
    verdict.accepted = {"by": by, "at": utcnow().isoformat(), "reason": scrub(reason)}
    verdict.message = f"accepted as the new baseline by {by}: {verdict.accepted['reason']}. {verdict.message}"
    record_verdict(store, run.id, verdict)
    return verdict


def raise_for_verdict(verdict: Verdict) -> Verdict:
    """Raise :class:`NightlyRegression` for a regressed verdict; return it otherwise."""
    if not verdict.passed:
        raise NightlyRegression(verdict)
    return verdict


__all__ = [
    "GOOD_STATUSES",
    "MetricCheck",
    "NightlyRegression",
    "Tolerance",
    "Verdict",
    "accept_nightly",
    "check_metric",
    "compare_metrics",
    "evaluate_nightly",
    "failed_nightly",
    "is_good_verdict",
    "nightly_kinds",
    "parse_tolerances",
    "pipeline_commit",
    "pipeline_metrics",
    "asked_ref",
    "previous_nightly",
    "raise_for_verdict",
    "record_verdict",
    "same_nightly",
]
