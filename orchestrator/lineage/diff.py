"""What differs between two recorded runs: what went in (identity fields) and what came out (metrics).

``openlab lineage diff`` answers the morning question after a nightly moved: *tonight's
drop fraction went from 3.1% to 4.5%, and pretrain's ``moe.capacity_factor`` changed*. The
inputs side compares the stage identities field by field (:func:`orchestrator.identity.
diff_identities`); the outputs side compares the numbers each stage recorded, which a reused
stage run takes from the run it reused (:func:`stage_metrics`), so two runs that share a stage
show that stage's metrics as unchanged instead of missing.

Two stage runs are compared as one section named after the stage; two pipeline runs as one
section per stage either ran; any other two records of one kind field by field.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlmodel import col

from orchestrator.errors import ConfigError, OpenlabError
from orchestrator.identity import diff_identities, source_file
from orchestrator.lineage.models import Commit, LineageRecord, PipelineRun, Relation, StageRun
from orchestrator.lineage.store import LineageStore, record_payload
from orchestrator.tolerances import as_number


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"repro": {"ragged": {"late_median_drop": x}}}`` as ``{"repro/ragged/late_median_drop": x}``."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, name))
        else:
            out[name] = value
    return out


def stage_metrics(store: LineageStore, srun: StageRun) -> dict[str, float]:
    """One stage run's numeric metrics, flattened (``eval/code/loss``); a reused stage run's are
    those of the run it reused, which is what the pipeline run actually has for that stage."""
    metrics = dict(srun.metrics or {})
    source, seen = srun, {srun.id}
    while not metrics and source.reused_from and source.reused_from not in seen:
        seen.add(source.reused_from)
        found = store.get(StageRun, source.reused_from)
        if found is None:
            break
        source, metrics = found, dict(found.metrics or {})
    numbers = {name: as_number(value) for name, value in flatten_metrics(metrics).items()}
    return {name: number for name, number in numbers.items() if number is not None}


@dataclass(frozen=True)
class MetricChange:
    """One metric that moved, or that only one of the two runs reported: the other side is None,
    and ``missing_in`` names the run (or stage run) without it and ``why`` says why where lineage
    knows (its stage failed, was cancelled...). A missing metric has not moved: it is not there."""

    metric: str
    old: float | None
    new: float | None
    missing_in: str | None = None
    why: str | None = None

    @property
    def missing(self) -> bool:
        return (self.old is None) != (self.new is None)

    @property
    def delta(self) -> float | None:
        return None if self.old is None or self.new is None else self.new - self.old

    @property
    def relative(self) -> float | None:
        """The change as a fraction of the old value's magnitude; None from zero or a missing side."""
        return None if self.delta is None or not self.old else self.delta / abs(self.old)

    def to_dict(self) -> dict[str, Any]:
        out = {"metric": self.metric, "old": self.old, "new": self.new, "delta": self.delta, "relative": self.relative}
        if self.missing:
            out |= {"missing_in": self.missing_in, "why": self.why}
        return out


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def diff_metrics(
    old: Mapping[str, float],
    new: Mapping[str, float],
    patterns: Iterable[str] = ("*",),
    *,
    sides: tuple[str | None, str | None] = (None, None),
    why: tuple[str | None, str | None] = (None, None),
) -> list[MetricChange]:
    """Every metric matching one of the shell-style ``patterns`` (``eval/*/loss``) whose value
    differs between ``old`` and ``new``, by name; equal values are left out. One reported on a
    side only is missing on the other, named by ``sides`` (the two runs' ids) with ``why``."""
    wanted = list(patterns)
    names = sorted(n for n in old.keys() | new.keys() if _matches(n, wanted))
    changes = []
    for n in names:
        if old.get(n) == new.get(n):
            continue
        gone = 0 if n not in old else 1 if n not in new else None
        changes.append(
            MetricChange(
                n,
                old.get(n),
                new.get(n),
                missing_in=sides[gone] if gone is not None else None,
                why=why[gone] if gone is not None else None,
            )
        )
    return changes


