"""``openlab snapshot`` and ``openlab provenance``: capture facts about data and code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from orchestrator.cli.output import byte_progress, console, given_path, print_json

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object for scripts.")]


def snapshot_cmd(
    path: Annotated[Path, typer.Argument(parser=given_path, help="File or folder to snapshot.")],
    json_out: JsonFlag = False,
) -> None:
    """Snapshot PATH: a content-addressed manifest (BLAKE3 per file, Merkle root = id), recorded in lineage."""
    from orchestrator.lineage.record import record_snapshot
    from orchestrator.lineage.store import open_store
    from orchestrator.settings import load_settings
    from orchestrator.snapshots import snapshot

    settings = load_settings()
    store = open_store(settings)  # fail on a bad database before hashing a terabyte
    if json_out or not console.is_terminal:
        snap = snapshot(path, settings=settings)
    else:
        with byte_progress() as bar:
            task = bar.add_task(f"hashing {path}", total=None)

            def report(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            snap = snapshot(path, settings=settings, progress=report)
    with store.transaction() as tx:
        record_snapshot(tx, snap)
    if json_out:
        print_json(snap.to_dict())
        return
    console.print(f"[bold]snapshot[/] {snap.id}")
    console.print(f"  path      {snap.path}", markup=False)
    console.print(f"  files     {snap.files}")
    console.print(f"  bytes     {snap.bytes}")
    console.print(f"  manifest  {snap.manifest_path}", markup=False)
    console.print(f"  hashed    {snap.hashed_files} files ({snap.cache_hits} unchanged, from the stat cache)")


def provenance_cmd(
    path: Annotated[Path, typer.Argument(parser=given_path, help="Folder inside the git repository.")] = Path("."),
    code: Annotated[
        list[str] | None, typer.Option("--code", help="A path the stage declares as its code (repeatable).")
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Show what openlab would record about code and environment here, now (nothing is written)."""
    from orchestrator.errors import OpenlabError
    from orchestrator.provenance import capture

    if not path.exists():
        raise OpenlabError(f"{path}: no such folder")
    prov = capture(path, code_paths=tuple(code or ()), keep_patch=False)
    data = prov.to_dict()
    if json_out:
        print_json(data)
        return
    git, env = data["git"], data["environment"]
    if not git.get("available", True):
        console.print(f"[yellow]git:[/] {escape(str(git.get('reason', 'no git')))}")
    else:
        state = "[red]dirty[/]" if git.get("dirty") else "[green]clean[/]"
        branch = escape(git.get("branch") or "detached HEAD")
        console.print(f"[bold]commit[/]   {git.get('commit')} ({state}) on {branch}")
        console.print(f"  remote   {git.get('remote_url') or '-'}", markup=False)
        if git.get("patch_hash"):
            console.print(f"  patch    {git['patch_hash']}")
        for rel, tree in (git.get("tree_hashes") or {}).items():
            console.print(f"  code     {rel}: {tree}", markup=False)
    console.print(f"[bold]environment[/] {env.get('id')}")
    for key in (
        "python_version",
        "platform",
        "hostname",
        "cpu_model",
        "gpu_models",
        "packages_hash",
        "container_image_digest",
    ):
        console.print(f"  {key:<24}{env.get(key) or '-'}", markup=False)
