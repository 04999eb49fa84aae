"""``openlab gc``: free the disk that old stage outputs hold, keeping their lineage."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.filesize import decimal
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from rich.table import Table

from orchestrator.cli.output import console, print_json
from orchestrator.errors import ConfigError
from orchestrator.retention import DEFAULT_FAILED_UNUSED_FOR, DEFAULT_KEEP_LAST, DEFAULT_UNUSED_FOR

if TYPE_CHECKING:
    from orchestrator.pipeline.gc import GcPlan


def gc_cmd(
    keep: Annotated[
        int, typer.Option("--keep", help="Keep the outputs of the last N completed runs of each recipe and replica.")
    ] = DEFAULT_KEEP_LAST,
    unused_for: Annotated[
        str,
        typer.Option(
            "--unused-for", help="Only outputs no run made or reused for this long (90m, 12h, 7d, 2w) or since a date."
        ),
    ] = DEFAULT_UNUSED_FOR,
    stage: Annotated[list[str] | None, typer.Option("--stage", help="Only outputs of this stage (repeatable).")] = None,
    recipe: Annotated[str | None, typer.Option("--recipe", help="Only outputs runs of this recipe used.")] = None,
    replica: Annotated[str | None, typer.Option("--replica", help="Only outputs runs of this replica used.")] = None,
    include_unsynced_wandb: Annotated[
        bool,
        typer.Option("--include-unsynced-wandb", help="Also delete offline W&B runs never uploaded (kept by default)."),
    ] = False,
    include_failed: Annotated[
        bool,
        typer.Option(
            "--include-failed",
            help="Also delete the partial outputs (checkpoints a retry resumes from) of stage identities that never "
            "completed, once no attempt has touched them for --failed-unused-for.",
        ),
    ] = False,
    failed_unused_for: Annotated[
        str | None,
        typer.Option(
            "--failed-unused-for",
            help=f"With --include-failed: only those no attempt started or ended for this long "
            f"(default {DEFAULT_FAILED_UNUSED_FOR}) or since a date.",
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; remove nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking (scripts, schedules).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object for scripts.")] = False,
) -> None:
    """Delete stage outputs (checkpoints, token shards) nobody uses any more; keep their lineage.

    Kept: outputs of the last --keep completed runs of each recipe and replica, outputs made or
    reused within --unused-for, outputs a running pipeline or job uses, recorded data snapshots,
    and outputs holding an offline W&B run not yet synced (`openlab wandb sync` first, or
    --include-unsynced-wandb). The rest is deleted and each artifact
    record is marked removed (when, by whom, why); stage runs, jobs and W&B runs stay, so `lineage
    trace` still answers, and a later run of the same stage identity runs it again. `openlab gc
    --dry-run` shows what would go.

    Outputs of stage identities that never completed (crashed or abandoned runs' checkpoints) are
    left alone: a retry resumes from them. --include-failed lets those go too once no attempt has
    started or ended for --failed-unused-for (30d); a later run then starts from scratch.
    """
    from orchestrator.lineage.listing import RecordFilter, parse_when, refuse_unknown_names
    from orchestrator.lineage.store import open_store
    from orchestrator.pipeline.gc import collect, plan_gc
    from orchestrator.settings import load_settings

    if keep < 0:
        raise ConfigError(f"invalid --keep {keep}: give 0 or more completed runs to keep")
    if failed_unused_for is not None and not include_failed:
        raise ConfigError(
            "--failed-unused-for applies only with --include-failed (failed runs' partial outputs are kept otherwise)"
        )
    used_since = parse_when(unused_for)
    failed_used_since = parse_when(failed_unused_for or DEFAULT_FAILED_UNUSED_FOR) if include_failed else None
    settings = load_settings()
    store = open_store(settings, create=False)
    # a misspelt --stage would plan "0 to delete", which reads as "nothing to free"
    refuse_unknown_names(store, RecordFilter(stage=tuple(stage or ()), recipe=recipe, replica=replica))
    plan = plan_gc(
        store,
        settings,
        keep_last=keep,
        used_since=used_since,
        stages=stage,
        recipe=recipe,
        replica=replica,
        keep_unsynced_wandb=not include_unsynced_wandb,
        include_failed=include_failed,
        failed_used_since=failed_used_since,
    )
    removable = plan.removable
    # the checkouts runs of a git ref made ($OPENLAB_HOME/worktrees/<sha>): a cache of commits, made
    # again when asked. They belong to no stage, recipe or replica, so a gc narrowed to some leaves
    # them; otherwise they are asked about with the outputs (they were removed without --yes).
    from flows.gitref import prune_worktrees, running_commits, stale_worktrees
    from orchestrator.pipeline.dag import REPO_ROOT

    narrowed = bool(stage or recipe or replica)
    in_use = running_commits(store)
    worktrees = [] if narrowed else stale_worktrees(settings, used_since, in_use)
    what = f"{len(removable)} output folder(s)" + (f" and {len(worktrees)} git worktree(s)" if worktrees else "")
    if not dry_run and (removable or worktrees) and not yes:
        if not sys.stdin.isatty():
            raise ConfigError(
                f"{what} ({decimal(plan.bytes_removable)} of outputs) would be deleted: "
                "pass --yes to delete them, or --dry-run to list them"
            )
        _print_plan(plan)
        _print_worktrees(worktrees, "would remove")
        if not typer.confirm(f"Delete {what}?", default=False):
            raise typer.Exit(1)
    elif not json_out:
        _print_plan(plan)
    if worktrees and not dry_run:
        worktrees = prune_worktrees(REPO_ROOT, settings, used_since, in_use)
    if not json_out:
        _print_worktrees(worktrees, "would remove" if dry_run else "removed")
    if dry_run or not removable:
        if json_out:
            print_json({"dry_run": dry_run, **plan.to_dict(), "worktrees": [str(p) for p in worktrees]})
        return
    if json_out or not console.is_terminal:
        done = collect(store, settings, plan)
    else:
        with Progress(TextColumn("removing"), BarColumn(), DownloadColumn(), console=console, transient=True) as bar:
            task = bar.add_task("gc", total=plan.bytes_removable)
            done = collect(store, settings, plan, progress=lambda o: bar.advance(task, o.bytes))
    removed = [o for o in done if o.outcome == "removed"]
    if json_out:
        print_json({"dry_run": False, **plan.to_dict(), "worktrees": [str(p) for p in worktrees]})
    else:
        for o in done:
            if o.outcome != "removed":
                console.print(f"{o.stage} {o.identity[:16]}: {o.outcome}", markup=False)
        console.print(
            f"removed {len(removed)} output folder(s), {decimal(sum(o.bytes for o in removed))}; "
            "their records say when and why (`openlab lineage show ART`)",
            markup=False,
        )
    if any(o.failed for o in done):
        raise typer.Exit(1)


def _print_worktrees(worktrees: list[Path], verb: str) -> None:
    if worktrees:
        console.print(f"{verb} {len(worktrees)} git worktree(s) of commits no run used since then", markup=False)


def _print_plan(plan: GcPlan) -> None:
    from orchestrator.lineage.listing import utc_minute

    removable = plan.removable
    with_failed = plan.failed_used_since is not None
    if removable:
        table = Table(title="stage outputs to delete")
        headers = ("stage", "identity", *(("state",) if with_failed else ()), "used by", "last used (UTC)", "size")
        for header in headers:
            table.add_column(header, justify="right" if header == "size" else "left", overflow="fold")
        for o in removable:
            table.add_row(
                escape(o.stage),
                o.identity[:16],
                *((o.state.split(",")[0],) if with_failed else ()),  # "failed": its last attempt is "last used"
                escape(", ".join(o.recipes)),
                f"{utc_minute(o.last_used)}",
                decimal(o.bytes),
            )
        console.print(table)
    failed_rule = (
        f"; failed identities attempted since {utc_minute(plan.failed_used_since)} UTC"
        if plan.failed_used_since is not None
        else ""
    )
    console.print(
        f"{len(removable)} to delete ({decimal(plan.bytes_removable)}); kept: {plan.kept_summary()} "
        f"(last {plan.keep_last} completed runs of each recipe and replica, used since "
        f"{utc_minute(plan.used_since)} UTC{failed_rule})",
        markup=False,
    )
