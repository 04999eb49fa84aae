"""Several pipeline runs side by side: what each was asked differently, and what it measured.

``lineage diff`` compares two runs field by field. A sweep (``openlab run --set pretrain.lr=X``
for three values of X) asks a different question: which of these runs did best, and what did
each do differently? That is a table, one row a run: the values that vary among the runs (each
``--set``, the backend, the commit), then the metrics the patterns pick, a reused stage's read
through the run it reused (what the pipeline run has for that stage). W&B's runs table answers
it once runs are synced; this answers it offline, from lineage alone, with the commit and data
each number came from one ``lineage show`` away.
"""

from __future__ import annotations

import difflib
import fnmatch
import shlex
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlmodel import col

from orchestrator.errors import ConfigError, choices
from orchestrator.lineage.diff import RUN_FIELDS, run_asked_at, stage_metrics
from orchestrator.lineage.models import PipelineRun, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.recipes import set_value_word

#: What ``lineage compare`` shows without ``--metric``: the held-out losses of ``eval`` and the
#: late-window drop fractions of ``repro``, the numbers a replica is run for. Runs that stopped
#: before either (``--until pretrain``, a sweep of a training value) are compared on the held-out
#: losses of the last stage that measured any (:data:`HELD_OUT_LOSSES`).
DEFAULT_METRICS = ("eval:eval/*/loss", "repro:repro/*/late_median_drop")
#: The held-out losses each training stage also logs under eval's names.
HELD_OUT_LOSSES = "eval/*/loss"


def metric_matches(stage: str, metric: str, patterns: Iterable[str]) -> bool:
    """Whether ``metric`` of ``stage`` is picked: a pattern is a shell pattern of the metric's
    name (``eval/*/loss``), or ``STAGE:PATTERN`` for that stage's alone (``eval:eval/*/loss``:
    post-training logs metrics of the same names as it trains)."""
    for pattern in patterns:
        stage_glob, sep, metric_glob = pattern.rpartition(":")
        if sep and fnmatch.fnmatchcase(stage, stage_glob) and fnmatch.fnmatchcase(metric, metric_glob):
            return True
        if not sep and fnmatch.fnmatchcase(metric, pattern):
            return True
    return False


def asked_word(asked: Mapping[str, Any], key: str) -> str:
    """One value a run was asked, as a table cell: as ``--set`` reads it back, ``-`` where unset."""
    value = asked.get(key)
    return "-" if value is None else set_value_word(value)


_COUNTS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


@dataclass
class Row:
    """One pipeline run of a comparison."""

    run: PipelineRun
    #: What it was asked: ``set.KEY`` per value set for it, ``recipe``, ``replica``, ``backend``, ``commit``.
    asked: dict[str, Any]
    #: ``(stage, metric) -> value`` for the metrics the patterns picked.
    metrics: dict[tuple[str, str], float]

    def to_dict(self, columns: Sequence[tuple[str, str]]) -> dict[str, Any]:
        metrics: dict[str, dict[str, float]] = {}
        for stage, name in columns:
            if (stage, name) in self.metrics:
                metrics.setdefault(stage, {})[name] = self.metrics[(stage, name)]
        return {
            "id": self.run.id,
            "started_at": self.run.started_at.isoformat() if self.run.started_at else None,
            "state": self.run.state,
            "asked": self.asked,
            "metrics": metrics,
        }


