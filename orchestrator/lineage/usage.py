"""What the jobs used: attempts, hours, CPU- and GPU-hours, and the hours lost, grouped.

A lab that runs replicas every night needs to answer "what did the nightlies cost this month,
and how much of it went to failed and preempted jobs" without a scheduler's accounting database
(sacct needs slurmdbd; Docker and a laptop keep none). Lineage already has every attempt with
its start, end, state and what it asked for (:attr:`Attempt.resources`), so the answer is a sum.

- **wall hours**: from a job's start to its end (to now while it runs); a job that never
  started used nothing.
- **CPU-hours / GPU-hours**: wall hours × the CPUs / GPUs the job held: what the backend granted
  where it says (:attr:`Attempt.granted`, Slurm's allocated TRES: a ``--exclusive`` job holds the
  whole node, as ``sacct``'s AllocTRES counts it), else what it *asked* for, counted as the
  launchers ask (and Slurm counts): CPUs per task × tasks, GPUs per node × nodes, so a distributed
  job of 2 nodes × 8 tasks asking 4 CPUs and 8 GPUs holds 64 CPUs and 16 GPUs. A job that asked
  for no CPU count (the backend's default) counts as 1 CPU per task; one that asked for no GPU as 0.
- **lost hours**: the wall hours of attempts that did not complete (failed, preempted,
  cancelled, lost): what a retry or a resume had to redo, at most. Not those of a job stopped
  after saving its checkpoint anew (:attr:`Attempt.progress_saved`), which the next attempt went
  on from: a training longer than a cluster's wall-time cap runs as a chain of such jobs, and
  counting them lost made a month of pretraining read as a month lost.
- **used** (where openlab measures it: :attr:`Attempt.used`, the local backend today): the CPU-hours
  the measured jobs used beside the CPU-hours those same jobs asked for, so a recipe that asks 8
  CPUs and uses 1.5 shows it, and the largest peak resident memory of any of them.

The same filters as ``lineage list`` pick the attempts (:class:`RecordFilter`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.errors import ConfigError, choices
from orchestrator.lineage.listing import RecordFilter, list_records
from orchestrator.lineage.models import Attempt, PipelineRun, StageRun, as_utc, utcnow
from orchestrator.lineage.store import LineageStore

#: What usage can be grouped by.
GROUPS = (
    "recipe",
    "replica",
    "stage",
    "backend",
    "cluster",
    "user",
    "trigger",
    "sweep",
    "state",
    "day",
    "pipeline_run",
)


@dataclass
class Usage:
    """One group's sums."""

    group: str
    attempts: int = 0
    by_state: dict[str, int] = field(default_factory=dict)
    wall_hours: float = 0.0
    cpu_hours: float = 0.0
    gpu_hours: float = 0.0
    lost_hours: float = 0.0
    #: Attempts with a measurement (:attr:`Attempt.used`), their CPU-hours used and asked, and
    #: the largest peak resident memory among them.
    measured: int = 0
    cpu_hours_used: float = 0.0
    cpu_hours_asked_measured: float = 0.0
    peak_rss_bytes: int | None = None

    def add(self, attempt: Attempt, hours: float) -> None:
        asked = attempt.resources or {}
        self.attempts += 1
        self.by_state[attempt.state] = self.by_state.get(attempt.state, 0) + 1
        self.wall_hours += hours
        granted = attempt.granted or {}
        nodes = int(asked.get("nodes") or 1)
        tasks = nodes * int(asked.get("tasks_per_node") or 1)
        cpu_hours = hours * float(asked.get("cpus") or 1) * tasks
        self.cpu_hours += hours * float(granted["cpus"]) if "cpus" in granted else cpu_hours
        # granted TRES (cpus always among them): a gpu count unsaid is none; a partition alone says nothing of GPUs
        gpus = granted.get("gpus", 0) if "cpus" in granted else float(asked.get("gpus") or 0) * nodes
        self.gpu_hours += hours * float(gpus or 0)
        if attempt.state not in ("COMPLETED", "RUNNING", "PENDING") and not attempt.progress_saved:
            self.lost_hours += hours
        used = attempt.used or {}
        if used:
            self.measured += 1
            self.cpu_hours_used += float(used.get("cpu_seconds") or 0) / 3600
            self.cpu_hours_asked_measured += cpu_hours
            rss = used.get("max_rss_bytes")
            if rss is not None:
                self.peak_rss_bytes = max(self.peak_rss_bytes or 0, int(rss))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class UsageReport:
    """Usage per group, largest wall hours first, and the total."""

    by: str
    groups: list[Usage]
    total: Usage