#: States in which a stage run has its outputs: it completed, or took a completed run's.
DONE = ("COMPLETED", "REUSED")


def failure_reason(store: LineageStore, srun: StageRun) -> str | None:
    """Why a stage run did not complete: its error, else its last job's reason."""
    if srun.error:
        return srun.error
    from orchestrator.lineage.models import Attempt

    last = store.list(Attempt, stage_run_id=srun.id, order_by=col(Attempt.number).desc(), limit=1)
    return last[0].reason if last and last[0].reason else None


def _absence(stage: str, srun: StageRun | None) -> str | None:
    """Why a side may lack a stage's metrics: ``pretrain FAILED``, ``pretrain not run``; None when
    it completed (then it simply did not report that metric)."""
    if srun is None:
        return f"{stage} not run"
    return None if srun.state in DONE else f"{stage} {srun.state}"


def _states(store: LineageStore, a: StageRun, b: StageRun) -> dict[str, Any] | None:
    """Each side's state (and the reason of one that did not complete), when one side completed and
    the other did not, or the two did not complete alike (FAILED beside CANCELLED)."""
    if (a.state in DONE and b.state in DONE) or a.state == b.state:
        return None
    out: dict[str, Any] = {"old": a.state, "new": b.state}
    for side, run in (("old", a), ("new", b)):
        if run.state not in DONE:
            out[f"{side}_reason"] = failure_reason(store, run)
    return out


@dataclass
class Section:
    """One stage (or one record kind) of a diff: the input fields and the metrics that differ."""

    name: str
    fields: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[MetricChange] = field(default_factory=list)
    #: How many metrics the patterns picked on either side (so "none moved" can be told from "none matched").
    compared: int = 0
    #: The two runs' commits (``sha`` or ``sha+patch``) when this stage's code changed between them.
    commit_range: tuple[str, str] | None = None
    #: ``(sha, subject)`` of the commits in that range that touched the changed code, newest first;
    #: None when the repository or a commit is not on this machine.
    commits: list[tuple[str, str]] | None = None
    #: ``(sha, subject)`` of the commits the earlier run had and the later one does not that touched
    #: that code (the later run is on an older commit, or another branch): changes undone, which
    #: ``commits`` (old..new) cannot show. None as for ``commits``.
    undone: list[tuple[str, str]] | None = None
    #: The id of the one run that ran this stage, when the other did not (``fields`` then holds
    #: the single change ``stage``, present on one side only, which ``--json`` keeps).
    only_in: str | None = None
    #: ``stage`` (a stage's identity and metrics), or ``run``: what two pipeline runs were asked
    #: to do differently as a whole (values ``--set``, backend, recipe, replica), no metrics.
    kind: str = "stage"
    #: How the stage ended on each side, when one completed (or reused a completed run) and the
    #: other did not: ``{"old": "COMPLETED", "new": "FAILED", "new_reason": "exit code 1: ..."}``.
    #: None when both ended alike (a reuse is a completion: it took a completed run's outputs).
    states: dict[str, Any] | None = None

    @property
    def moved(self) -> list[MetricChange]:
        """The metrics both sides reported, with different values."""
        return [c for c in self.metrics if not c.missing]

    @property
    def missing(self) -> list[MetricChange]:
        """The metrics one side reported and the other did not."""
        return [c for c in self.metrics if c.missing]


#: What two pipeline runs may be asked differently as a whole, beside their stages' identities.
RUN_FIELDS = ("recipe", "replica", "backend")


def run_asked(run: PipelineRun) -> dict[str, Any]:
    """What a pipeline run was asked as a whole: ``set.KEY`` for each value set for it alone
    (``openlab run --set``), then its recipe, replica and backend."""
    return {
        **{f"set.{key}": value for key, value in sorted(run.run_set.items())},
        **{name: getattr(run, name) for name in RUN_FIELDS},
    }