@dataclass
class Comparison:
    """Rows of runs, oldest first, with the asked fields that vary among them and the metric columns."""

    rows: list[Row]
    #: The ``asked`` keys whose values are not the same in every row (the others say nothing).
    varies: list[str] = field(default_factory=list)
    #: ``(stage, metric)`` columns, in pipeline order, then by name.
    columns: list[tuple[str, str]] = field(default_factory=list)
    #: What a reader must know to read the columns right (whose metrics they are, when not the default's).
    note: str | None = None
    #: Every metric name the runs measured, picked or not: what a pattern that picks none could have meant.
    measured: list[str] = field(default_factory=list)
    #: Every (stage, metric) the runs measured: what each pattern is checked against.
    measured_keys: list[tuple[str, str]] = field(default_factory=list)

    def check_picked(self, patterns: Sequence[str]) -> None:
        """Refuse each pattern a person typed that picks no metric the runs measured (a typo, most
        often), naming the closest name: one misspelt among several (`-m eval/code/loss -m
        eval/prose/los`) dropped its column without a word. Runs that measured nothing at all are
        not the patterns' fault."""
        if not self.measured:
            return
        for pattern in patterns:
            if any(metric_matches(stage, name, [pattern]) for stage, name in self.measured_keys):
                continue
            close = difflib.get_close_matches(pattern.rpartition(":")[2], self.measured, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"-m {pattern}: no metric of these runs matches; {hint}"
                f"-m '*' shows all {len(self.measured)} they measured"
            )

    def label(self, column: tuple[str, str]) -> str:
        """A column's heading: the metric's name, ``stage:metric`` where two stages report that name."""
        stage, name = column
        return f"{stage}:{name}" if sum(1 for _, n in self.columns if n == name) > 1 else name

    def column(self, name: str) -> tuple[str, str]:
        """The column ``name`` names: its heading, ``STAGE:METRIC``, or its metric's name when one
        stage reports it."""
        matches = [c for c in self.columns if name in (self.label(c), f"{c[0]}:{c[1]}")]
        if not matches:
            matches = [c for c in self.columns if c[1] == name]
        if len(matches) != 1:
            labels = [self.label(c) for c in self.columns]
            if matches:  # one metric several stages report: each column said, to pick one
                count = _COUNTS.get(len(matches), str(len(matches)))
                why = f"names {count} columns ({', '.join(self.label(c) for c in matches)}); give STAGE:METRIC"
            else:
                why = choices(name, labels, label="columns")
            raise ConfigError(f"--sort {name!r}: {why}")
        return matches[0]

    def sorted_by(self, name: str) -> Comparison:
        """The rows ordered by the column ``name`` (:meth:`column`), smallest first (losses, drop
        fractions: the best first); runs without it last."""
        column = self.column(name)
        rows = sorted(self.rows, key=lambda r: (column not in r.metrics, r.metrics.get(column, 0.0)))
        return replace(self, rows=rows)

    def over(self, keys: Sequence[str]) -> Aggregate:
        """The runs grouped by what they were asked but for ``keys`` (``seed``: each group is one
        setting's seeds), each metric as its mean and spread over the group: whether 5.25 against
        5.27 is a difference or the noise between seeds. A key is a varying value's name, with or
        without its ``set.``."""
        over: list[str] = []
        for key in keys:
            name = key if key in self.varies else f"set.{key}"
            if name not in self.varies:
                hint = choices(key, [k.removeprefix("set.") for k in self.varies], label="values that vary")
                raise ConfigError(f"--over {key!r}: not a value that varies among these runs; {hint}")
            over.append(name)
        rest = [k for k in self.varies if k not in over]
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            groups.setdefault(repr([row.asked.get(k) for k in rest]), []).append(row)
        return Aggregate(self, [Group(rows, self.columns) for rows in groups.values()], rest, over)

    @property
    def sweep(self) -> str | None:
        """The sweep every run compared is one of, if they are all of one."""
        ids = {row.run.sweep.get("id") for row in self.rows}
        return ids.pop() if len(ids) == 1 and None not in ids else None

    def command(self, patterns: Iterable[str] = (), sort: str | None = None, over: Iterable[str] = ()) -> str:
        """The ``openlab lineage compare`` that prints this again: its sweep's id or its runs, the
        metric patterns asked for (none: the default), the grouping and the sort."""
        runs = ["--sweep", self.sweep] if self.sweep and len(self.rows) > 1 else [row.run.id for row in self.rows]
        words = ["openlab", "lineage", "compare", *runs]
        for pattern in patterns:
            words += ["-m", pattern]
        for key in over:
            words += ["--over", key.removeprefix("set.")]
        return shlex.join(words + (["--sort", sort] if sort else []))

    def to_dict(self) -> dict[str, Any]:
        return {
            "varies": self.varies,
            "note": self.note,
            "columns": [{"stage": s, "metric": m, "label": self.label((s, m))} for s, m in self.columns],
            "runs": [row.to_dict(self.columns) for row in self.rows],
        }


@dataclass
class Group:
    """Runs asked the same but for the values a comparison is taken over (their seeds)."""

    rows: list[Row]
    columns: list[tuple[str, str]]

    def values(self, column: tuple[str, str]) -> list[float]:
        return [row.metrics[column] for row in self.rows if column in row.metrics]

    def mean(self, column: tuple[str, str]) -> float | None:
        got = self.values(column)
        return statistics.fmean(got) if got else None

    def stdev(self, column: tuple[str, str]) -> float | None:
        """The sample standard deviation; None for fewer than two values."""
        got = self.values(column)
        return statistics.stdev(got) if len(got) > 1 else None

    def spread(self, column: tuple[str, str]) -> str:
        """``5.23 ± 0.042 (n=2)``: the mean, the standard deviation where there are two values or
        more, and how many runs measured it where not all did; ``-`` where none did."""
        mean, sd, n = self.mean(column), self.stdev(column), len(self.values(column))
        if mean is None:
            return "-"
        text = format(mean, ".6g") + (f" ± {sd:.2g}" if sd is not None else "")
        return text + (f" (n={n})" if n != len(self.rows) else "")

    def to_dict(self, varies: Sequence[str]) -> dict[str, Any]:
        metrics: dict[str, dict[str, Any]] = {}
        for column in self.columns:
            got = self.values(column)
            if got:
                stage, name = column
                spread = {"mean": self.mean(column), "stdev": self.stdev(column), "n": len(got)}
                metrics.setdefault(stage, {})[name] = spread
        asked = {key: self.rows[0].asked.get(key) for key in varies}  # what tells this group from the others
        return {"runs": [row.run.id for row in self.rows], "asked": asked, "metrics": metrics}


