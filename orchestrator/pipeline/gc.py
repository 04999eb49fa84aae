"""``openlab gc``: delete stage outputs nobody needs any more, and keep every record of them.

Checkpoints and token shards are most of a lab's disk, and a nightly replica writes a new set
each time its code changes. Lineage must answer "what produced this" forever; the bytes need
only live while someone may reuse or compare against them. So :func:`plan_gc` decides from
lineage alone which stage output folders to keep, each with its reason:

- **in use**: a stage run of that identity belongs to a pipeline run still RUNNING (a stage
  reading it as input now), or another process holds the identity's lease (running it now);
- **data snapshot**: the folder is a recorded data snapshot, which ``lineage verify`` proves
  the data against;
- **unsynced W&B run**: an offline W&B run inside it was never uploaded (``openlab wandb sync``
  first: deleting it would lose the run's history, which lineage keeps only as a summary);
- **last N**: it belongs to one of the last ``keep_last`` COMPLETED pipeline runs of its recipe
  and replica (made or reused there): what tomorrow's run reuses and what people compare with;
- **recent**: a stage run made or reused it after ``used_since``.

Everything else among the stages, recipes and replicas asked for is removed by :func:`collect`:
the folder (moved aside first, so nothing is half-deleted under its own name), its config file,
and each artifact record under it gets ``removed_at``/``removed_reason`` in one lineage
transaction (an event in the hash chain). Nothing else changes: the stage runs, attempts, W&B
runs and relations stay, so ``lineage trace`` still answers; a later run of the same identity
finds its outputs gone (``explain`` says "removed by openlab gc") and runs the stage again.
"""

from __future__ import annotations

import datetime as dt
import getpass
import os
import shutil
import socket
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlmodel import col, or_

from orchestrator.errors import ConfigError
from orchestrator.lineage import leases
from orchestrator.lineage.models import Artifact, DataSnapshot, PipelineRun, StageRun, WandbRun, utcnow
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.execute import output_dir
from orchestrator.settings import Settings

#: How many of each recipe and replica's last completed pipeline runs keep their outputs.
DEFAULT_KEEP_LAST = 3
#: Outputs made or reused more recently than this are kept.
DEFAULT_UNUSED_FOR = "7d"

#: Stage-run states that mean a job of that identity is still going (the reaper closes those whose
#: orchestrator died). A stage run PREEMPTED between attempts counts through its RUNNING pipeline run.
UNFINISHED = frozenset({"PENDING", "RUNNING"})
#: Why an output is kept, in the order they are checked (the first that applies is reported).
IN_USE, DATA_SNAPSHOT, UNSYNCED_WANDB, LAST_RUNS, RECENT = (
    "in use",
    "data snapshot",
    "unsynced W&B run",
    "last runs",
    "recent",
)


@dataclass
class Output:
    """One stage output folder (one stage identity), what uses it and whether it stays."""

    folder: Path
    stage: str
    identity: str
    made_by: list[str]
    used_by_runs: list[str]
    recipes: list[str]
    last_used: dt.datetime
    bytes: int
    keep: str | None = None
    #: After :func:`collect`: "removed", or why it could not be.
    outcome: str | None = None

    @property
    def failed(self) -> bool:
        """Whether :func:`collect` tried and could not remove it (skipping one in use is no failure)."""
        return self.outcome is not None and self.outcome != "removed" and not self.outcome.startswith("skipped")

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "stage": self.stage,
            "identity": self.identity,
            "made_by": self.made_by,
            "pipeline_runs": self.used_by_runs,
            "recipes": self.recipes,
            "last_used": self.last_used.isoformat(),
            "bytes": self.bytes,
            "keep": self.keep,
            "outcome": self.outcome,
        }