#: What a run is asked beyond :data:`RUN_FIELDS`: the code it ran (``sha+patch`` of a dirty tree) and
#: its recipe file's content (an edit to its pre-registered predictions changes no stage identity).
CODE_FIELDS = ("commit", "recipe_hash")


def run_asked_at(store: LineageStore, run: PipelineRun) -> dict[str, Any]:
    """:func:`run_asked`, and the commit it ran at and its recipe's content hash, both cut short (a
    dirty tree's ``sha+patch`` keeps its mark): runs compared or diffed may span commits."""
    commit = commit_of(store, run)
    short = None
    if commit is not None:
        sha, _, patch = commit.id.partition("+")
        short = sha[:12] + (f"+{patch[:8]}" if patch else "")
    recipe_hash = ((run.params or {}).get("recipe") or {}).get("recipe_hash")
    return {**run_asked(run), "commit": short, "recipe_hash": str(recipe_hash)[:12] if recipe_hash else None}


def run_changes(a: PipelineRun, b: PipelineRun, store: LineageStore | None = None) -> list[dict[str, Any]]:
    """How two pipeline runs were asked differently (:func:`run_asked`; with ``store``, also the
    commit and recipe they ran: :func:`run_asked_at`), values set first. Their stages' identities
    show the effect stage by stage; this names the cause once."""
    old, new = (run_asked(a), run_asked(b)) if store is None else (run_asked_at(store, a), run_asked_at(store, b))
    order = (*RUN_FIELDS, *CODE_FIELDS)
    keys = sorted(
        old.keys() | new.keys(),
        key=lambda k: (not k.startswith("set."), order.index(k) if k in order else 0, k),
    )
    return [{"path": k, "old": old.get(k), "new": new.get(k)} for k in keys if old.get(k) != new.get(k)]


def previous_run(store: LineageStore, run: PipelineRun) -> PipelineRun | None:
    """The latest completed run of ``run``'s recipe and replica that started before it: what a
    person compares a new run with ("what changed since last time, and how did it move?")."""
    if not run.recipe:
        return None
    earlier = store.list(
        PipelineRun,
        where=[PipelineRun.id != run.id, col(PipelineRun.started_at) < run.started_at],
        order_by=col(PipelineRun.started_at).desc(),
        limit=1,
        recipe=run.recipe,
        replica=run.replica,
        state="COMPLETED",
    )
    return earlier[0] if earlier else None


def compare_hint(store: LineageStore, run: PipelineRun) -> str | None:
    """``openlab lineage diff PREVIOUS RUN -m 'eval/*' -m moe/drop_fraction``, when there is a run to compare with."""
    before = previous_run(store, run)
    if before is None:
        return None
    return f"openlab lineage diff {before.id} {run.id} -m 'eval/*' -m moe/drop_fraction"


def commit_of(store: LineageStore, record: LineageRecord) -> Commit | None:
    """The commit a stage run (else its pipeline run) or a pipeline run was recorded at."""
    subjects = [record.id]  # type: ignore[attr-defined]
    if getattr(record, "pipeline_run_id", None):
        subjects.append(record.pipeline_run_id)  # type: ignore[attr-defined]
    for subject in subjects:
        edges = store.list(
            Relation,
            where=[Relation.subject_id == subject, Relation.object_kind == "commit"],
            order_by=col(Relation.created_at),
        )
        for rel in edges:
            found = store.get(Commit, rel.object_id)
            if found is not None:
                return found
    return None


def _code_commits(section: Section, old: Commit | None, new: Commit | None) -> None:
    """Fill ``section``'s commit range and the commits that touched its changed source files."""
    paths = [f for c in section.fields if (f := source_file(str(c["path"])))]
    if not paths or old is None or new is None:
        return
    from orchestrator.provenance.git import commits_touching  # git only when code changed

    section.commit_range = (old.id, new.id)
    if old.sha and new.sha and new.repo_path:
        section.commits = commits_touching(new.repo_path, old.sha, new.sha, paths)
        section.undone = commits_touching(new.repo_path, new.sha, old.sha, paths)  # new..old