def attempt_hours(attempt: Attempt, now: dt.datetime | None = None) -> float:
    """Hours from the job's start to its end (to ``now`` while it runs); 0 if it never started."""
    if attempt.started_at is None:
        return 0.0
    end = as_utc(attempt.ended_at or (now or utcnow()))  # SQLite hands naive datetimes back, written in UTC
    return max(0.0, (end - as_utc(attempt.started_at)).total_seconds() / 3600)


def usage(
    store: LineageStore, flt: RecordFilter | None = None, *, by: str = "recipe", now: dt.datetime | None = None
) -> UsageReport:
    """Sum the attempts that pass ``flt`` (the ``lineage list`` filters) by ``by``. A job still
    running counts up to ``now`` (the wall clock by default); a report made for a past moment, as a
    digest is for its window's end, passes that moment so the same report reads the same later."""
    if by not in GROUPS:
        raise ConfigError(f"cannot group usage by {by!r}: {choices(by, GROUPS, label='use one of')}")
    attempts: list[Attempt] = list_records(store, ["attempt"], flt or RecordFilter(), limit=None, strict=True).records
    stages, runs = _owners(store, attempts)
    now = now or utcnow()
    groups: dict[str, Usage] = {}
    total = Usage(group="total")
    for attempt in attempts:
        stage = stages.get(attempt.stage_run_id or "")
        run = runs.get(stage.pipeline_run_id or "") if stage is not None else None
        key = _key(by, attempt, stage, run)
        hours = attempt_hours(attempt, now)
        groups.setdefault(key, Usage(group=key)).add(attempt, hours)
        total.add(attempt, hours)
    ordered = sorted(groups.values(), key=lambda u: (-u.wall_hours, u.group))
    return UsageReport(by=by, groups=ordered, total=total)


def _owners(store: LineageStore, attempts: Iterable[Attempt]) -> tuple[dict[str, StageRun], dict[str, PipelineRun]]:
    """The stage runs and pipeline runs of ``attempts``, in two queries."""
    stages = store.get_many(StageRun, (a.stage_run_id for a in attempts))
    return stages, store.get_many(PipelineRun, (s.pipeline_run_id for s in stages.values()))


def _key(by: str, attempt: Attempt, stage: StageRun | None, run: PipelineRun | None) -> str:
    if by == "stage":
        return stage.stage if stage is not None else "(no stage)"
    if by == "backend":
        return attempt.backend
    if by == "cluster":  # the backend too: a Docker engine and a Slurm cluster may share a host's name
        return f"{attempt.backend}@{attempt.cluster}" if attempt.cluster else f"{attempt.backend}@(not recorded)"
    if by == "user":  # who submitted the job, as sreport's per-user usage
        return attempt.user or "(not recorded)"
    if by == "state":
        return attempt.state
    if by == "day":
        return attempt.submitted_at.strftime("%Y-%m-%d")
    if by == "pipeline_run":
        return run.id if run is not None else "(no pipeline run)"
    if run is None:
        return "(no pipeline run)"
    if by == "trigger":  # the nightlies' hours (schedule) beside those run by hand (terminal, ui)
        return run.trigger or "(not recorded)"
    if by == "sweep":  # what each sweep cost, beside the runs of none
        return run.sweep.get("id") or "(no sweep)"
    if by == "replica":
        return f"{run.recipe or run.name}:{run.replica}" if run.replica else (run.recipe or run.name)
    return run.recipe or run.name


__all__ = ["GROUPS", "Usage", "UsageReport", "attempt_hours", "usage"]
