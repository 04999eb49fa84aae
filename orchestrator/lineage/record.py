"""Turn captured facts (snapshots, provenance) into lineage records.

Capture (:mod:`orchestrator.snapshots`, :mod:`orchestrator.provenance`) knows nothing
of the database; this module is the one place that maps what was captured onto
content-addressed records, so every caller records the same thing the same way.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import col, or_

from orchestrator.lineage.models import Artifact, Commit, DataSnapshot, Environment
from orchestrator.lineage.store import LineageStore, Transaction

if TYPE_CHECKING:
    from orchestrator.provenance import EnvironmentInfo, GitInfo
    from orchestrator.snapshots import Snapshot


def commit_id(sha: str | None, patch_hash: str | None, dirty: bool = False) -> str:
    """A commit record's id: the sha, plus the patch hash when the tree was dirty, or ``+dirty`` when
    it was dirty in a way no patch holds (only an untracked file too large for one, a nested repository
    with no commit yet): a record is written once, so that tree and the clean one need two."""
    base = sha or "no-git"
    if patch_hash:
        return f"{base}+{patch_hash[:16]}"
    return f"{base}+dirty" if dirty else base


def record_snapshot(tx: Transaction, snap: Snapshot) -> DataSnapshot:
    """Record a data snapshot (idempotent: the id is the content).

    A snapshot whose bytes were marked removed (a forced re-run replaced its folder) and that
    is captured again, the same content back on disk, is live again at the path it is now at.
    """
    stored = tx.ensure(
        DataSnapshot(
            id=snap.id,
            path=str(snap.path),
            files=snap.files,
            bytes=snap.bytes,
            manifest_path=str(snap.manifest_path),
        )
    )
    if stored.removed_at is not None:
        stored = tx.update(
            stored, removed_at=None, removed_reason=None, path=str(snap.path), manifest_path=str(snap.manifest_path)
        )
    return stored


def live_records_at(store: LineageStore, folder: Path) -> list[Artifact | DataSnapshot]:
    """The artifacts and data snapshots that claim the bytes in ``folder`` (or under it) now.

    Whoever deletes or rewrites the folder marks these removed (:func:`mark_removed`), so no
    record goes on claiming a content hash the disk no longer holds and ``lineage verify``
    stays a check of what openlab itself did not do.
    """
    base = str(folder)
    uris = [base, f"file://{base}"]
    artifacts = store.list(
        Artifact,
        where=[
            col(Artifact.removed_at).is_(None),
            # autoescape: a path's ``_`` (run_1) is that character, not LIKE's any one (runX1)
            or_(col(Artifact.uri).in_(uris), *(col(Artifact.uri).startswith(u + "/", autoescape=True) for u in uris)),
        ],
    )
    snapshots = store.list(
        DataSnapshot,
        where=[
            col(DataSnapshot.removed_at).is_(None),
            or_(col(DataSnapshot.path) == base, col(DataSnapshot.path).startswith(base + "/", autoescape=True)),
        ],
    )
    return [*artifacts, *snapshots]


def mark_removed(tx: Transaction, records: list[Artifact | DataSnapshot], at: dt.datetime, reason: str) -> None:
    """Record that these records' bytes are gone, when and why (the records themselves stay)."""
    for record in records:
        tx.update(record, removed_at=at, removed_reason=reason)


def record_git(tx: Transaction, git: GitInfo) -> Commit:
    """Record the commit (and dirty patch) code ran from; ``no git`` is recorded too."""
    info: dict[str, Any] = git.to_dict()
    authored = info.get("authored_at")
    return tx.ensure(
        Commit(
            id=commit_id(info.get("commit"), info.get("patch_hash"), bool(info.get("dirty"))),
            sha=info.get("commit"),
            repo_path=info.get("root"),
            remote_url=info.get("remote_url"),
            branch=info.get("branch"),
            dirty=bool(info.get("dirty")),
            patch_hash=info.get("patch_hash"),
            message=info.get("message"),
            authored_at=dt.datetime.fromisoformat(authored) if authored else None,
        )
    )


def record_environment(tx: Transaction, env: EnvironmentInfo) -> Environment:
    """Record the environment code ran in (idempotent: the id is a hash of its fields)."""
    info = env.to_dict()
    return tx.ensure(
        Environment(
            id=info["id"],
            python=f"{info['python_implementation']} {info['python_version']}",
            platform=info["platform"],
            hostname=info["hostname"],
            cpu=info.get("cpu_model"),
            gpu=", ".join(info.get("gpu_models") or ()) or None,
            packages_hash=info["packages_hash"],
            image_digest=info.get("container_image_digest"),
        )
    )
