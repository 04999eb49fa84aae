"""What counts as a regression of one tracked metric: tolerances and the check against them.

A recipe's ``tracked_metrics`` and the nightly verdict (:mod:`orchestrator.nightly`) must
agree on every rule: which keys a tolerance has, that ``sigmas`` needs ``stderr``, how a
noise-scaled allowance is computed. Both take them from here. This module knows nothing of
lineage, so loading a recipe (which validates its tolerances) does not load the store.

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
from dataclasses import asdict, dataclass
from typing import Any, Literal

from orchestrator.errors import ConfigError, choices

Direction = Literal["either", "higher", "lower"]

#: The keys of one tracked metric's tolerance, in the order an error names them.
TOLERANCE_KEYS = ("rel", "abs", "worse", "stage", "stderr", "sigmas", "description")
#: The same three under their long names (``relative``, ``absolute``, ``direction``), also read.
_LONG_NAMES = ("relative", "absolute", "direction")


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
        """This metric's value in :func:`orchestrator.nightly.pipeline_metrics` output.

        Stage-qualified (``stage/metric``) when a stage is named, and only that: pretrain, mid-train
        and post-train report ``eval/code/loss`` too, and when the named stage did not, its bare
        name held the first stage's value, compared as the eval's. Else the first stage reporting it.
        """
        if self.stage is not None:
            return as_number(metrics.get(f"{self.stage}/{self.metric}"))
        return as_number(metrics.get(self.metric))

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
            unknown = sorted(set(data) - {*TOLERANCE_KEYS, *_LONG_NAMES})
            if unknown:
                raise ConfigError(f"{key}.{unknown[0]}: unknown key; {choices(unknown[0], TOLERANCE_KEYS)}")
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
                raise ConfigError(f"{key}: give a tolerance: rel (relative) and/or abs (absolute)")
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
    if not math.isfinite(current):  # before the baseline: a NaN baseline made every later value pass
        return MetricCheck(tol.metric, previous, current, None, True, "not a finite number")
    if previous is None or not math.isfinite(previous):  # an inf baseline allowed any change
        why = "not in the previous nightly" if previous is None else "the previous nightly's is not a finite number"
        return MetricCheck(tol.metric, previous, current, None, False, f"{why}; not compared")
    noise = None
    note = f"tolerance {tol.describe()}"
    if tol.stderr is not None:
        ses = (previous_se, current_se)
        # a negative one ("-1": not computed) widened the allowance as a standard error of 1
        if all(se is not None and math.isfinite(se) and se >= 0 for se in ses):
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


def as_number(value: Any) -> float | None:
    """A metric value as a float; None for what is not a number (missing, a bool, a string, a table)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


__all__ = ["Direction", "MetricCheck", "Tolerance", "as_number", "check_metric", "parse_tolerances"]
