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
compared with the last good one, so a regression keeps failing until it is fixed or
the tolerance is changed on purpose.

Noisy metrics carry their own noise. A metric that is one draw of a noisy quantity (a
late-window median of per-step drop fractions) moves between two runs whose training
differs only in float rounding; a fixed tolerance is then either too tight (it fails on
a re-draw) or too loose everywhere. Such a metric names its standard error (``stderr``,
another metric the same stage reports) and the allowance becomes ``sigmas`` times the
standard error of the difference, sqrt(se_prev^2 + se_now^2), never less than the fixed
tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from sqlmodel import col

from orchestrator.errors import ConfigError, NotFoundError, OpenlabError
from orchestrator.lineage.models import PipelineRun, Relation, StageRun, utcnow
from orchestrator.lineage.store import LineageStore

Direction = Literal["either", "higher", "lower"]
Status = Literal["passed", "regressed", "baseline"]

#: Verdict statuses that make a nightly usable as the next run's baseline.
GOOD_STATUSES: frozenset[str] = frozenset({"passed", "baseline"})


class NightlyRegression(OpenlabError):
    """A tracked metric moved beyond the recipe's tolerance since the last good nightly."""

    exit_code = 1

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


@dataclass(frozen=True)
class Tolerance:
    """How far one tracked metric may move before a nightly fails.

    ``rel`` is a fraction of the previous value's magnitude, ``abs`` an absolute amount;
    when both are given both must hold, as :class:`orchestrator.recipes.TrackedMetric` says.
    ``worse`` says which direction is a regression:
    ``"higher"`` (a loss), ``"lower"`` (an accuracy) or ``"either"`` (any change beyond
    the tolerance, the default: an unexplained improvement is also worth a look).
    """

    metric: str
    rel: float | None = None
    abs: float | None = None
    worse: Direction = "either"
    #: The stage that reports the metric; without it, the first stage reporting it counts.
    stage: str | None = None
    #: The metric holding this one's standard error (same stage); see the module docstring.
    stderr: str | None = None
    #: How many standard errors of the difference a change may be (with ``stderr``).
    sigmas: float = 3.0

    def lookup_stderr(self, metrics: Mapping[str, Any]) -> float | None:
        """This metric's standard error in ``metrics``, when the tolerance names one."""
        if self.stderr is None:
            return None
        return Tolerance(self.stderr, stage=self.stage).lookup(metrics)

    def lookup(self, metrics: Mapping[str, Any]) -> float | None:
        """This metric's value in :func:`pipeline_metrics` output (stage-qualified when a stage is named)."""
        if self.stage is not None:
            found = _get(metrics, f"{self.stage}/{self.metric}")
            if found is not None:
                return found
        return _get(metrics, self.metric)

    def allowance(self, previous: float, noise: float | None = None) -> float:
        """The largest change allowed.

        With both fixed tolerances set, both must hold; ``noise`` (the standard error of the
        difference) widens the allowance to ``sigmas * noise`` where that is larger.
        """
        bounds = []
        if self.rel is not None:
            bounds.append(self.rel * abs(previous))
        if self.abs is not None:
            bounds.append(self.abs)
        fixed = min(bounds) if bounds else 0.0
        return fixed if noise is None else max(fixed, self.sigmas * noise)

    def describe(self) -> str:
        parts = []
        if self.rel is not None:
            parts.append(f"{self.rel:.4g} relative")
        if self.abs is not None:
            parts.append(f"{self.abs:.4g} absolute")
        text = " and ".join(parts) or "exact"
        if self.stderr is not None:
            text += f", or {self.sigmas:g} standard errors of the difference ({self.stderr}) if larger"
        return text if self.worse == "either" else f"{text}, {self.worse} is worse"


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if value < 0 or not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number >= 0, got {value!r}")
    return float(value)