@dataclass
class Aggregate:
    """A comparison taken over some values (:meth:`Comparison.over`): a group of runs a row."""

    of: Comparison
    groups: list[Group]
    #: The values that vary among the groups.
    varies: list[str]
    #: The values each group's runs differ in (``set.seed``).
    over: list[str]

    @property
    def legend(self) -> str:
        """What a reader is told under the table: what the cells are."""
        over = ", ".join(k.removeprefix("set.") for k in self.over)
        return f"each metric: mean ± standard deviation over {over} (n: how many runs measured it, where not all)"

    def sorted_by(self, name: str) -> Aggregate:
        """The groups ordered by their mean of the column ``name``, smallest first; without it last."""
        column = self.of.column(name)
        means = [(g.mean(column), i) for i, g in enumerate(self.groups)]
        order = sorted(means, key=lambda m: (m[0] is None, m[0] or 0.0, m[1]))
        return replace(self, groups=[self.groups[i] for _, i in order])

    def to_dict(self) -> dict[str, Any]:
        labels = {c: self.of.label(c) for c in self.of.columns}
        return {
            "over": self.over,
            "varies": self.varies,
            "note": self.of.note,
            "columns": [{"stage": s, "metric": m, "label": labels[(s, m)]} for s, m in self.of.columns],
            "groups": [g.to_dict(self.varies) for g in self.groups],
        }


_ORDER = {name: i for i, name in enumerate((*RUN_FIELDS, "commit"))}


def _asked(store: LineageStore, run: PipelineRun) -> dict[str, Any]:
    """:func:`run_asked_at` without the recipe hash, which the runs' own values already explain here."""
    asked = run_asked_at(store, run)
    asked.pop("recipe_hash", None)
    return asked


def compare_runs(store: LineageStore, runs: Iterable[PipelineRun], patterns: Sequence[str]) -> Comparison:
    """The comparison of ``runs`` (each once, oldest first; a sweep's in its order) on the metrics ``patterns`` pick
    (:data:`DEFAULT_METRICS`: see there for runs that measured none of them)."""
    unique = {run.id: run for run in runs}
    ordered = sorted(unique.values(), key=lambda r: (r.started_at, r.id))
    if len({run.sweep.get("id") for run in ordered} - {None}) == 1 and all(run.sweep for run in ordered):
        ordered.sort(key=lambda r: r.sweep.get("run") or 0)  # one sweep's runs: in its grid's order
    stage_order: dict[str, int] = {}
    measured: list[dict[tuple[str, str], float]] = []
    for run in ordered:
        metrics: dict[tuple[str, str], float] = {}
        for srun in store.list(StageRun, pipeline_run_id=run.id, order_by=col(StageRun.started_at)):
            stage_order.setdefault(srun.stage, len(stage_order))
            for name, value in stage_metrics(store, srun).items():
                metrics[(srun.stage, name)] = value
        measured.append(metrics)
    picked = [{k: v for k, v in m.items() if metric_matches(k[0], k[1], patterns)} for m in measured]
    note = None
    if tuple(patterns) == DEFAULT_METRICS and not any(picked):
        losses = {k[0] for m in measured for k in m if metric_matches(k[0], k[1], [HELD_OUT_LOSSES])}
        if losses:  # the runs stopped before eval: the held-out losses of the last stage that has them
            last = max(losses, key=lambda stage: stage_order[stage])
            fallback = [f"{last}:{HELD_OUT_LOSSES}"]
            picked = [{k: v for k, v in m.items() if metric_matches(k[0], k[1], fallback)} for m in measured]
            note = f"the runs stopped before eval: these are the held-out losses {last} measured (`-m {fallback[0]}`)"
    rows = [Row(run, _asked(store, run), metrics) for run, metrics in zip(ordered, picked, strict=True)]
    keys = sorted({k for row in rows for k in row.asked}, key=lambda k: (not k.startswith("set."), _ORDER.get(k, 0), k))
    varies = [k for k in keys if len({repr(row.asked.get(k)) for row in rows}) > 1]
    columns = sorted({c for row in rows for c in row.metrics}, key=lambda c: (stage_order.get(c[0], 0), c[1]))
    measured_names = sorted({name for m in measured for _, name in m})
    return Comparison(rows, varies, columns, note, measured_names, sorted({k for m in measured for k in m}))


__all__ = [
    "DEFAULT_METRICS",
    "HELD_OUT_LOSSES",
    "Aggregate",
    "Comparison",
    "Group",
    "Row",
    "asked_word",
    "compare_runs",
    "metric_matches",
]