@dataclass
class GcPlan:
    """Every output folder present here, each kept (with its reason) or to be removed."""

    outputs: list[Output]
    keep_last: int
    used_since: dt.datetime
    filters: dict[str, Any] = field(default_factory=dict)

    @property
    def removable(self) -> list[Output]:
        return [o for o in self.outputs if o.keep is None]

    @property
    def kept(self) -> list[Output]:
        return [o for o in self.outputs if o.keep is not None]

    @property
    def bytes_removable(self) -> int:
        return sum(o.bytes for o in self.removable)

    def kept_summary(self) -> str:
        """``2 last runs, 1 recent``: how many outputs each reason keeps (``none``)."""
        counts: dict[str, int] = defaultdict(int)
        for o in self.kept:
            counts[o.keep or ""] += 1
        return ", ".join(f"{n} {why}" for why, n in sorted(counts.items())) or "none"

    def to_dict(self) -> dict[str, Any]:
        return {
            "keep_last": self.keep_last,
            "used_since": self.used_since.isoformat(),
            "filters": self.filters,
            "remove": [o.to_dict() for o in self.removable],
            "kept": [o.to_dict() for o in self.kept],
            "bytes_removable": self.bytes_removable,
        }


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed: they are not this folder's)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(root, name)):
                total += st.st_size
    return total


def _when(run: StageRun) -> dt.datetime:
    return run.ended_at or run.started_at


def plan_gc(
    store: LineageStore,
    settings: Settings,
    *,
    keep_last: int = DEFAULT_KEEP_LAST,
    used_since: dt.datetime,
    stages: Iterable[str] | None = None,
    recipe: str | None = None,
    replica: str | None = None,
    keep_unsynced_wandb: bool = True,
) -> GcPlan:
    """Decide, from lineage, which output folders present under ``settings.artifacts_dir`` go.

    ``stages``, ``recipe`` and ``replica`` narrow what may be removed (an output counts as the
    recipe's when any pipeline run of that recipe made or reused it); the keep rules see every
    run, so an output another recipe still needs is kept whatever the filter.
    ``keep_unsynced_wandb=False`` lets offline W&B runs that were never uploaded go with their folder
    (a lab that runs W&B offline for good, whose metrics lineage and metrics.jsonl already hold).
    """
    if keep_last < 0:
        raise ConfigError(f"invalid keep count {keep_last}: give 0 or more completed runs to keep")
    wanted_stages = set(stages or ())
    runs = {r.id: r for r in store.list(PipelineRun)}
    last: dict[tuple[str | None, str | None], list[PipelineRun]] = defaultdict(list)
    for r in sorted(runs.values(), key=lambda r: r.started_at, reverse=True):
        if r.state == "COMPLETED":
            last[(r.recipe, r.replica)].append(r)
    kept_runs = {r.id for group in last.values() for r in group[:keep_last]}
    running_runs = {r.id for r in runs.values() if r.state == "RUNNING"}

    by_identity: dict[tuple[str, str], list[StageRun]] = defaultdict(list)
    for sr in store.list(StageRun):
        by_identity[(sr.stage, sr.identity)].append(sr)
    snapshot_paths = [Path(s.path) for s in store.list(DataSnapshot)]
    unsynced = [Path(w.local_dir) for w in store.list(WandbRun) if w.local_dir and not w.url and keep_unsynced_wandb]
    root = settings.artifacts_dir.resolve()

    outputs: list[Output] = []
    for (stage, identity), srs in sorted(by_identity.items()):
        made_by = [sr.id for sr in srs if sr.state == "COMPLETED"]
        folder = output_dir(settings, stage, identity)
        if not made_by or not folder.is_dir() or root not in folder.resolve().parents:
            continue  # never completed, already gone, or not openlab's to delete
        used = [sr for sr in srs if sr.state in ("COMPLETED", "REUSED", "RUNNING")]
        run_ids = sorted({sr.pipeline_run_id for sr in used if sr.pipeline_run_id})
        recipes = sorted({f"{runs[i].recipe}/{runs[i].replica}" for i in run_ids if i in runs})
        if wanted_stages and stage not in wanted_stages:
            continue
        if recipe is not None or replica is not None:
            if not any(
                i in runs
                and (recipe is None or runs[i].recipe == recipe)
                and (replica is None or runs[i].replica == replica)
                for i in run_ids
            ):
                continue
        out = Output(
            folder=folder,
            stage=stage,
            identity=identity,
            made_by=made_by,
            used_by_runs=run_ids,
            recipes=recipes,
            last_used=max(_when(sr) for sr in used),
            bytes=folder_bytes(folder),
        )
        out.keep = _keep_reason(store, out, srs, running_runs, kept_runs, snapshot_paths, unsynced, used_since)
        outputs.append(out)
    filters = {k: v for k, v in {"stages": sorted(wanted_stages), "recipe": recipe, "replica": replica}.items() if v}
    return GcPlan(outputs=outputs, keep_last=keep_last, used_since=used_since, filters=filters)