def diff_records(
    store: LineageStore, left: LineageRecord, right: LineageRecord, metric_patterns: Iterable[str] = ()
) -> list[Section]:
    """The sections of ``lineage diff`` for two records of one kind; metrics only when
    ``metric_patterns`` names some (stage runs and pipeline runs carry metrics)."""
    if left.kind != right.kind:
        raise OpenlabError(f"cannot diff a {left.kind} with a {right.kind}: give two records of the same kind")
    patterns = list(metric_patterns)
    if left.kind == "stage_run":
        pairs: dict[str, tuple[StageRun | None, StageRun | None]] = {left.stage: (left, right)}  # type: ignore[attr-defined,dict-item]
    elif left.kind == "pipeline_run":
        order = col(StageRun.started_at)
        ls = {s.stage: s for s in store.list(StageRun, pipeline_run_id=left.id, order_by=order)}
        rs = {s.stage: s for s in store.list(StageRun, pipeline_run_id=right.id, order_by=order)}
        base, other = (rs, ls) if len(rs) >= len(ls) else (ls, rs)
        stages = list(base) + [s for s in other if s not in base]  # pipeline order, not the alphabet's
        pairs = {s: (ls.get(s), rs.get(s)) for s in stages}
    else:
        if patterns:
            raise OpenlabError(f"{left.kind} records have no metrics: --metric compares stage runs or pipeline runs")
        pa, pb = record_payload(left), record_payload(right)
        changed = [{"path": k, "old": pa.get(k), "new": pb.get(k)} for k in sorted(pa.keys() | pb.keys())]
        return [Section(left.kind, [c for c in changed if c["old"] != c["new"]])]
    sections = []
    measured: set[str] = set()
    if left.kind == "pipeline_run":
        asked = run_changes(left, right, store)  # type: ignore[arg-type]
        if asked:
            sections.append(Section("run", asked, kind="run"))
    for stage, (a, b) in pairs.items():
        if a is None or b is None:
            fields = [{"path": "stage", "old": stage if a else None, "new": stage if b else None}]
            section = Section(stage, fields, only_in=left.id if a is not None else right.id)
        else:
            section = Section(stage, [c.__dict__ for c in diff_identities(a.identity_fields, b.identity_fields)])
            _code_commits(section, commit_of(store, a), commit_of(store, b))  # a stage run's, else its run's
            section.states = _states(store, a, b)
        if patterns:
            old = stage_metrics(store, a) if a is not None else {}
            new = stage_metrics(store, b) if b is not None else {}
            sides = (left.id, right.id)  # type: ignore[attr-defined]
            why = (_absence(stage, a), _absence(stage, b))
            section.metrics = diff_metrics(old, new, patterns, sides=sides, why=why)
            section.compared = sum(1 for n in old.keys() | new.keys() if _matches(n, patterns))
            measured |= old.keys() | new.keys()
        sections.append(section)
    _refuse_unmatched(patterns, measured)
    return sections


def _refuse_unmatched(patterns: Sequence[str], measured: set[str]) -> None:
    """Refuse a ``--metric`` pattern that matches no metric either side measured (a typo, most
    often), naming the closest: it printed "metrics: none matches --metric" under every stage, and
    beside a pattern that matched, nothing at all. Records that measured nothing are not its fault."""
    import difflib

    for pattern in patterns if measured else ():
        if not any(_matches(name, [pattern]) for name in measured):
            close = difflib.get_close_matches(pattern, sorted(measured), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"-m {pattern}: no metric of these runs matches; {hint}-m '*' shows all {len(measured)} they measured"
            )
