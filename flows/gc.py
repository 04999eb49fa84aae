"""``openlab gc`` as a deployment: free the disk old stage outputs hold, from the UI or on a schedule.

Nightly replicas write a new set of checkpoints each time the code changes; a lab that runs
them for months fills its filesystem. This flow runs :mod:`orchestrator.pipeline.gc` with the
same rules as the command (keep the last N completed runs of each recipe and replica, anything
used recently, anything in use, recorded data snapshots) and says what it removed in its log
and a markdown artifact. From the UI it is a dry run unless ``dry_run`` is unticked; the
schedule (``[prefect] gc_cron``, none by default) runs it for real.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State

from orchestrator.retention import DEFAULT_FAILED_UNUSED_FOR, DEFAULT_KEEP_LAST, DEFAULT_UNUSED_FOR


def gc_run_name() -> str:
    """``gc: keep 3, unused for 7d (dry run)``, with the stages, recipe and replica it was limited to:
    the run list tells a look from a deletion without opening the run."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    name = (
        f"gc: keep {params.get('keep', DEFAULT_KEEP_LAST)}, unused for {params.get('unused_for', DEFAULT_UNUSED_FOR)}"
    )
    only = [", ".join(params.get("stages") or ()), params.get("recipe"), params.get("replica")]
    if any(only):
        name += " of " + " ".join(str(o) for o in only if o)
    if params.get("include_failed"):
        name += ", failed too"
    return name + (" (dry run)" if params.get("dry_run", True) else "")


@flow(
    name="outputs-gc",
    description="Delete stage outputs no recent, kept or running run uses; their lineage records stay.",
    flow_run_name=gc_run_name,
)
def collect_outputs(
    keep: int = DEFAULT_KEEP_LAST,
    unused_for: str = DEFAULT_UNUSED_FOR,
    stages: list[str] | None = None,
    recipe: str | None = None,
    replica: str | None = None,
    include_unsynced_wandb: bool = False,
    include_failed: bool = False,
    failed_unused_for: str = DEFAULT_FAILED_UNUSED_FOR,
    dry_run: bool = True,
) -> dict[str, Any] | State[Any]:
    """Remove old stage output folders and mark their artifact records removed; report each.

    Args:
        keep: Keep the outputs of the last N completed runs of each recipe and replica.
        unused_for: Only outputs no run made or reused for this long (90m, 12h, 7d, 2w); the git
            worktrees runs of a git ref checked out (the nightly's commits) no run used for this long go too.
        stages: Only outputs of these stages (empty: all).
        recipe: Only outputs runs of this recipe used.
        replica: Only outputs runs of this replica used.
        include_unsynced_wandb: Also delete offline W&B runs that were never uploaded.
        include_failed: Also delete partial outputs of stage identities that never completed
            (checkpoints a retry would resume from).
        failed_unused_for: With include_failed: only those no attempt started or ended for this long.
        dry_run: Only say what would be removed (the default from the UI).
    """
    from prefect.artifacts import create_markdown_artifact
    from rich.filesize import decimal

    from flows.pipeline import failed_run
    from orchestrator.cards import md_cell
    from orchestrator.errors import ConfigError, OpenlabError
    from orchestrator.lineage.listing import RecordFilter, parse_when, refuse_unknown_names
    from orchestrator.lineage.store import LineageStore
    from orchestrator.pipeline.gc import collect, plan_gc
    from orchestrator.settings import load_settings

    logger = get_run_logger()
    settings = load_settings()
    try:  # the form's fields, checked as `openlab gc` checks its options: one line, not a traceback
        if keep < 0:
            raise ConfigError(f"keep {keep}: give 0 or more completed runs to keep")
        used_since = parse_when(unused_for)
        failed_used_since = parse_when(failed_unused_for) if include_failed else None
        with LineageStore.open(settings) as store:  # a misspelt stage would plan "0 to delete"
            refuse_unknown_names(store, RecordFilter(stage=tuple(stages or ()), recipe=recipe, replica=replica))
    except OpenlabError as exc:
        return failed_run(exc)
    with LineageStore.open(settings) as store:
        plan = plan_gc(
            store,
            settings,
            keep_last=keep,
            used_since=used_since,
            stages=stages,
            recipe=recipe,
            replica=replica,
            keep_unsynced_wandb=not include_unsynced_wandb,
            include_failed=include_failed,
            failed_used_since=failed_used_since,
        )
        removable = plan.removable
        if not dry_run and removable:
            for out in collect(store, settings, plan):
                line = f"{out.stage} {out.identity[:16]} ({decimal(out.bytes)}): {out.outcome}"
                (logger.info if out.outcome == "removed" else logger.warning)(line)
    from flows.gitref import prune_worktrees, running_commits, stale_worktrees
    from orchestrator.pipeline.dag import REPO_ROOT

    # each nightly on a new commit checked out a whole worktree of it
    with LineageStore.open(settings) as store:
        in_use = running_commits(store)  # a run longer than unused_for still runs from its checkout
    if stages or recipe or replica:  # checkouts belong to no stage, recipe or replica: as `openlab gc` does
        worktrees: list[Any] = []
    elif dry_run:
        worktrees = stale_worktrees(settings, used_since, in_use)
    else:
        worktrees = prune_worktrees(REPO_ROOT, settings, used_since, in_use)
    verb = "would remove" if dry_run else "removed"
    if worktrees:
        logger.info("%s %d git worktree(s) of commits no run used since %s", verb, len(worktrees), unused_for)
    headline = f"{verb} {len(removable)} output folder(s), {decimal(plan.bytes_removable)}; kept {plan.kept_summary()}"
    logger.info(headline)
    # with include_failed, say which folders are a failed run's leftovers (and its last attempt)
    state = ["state"] if include_failed else []
    columns = ["stage", "identity", *state, "used by", "last used (UTC)", "size", "outcome"]
    rows = [
        [
            md_cell(o.stage),
            f"`{o.identity[:16]}`",
            *([md_cell(o.state)] if include_failed else []),
            md_cell(", ".join(o.recipes)),
            f"{o.last_used:%Y-%m-%d %H:%M}",
            decimal(o.bytes),
            md_cell(o.outcome or "dry run"),
        ]
        for o in removable
    ]
    table = ["| " + " | ".join(cells) + " |" for cells in (columns, ["---"] * len(columns), *rows)]
    create_markdown_artifact(
        key="outputs-gc", markdown="\n".join([f"**{headline}**", "", *(table if rows else [])]), description=headline
    )
    failed = [o for o in removable if o.failed]
    if failed:  # said in one line, as every openlab failure of a run is (flows.pipeline.failed_run)
        said = "; ".join(o.outcome or "" for o in failed)
        return failed_run(OpenlabError(f"{len(failed)} output folder(s) could not be removed: {said}"))
    return {"dry_run": dry_run, **plan.to_dict()}


__all__ = ["collect_outputs", "gc_run_name"]