def _keep_reason(
    store: LineageStore,
    out: Output,
    runs_of_identity: list[StageRun],
    running_runs: set[str],
    kept_runs: set[str],
    snapshot_paths: list[Path],
    unsynced: list[Path],
    used_since: dt.datetime,
) -> str | None:
    # any stage run of it still going (a forced re-run) or in a live pipeline run (one preempted, about to resume)
    if any(sr.state in UNFINISHED or sr.pipeline_run_id in running_runs for sr in runs_of_identity):
        return IN_USE
    if leases.is_live(leases.current(store, out.identity)):
        return IN_USE
    if any(p == out.folder or out.folder in p.parents for p in snapshot_paths):
        return DATA_SNAPSHOT
    if any(out.folder in p.parents for p in unsynced):
        return UNSYNCED_WANDB
    if any(sr.pipeline_run_id in kept_runs and sr.state in ("COMPLETED", "REUSED") for sr in runs_of_identity):
        return LAST_RUNS
    if out.last_used >= used_since:
        return RECENT
    return None


def _artifacts_under(store: LineageStore, folder: Path) -> list[Artifact]:
    base = str(folder)
    uris = [base, f"file://{base}"]
    return store.list(
        Artifact,
        where=[
            col(Artifact.removed_at).is_(None),
            or_(
                col(Artifact.uri).in_(uris),
                *(col(Artifact.uri).startswith(u + "/") for u in uris),
            ),
        ],
    )


def collect(
    store: LineageStore,
    settings: Settings,
    plan: GcPlan,
    *,
    progress: Callable[[Output], None] | None = None,
) -> list[Output]:
    """Remove the plan's removable outputs; return them, each with its ``outcome``.

    Each folder is removed under its identity's lease (a run that starts it meanwhile waits, one
    already running it makes gc skip it) and only after checking again that no running pipeline
    run uses it. The folder is first renamed aside, then its artifact records are marked removed
    in one transaction, then the bytes go: if recording fails the folder is put back as it was.
    """
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    done: list[Output] = []
    for out in plan.removable:
        out.outcome = _remove_one(store, settings, out, who, plan)
        done.append(out)
        if progress is not None:
            progress(out)
    return done


def _remove_one(store: LineageStore, settings: Settings, out: Output, who: str, plan: GcPlan) -> str:
    held = leases.try_hold(store, out.identity, leases.new_holder("gc"))
    if held is None:
        return "skipped: being run now"
    try:
        running = {r.id for r in store.list(PipelineRun, state="RUNNING")}
        again = store.list(StageRun, where=[StageRun.identity == out.identity, StageRun.stage == out.stage])
        if any(sr.state in UNFINISHED or sr.pipeline_run_id in running for sr in again):
            return "skipped: a running pipeline started using it"
        if not out.folder.is_dir():
            return "skipped: already gone"
        aside = out.folder.with_name(f".{out.folder.name}.gc-{os.getpid()}")
        out.folder.rename(aside)
        reason = (
            f"openlab gc by {who}: last used {out.last_used:%Y-%m-%d %H:%M} UTC, before "
            f"{plan.used_since:%Y-%m-%d %H:%M} UTC, and in none of the last {plan.keep_last} completed runs "
            f"of {', '.join(out.recipes) or 'its recipe'}"
        )
        try:
            with store.transaction() as tx:
                now = utcnow()
                for art in _artifacts_under(store, out.folder):
                    tx.update(art, removed_at=now, removed_reason=reason)
        except BaseException:
            aside.rename(out.folder)
            raise
        out.folder.with_suffix(".config.json").unlink(missing_ok=True)
        try:
            shutil.rmtree(aside)
        except OSError as exc:  # recorded removed; what is left is hidden, named, and reported
            return f"removed from lineage, but {aside} could not be deleted: {exc}"
        return "removed"
    finally:
        held.release()
