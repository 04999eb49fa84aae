"""What a bad machine or cluster touched: the outputs its jobs made and everything made from them.

A node turns out to have had bad GPU memory, a driver that miscomputed, a filesystem that lost
writes. The lab needs the list of checkpoints and token shards to distrust, and the later stages
and runs that consumed them: ``openlab lineage affected --host n17 --since 30d``.

The stage runs to start from are those with a job that ran there (``lineage list --host``, any
attempt: a retry that finished elsewhere may have resumed from a checkpoint the bad node wrote).
From each, every output is followed down its lineage (:func:`orchestrator.lineage.trace.trace`),
and a stage run that *reused* an affected one is affected too, with the pipeline runs they belong to
and the W&B runs they logged to (the charts and summaries people compared against).
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass, field
from typing import Any

from sqlmodel import col

from orchestrator.lineage.listing import RecordFilter, list_records
from orchestrator.lineage.models import Artifact, Attempt, PipelineRun, Relation, StageRun, WandbRun
from orchestrator.lineage.store import LineageStore, in_chunks
from orchestrator.lineage.trace import Hops, TraceNode, trace


@dataclass
class Tainted:
    """One affected record and why: the job that ran there, or the record it came from."""

    record: Any
    why: str

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.record.kind, "id": self.record.id, "why": self.why}
        if isinstance(self.record, Artifact):
            out |= {"name": self.record.name, "uri": self.record.uri}
        if isinstance(self.record, StageRun):
            out |= {"stage": self.record.stage, "state": self.record.state}
        if isinstance(self.record, WandbRun):
            out |= {"project": self.record.project, "run_id": self.record.run_id, "url": self.record.url}
        return out


@dataclass
class AffectedReport:
    """Stage runs with a job there, and what descends from them, each in the order found."""

    made_there: list[Tainted] = field(default_factory=list)
    outputs: list[Tainted] = field(default_factory=list)
    stage_runs: list[Tainted] = field(default_factory=list)
    pipeline_runs: list[Tainted] = field(default_factory=list)
    wandb_runs: list[Tainted] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "made_there": [t.to_dict() for t in self.made_there],
            "outputs": [t.to_dict() for t in self.outputs],
            "stage_runs": [t.to_dict() for t in self.stage_runs],
            "pipeline_runs": [t.to_dict() | {"rerun": self.rerun_command(t.record.id)} for t in self.pipeline_runs],
            "wandb_runs": [t.to_dict() for t in self.wandb_runs],
        }

    def stages_to_redo(self, pipeline_run_id: str) -> list[str]:
        """The stages of that run made there or from what was: each must be forced when the run is
        redone, since its identity has not changed (a plain rerun would reuse the very outputs to
        distrust), and those below it too (their inputs' identities have not changed either)."""
        stages: list[str] = []
        for tainted in (*self.made_there, *self.stage_runs):
            if tainted.record.pipeline_run_id == pipeline_run_id and tainted.record.stage not in stages:
                stages.append(tainted.record.stage)
        return stages

    def rerun_command(self, pipeline_run_id: str) -> str:
        """``openlab rerun RUN --force-stage S ...``: that run redone without what it took from there."""
        forced = "".join(f" --force-stage {stage}" for stage in self.stages_to_redo(pipeline_run_id))
        return f"openlab rerun {pipeline_run_id}{forced}"


def affected(store: LineageStore, flt: RecordFilter) -> AffectedReport:
    """What the jobs that ``flt`` picks (``--host``, ``--cluster``, times...) made, and what was
    made from it. A stage run that started before the job it would descend from was submitted is
    left out, with what hangs below it: outputs are content-addressed, so a bad job that wrote the
    same bytes as an earlier good one links to that one's consumers, which never saw its output."""
    report = AffectedReport()
    jobs: list[Attempt] = list_records(store, ["attempt"], flt, limit=None, strict=True).records
    seen: set[str] = set()
    stage_runs: dict[str, StageRun] = {}
    queue: list[tuple[StageRun, dt.datetime]] = []  # (stage run, when what it passes on was made)
    # One query each for the jobs' stage runs and for the stage runs that reused them, not one a job:
    # a bad node may have run thousands of jobs.
    sources = store.get_many(StageRun, (job.stage_run_id for job in jobs))
    reusers_of: dict[str, list[StageRun]] = {source_id: [] for source_id in sources}
    for chunk in in_chunks(sources):
        for reuser in store.list(StageRun, where=[col(StageRun.reused_from).in_(chunk)]):
            reusers_of[reuser.reused_from or ""].append(reuser)
    for job in sorted(jobs, key=lambda a: _utc(a.submitted_at)):
        source = sources.get(job.stage_run_id or "")
        if source is None or source.id in seen:
            continue
        seen.add(source.id)
        where = f" on {job.host}" if job.host else ""
        where += f" of {job.cluster}" if job.cluster not in (None, job.host) else ""  # local: its host
        report.made_there.append(Tainted(source, f"its job {job.job_id} (attempt {job.id}, {job.state}) ran{where}"))
        stage_runs[source.id] = source
        queue.append((source, _utc(job.submitted_at)))

    # Stage runs whose descendants were already walked, with the `since` they were walked with. A
    # walk with an earlier `since` keeps at least as much, so a source walked so needs no trace of
    # its own: a nightly's six stages on one bad node are one walk, not six overlapping ones.
    walked: dict[str, dt.datetime] = {}
    # Everything below the sources read in one walk, a level at a time (a few queries a level, not a
    # few a record), below the earliest `since`: each source's own walk then prunes more, never less.
    below = Hops("down")
    if queue:
        earliest = min(since for _, since in queue)
        below.read(store, [source for source, _ in queue], prune=functools.partial(_started_before, since=earliest))

    def visit(node: TraceNode, since: dt.datetime) -> None:
        for child in node.children:
            record = child.record
            if child.repeated or _started_before(record, since=since):
                continue  # expanded elsewhere in this tree; or ran before the bad output existed
            if isinstance(record, StageRun) and since < walked.get(record.id, _LATEST):
                walked[record.id] = since
            if child.id not in seen:
                seen.add(child.id)
                if isinstance(record, Artifact):
                    report.outputs.append(Tainted(record, f"made by {node.id}"))
                elif isinstance(record, StageRun):  # it read the output, or took the stage run's outputs whole
                    how = "reused" if child.role == "reused" else "used"
                    report.stage_runs.append(Tainted(record, f"{how} {node.id}"))
                    stage_runs[record.id] = record
            visit(child, since)

    while queue:
        start, since = queue.pop(0)
        if walked.get(start.id, _LATEST) > since:
            walked[start.id] = since
            older = functools.partial(_started_before, since=since)
            visit(trace(store, start.id, direction="down", prune=older, hops=below), since)
        reusers = reusers_of.get(start.id)
        if reusers is None:  # a reuser found on the way: not among the first query's
            reusers = store.list(StageRun, where=[col(StageRun.reused_from) == start.id])
        for reuser in reusers:
            if reuser.id not in seen:  # a later run took this stage's outputs as they were
                seen.add(reuser.id)
                report.stage_runs.append(Tainted(reuser, f"reused {start.id}"))
                stage_runs[reuser.id] = reuser
                queue.append((reuser, since))
    runs = store.get_many(PipelineRun, (s.pipeline_run_id for s in stage_runs.values()))
    for srun in stage_runs.values():
        if srun.pipeline_run_id and srun.pipeline_run_id not in seen:
            seen.add(srun.pipeline_run_id)
            run = runs.get(srun.pipeline_run_id)
            if run is not None:
                report.pipeline_runs.append(Tainted(run, f"has {srun.stage} {srun.id}"))
    logged = [
        rel
        for chunk in in_chunks(stage_runs)
        for rel in store.list(
            Relation,
            where=[
                col(Relation.subject_id).in_(chunk),
                Relation.relation == "wasAssociatedWith",
                Relation.object_kind == WandbRun.kind,
            ],
        )
    ]
    found_at = {srun_id: i for i, srun_id in enumerate(stage_runs)}
    wandb_runs = store.get_many(WandbRun, (rel.object_id for rel in logged))
    for rel in sorted(logged, key=lambda r: found_at[r.subject_id]):  # in the order the stage runs were found
        wandb_run = wandb_runs.get(rel.object_id)
        if wandb_run is not None and wandb_run.id not in seen:
            seen.add(wandb_run.id)
            srun = stage_runs[rel.subject_id]
            report.wandb_runs.append(Tainted(wandb_run, f"logged by {srun.stage} {srun.id}"))
    return report


_LATEST = dt.datetime.max.replace(tzinfo=dt.UTC)


def _started_before(record: object, *, since: dt.datetime) -> bool:
    """A stage run that started before ``since``: it cannot have used what was made then."""
    return isinstance(record, StageRun) and _utc(record.started_at) < since


def _utc(when: dt.datetime) -> dt.datetime:
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)  # the store writes UTC; SQLite drops the zone


__all__ = ["AffectedReport", "Tainted", "affected"]
