"""``openlab wandb``: record stage W&B runs in lineage and upload offline ones."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.cli.github import one_line_errors
from orchestrator.cli.output import given_path

app = typer.Typer(help="W&B runs of stage jobs: read back into lineage, upload offline runs.", no_args_is_help=True)


@app.command()
@one_line_errors
def sync() -> None:
    """Upload offline W&B runs recorded in lineage (`wandb sync`) and record their URLs."""
    from orchestrator.lineage.store import open_store
    from orchestrator.links.wandb import sync_offline_runs

    with open_store() as store:
        synced = sync_offline_runs(store)
    for run in synced:
        typer.echo(f"{run.id}: {run.url or '(synced; URL unknown until the entity is set)'}")
    if not synced:
        typer.echo("no offline W&B runs to sync")


@app.command()
@one_line_errors
def record(
    stage_run: str = typer.Argument(..., help="stage run id"),
    path: Path = typer.Argument(..., parser=given_path, help="the job's output dir or a wandb run dir"),
) -> None:
    """Read a stage's W&B run back from its files and record it in lineage."""
    from orchestrator.lineage.store import open_store
    from orchestrator.links.wandb import record_wandb_run

    with open_store() as store:
        run = record_wandb_run(store, stage_run, path)
    metrics = ", ".join(f"{k}={v}" for k, v in sorted(run.summary.items()) if not k.startswith("_"))
    typer.echo(f"{run.id} ({run.mode}, {run.url or run.local_dir}) {metrics}")