def parse_tolerances(spec: Any, where: str = "tracked_metrics") -> list[Tolerance]:
    """Tolerances from recipe data, in any of the shapes a recipe may use.

    - ``{metric: 0.02}``: a relative tolerance;
    - ``{metric: {rel: 0.02, abs: 0.001, worse: higher, stage: eval}}`` (``relative`` and
      ``absolute`` are accepted for ``rel`` and ``abs``, as the recipes spell them);
    - ``[{metric: eval/loss, rel: 0.02}, ...]``;
    - :class:`Tolerance` objects or objects with those attributes (a parsed recipe).
    """
    if spec is None:
        return []
    if isinstance(spec, Tolerance):
        return [spec]
    if isinstance(spec, Mapping):
        items: Iterable[tuple[str, Any]] = spec.items()
    elif isinstance(spec, Iterable) and not isinstance(spec, str | bytes):
        items = []
        for i, entry in enumerate(spec):
            if isinstance(entry, Tolerance):
                items.append((entry.metric, entry))
                continue
            data = dict(entry) if isinstance(entry, Mapping) else _attrs(entry)
            name = data.pop("metric", None) or data.pop("name", None)  # recipes.TrackedMetric uses ``name``
            if not name:
                raise ConfigError(f"{where}[{i}]: needs a 'metric' key")
            items.append((str(name), {k: v for k, v in data.items() if v is not None or k == "stage"}))
    else:
        raise ConfigError(f"{where}: expected a mapping of metric to tolerance, got {type(spec).__name__}")
    out: list[Tolerance] = []
    for metric, value in items:
        key = f"{where}.{metric}"
        if isinstance(value, Tolerance):
            out.append(value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append(Tolerance(metric=str(metric), rel=_number(value, key)))
        else:
            data = value if isinstance(value, Mapping) else _attrs(value)
            known = {
                "rel", "abs", "worse", "relative", "absolute", "direction", "stage", "description", "stderr", "sigmas"
            }
            unknown = sorted(set(data) - known)
            if unknown:
                raise ConfigError(f"{key}: unknown keys {unknown}; use rel, abs, worse, stage, stderr and sigmas")
            stderr = data.get("stderr")
            sigmas = data.get("sigmas")
            if sigmas is not None and stderr is None:
                raise ConfigError(f"{key}.sigmas: needs stderr, the metric holding this one's standard error")
            stage = data.get("stage")
            rel = data.get("rel", data.get("relative"))
            absolute = data.get("abs", data.get("absolute"))
            worse = str(data.get("worse", data.get("direction", "either")) or "either")
            if worse not in ("either", "higher", "lower"):
                raise ConfigError(f"{key}.worse: expected either, higher or lower, got {worse!r}")
            if rel is None and absolute is None:
                raise ConfigError(f"{key}: give rel and/or abs")
            out.append(
                Tolerance(
                    metric=str(metric),
                    rel=None if rel is None else _number(rel, f"{key}.rel"),
                    abs=None if absolute is None else _number(absolute, f"{key}.abs"),
                    worse=worse,  # type: ignore[arg-type]
                    stage=None if stage is None else str(stage),
                    stderr=None if stderr is None else str(stderr),
                    sigmas=3.0 if sigmas is None else _number(sigmas, f"{key}.sigmas"),
                )
            )
    return out


def _attrs(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "model_dump"):
        return dict(obj.model_dump())
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    raise ConfigError(f"cannot read a tolerance from {obj!r}")


@dataclass(frozen=True)
class MetricCheck:
    """One tracked metric compared: both values, the change, the allowance, the outcome."""

    metric: str
    previous: float | None
    current: float | None
    allowed: float | None
    regressed: bool
    note: str = ""
    #: Standard error of the difference, when the tolerance is noise-scaled and both runs report it.
    noise: float | None = None

    @property
    def delta(self) -> float | None:
        if self.previous is None or self.current is None:
            return None
        return self.current - self.previous


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
        return cls(**fields, checks=checks, message=data.get("message", ""), decided_at=data.get("decided_at", ""))


def _fmt(value: float | None) -> str:
    return "missing" if value is None else f"{value:.6g}"


def _short_commit(commit: str | None) -> str:
    if not commit:
        return "unknown commit"
    sha, _, dirty = commit.partition("+")
    return f"{sha[:12]}{'+dirty' if dirty else ''}"


def check_metric(
    tol: Tolerance,
    previous: float | None,
    current: float | None,
    previous_se: float | None = None,
    current_se: float | None = None,
) -> MetricCheck:
    """Compare one metric; a metric that vanished or became NaN is a regression.

    A noise-scaled tolerance whose standard error is missing from either run falls back to the
    fixed tolerance (stricter, never looser), and the note says so.
    """
    if current is None:
        # A nightly that cannot measure a tracked metric guards nothing: fail loudly, never pass.
        note = "no longer reported" if previous is not None else "not reported by this run"
        return MetricCheck(tol.metric, previous, None, None, True, note)
    if previous is None:
        return MetricCheck(tol.metric, None, current, None, False, "not in the previous nightly; not compared")
    if not math.isfinite(current):
        return MetricCheck(tol.metric, previous, current, None, True, "not a finite number")
    noise = None
    note = f"tolerance {tol.describe()}"
    if tol.stderr is not None:
        ses = (previous_se, current_se)
        if all(se is not None and math.isfinite(se) for se in ses):
            noise = math.hypot(*ses)  # type: ignore[arg-type]
            note += f"; standard error of the difference {noise:.4g}"
        else:
            note += f"; {tol.stderr} not reported by both runs, so the fixed tolerance applies"
    allowed = tol.allowance(previous, noise)
    delta = current - previous
    if tol.worse == "higher":
        regressed = delta > allowed
    elif tol.worse == "lower":
        regressed = -delta > allowed
    else:
        regressed = abs(delta) > allowed
    return MetricCheck(tol.metric, previous, current, allowed, regressed, note, noise)


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
        f"previous successful nightly {previous_run_id} at commit {_short_commit(previous_commit)} "
        f"vs this run {pipeline_run_id} at commit {_short_commit(commit)}"
    )
    if bad:
        parts = []
        for c in bad:
            change = ""
            if c.delta is not None and c.previous:
                change = f", {c.delta:+.4g} ({c.delta / abs(c.previous):+.2%})"
            allowed = "" if c.allowed is None else f", allowed ±{c.allowed:.4g}"
            parts.append(
                f"{c.metric}: {_fmt(c.previous)} at {_short_commit(previous_commit)} -> "
                f"{_fmt(c.current)} at {_short_commit(commit)}{change}{allowed} ({c.note})"
            )
        verdict.message = f"nightly regression in {len(bad)} tracked metric(s): " + "; ".join(parts) + f" [{between}]"
    else:
        compared = sum(1 for c in checks if c.previous is not None)
        verdict.message = f"nightly passed: {compared} tracked metric(s) within tolerance [{between}]"
    return verdict


def _get(metrics: Mapping[str, Any], name: str) -> float | None:
    value = metrics.get(name)
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# -- lineage ------------------------------------------------------------------------------


def pipeline_metrics(store: LineageStore, pipeline_run_id: str) -> dict[str, float]:
    """Every metric the run's stages recorded, by name and by ``<stage>/<name>``.

    A reused stage run carries no metrics of its own: they are read from the stage
    run it reused, so an unchanged nightly compares equal to the one it reused.
    """
    stages = store.list(StageRun, pipeline_run_id=pipeline_run_id, order_by=col(StageRun.started_at))
    out: dict[str, float] = {}
    for srun in stages:
        metrics = dict(srun.metrics or {})
        source, seen = srun, {srun.id}
        while not metrics and source.reused_from and source.reused_from not in seen:
            seen.add(source.reused_from)
            found = store.get(StageRun, source.reused_from)
            if found is None:
                break
            source, metrics = found, dict(found.metrics or {})
        for name, value in _flatten_metrics(metrics).items():
            number = _get({"v": value}, "v")
            if number is None:
                continue
            out.setdefault(name, number)
            out[f"{srun.stage}/{name}"] = number
    return out


def _flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten_metrics(value, name))
        else:
            out[name] = value
    return out


def pipeline_commit(store: LineageStore, run: PipelineRun) -> str | None:
    """The commit a pipeline run (or, failing that, its stages) was associated with."""
    candidates = [run.id] + [s.id for s in store.list(StageRun, pipeline_run_id=run.id)]
    for subject in candidates:
        edges = store.list(
            Relation,
            where=[Relation.subject_id == subject, Relation.object_kind == "commit"],
            order_by=col(Relation.created_at),
        )
        if edges:
            return edges[0].object_id
    params = run.params or {}
    return params.get("commit") or params.get("git_sha") or params.get("git_ref")


def previous_nightly(store: LineageStore, run: PipelineRun) -> PipelineRun | None:
    """The latest earlier completed nightly of the same recipe and replica with a good verdict."""
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
        verdict = candidate.verdict or {}
        if verdict.get("status") in GOOD_STATUSES:
            return candidate
    return None


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
                f"this run {run.id} at commit {_short_commit(commit)} is the reference from now on"
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
    unreported = [c.metric for c in verdict.checks if c.current is None]
    if unreported:
        reported = ", ".join(sorted(k for k in current if "/" in k)[:12]) or "none"
        verdict.message = (
            f"nightly cannot judge: tracked metric(s) {', '.join(unreported)} not reported by run {run.id} at commit "
            f"{_short_commit(commit)} (reported: {reported}); fix the recipe's tracked_metrics or the stage. "
            + verdict.message
        )
    if record:
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
    "check_metric",
    "compare_metrics",
    "evaluate_nightly",
    "parse_tolerances",
    "pipeline_commit",
    "pipeline_metrics",
    "previous_nightly",
    "raise_for_verdict",
    "record_verdict",
]
