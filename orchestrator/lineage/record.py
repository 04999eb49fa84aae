"""Turn captured facts (snapshots, provenance) into lineage records.

Capture (:mod:`orchestrator.snapshots`, :mod:`orchestrator.provenance`) knows nothing
of the database; this module is the one place that maps what was captured onto
content-addressed records, so every caller records the same thing the same way.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from orchestrator.lineage.models import Commit, DataSnapshot, Environment
from orchestrator.lineage.store import Transaction

if TYPE_CHECKING:
    from orchestrator.provenance import EnvironmentInfo, GitInfo
    from orchestrator.snapshots import Snapshot


def commit_id(sha: str | None, patch_hash: str | None) -> str:
    """A commit record's id: the sha, plus the patch hash when the tree was dirty."""
    base = sha or "no-git"
    return f"{base}+{patch_hash[:16]}" if patch_hash else base


def record_snapshot(tx: Transaction, snap: Snapshot) -> DataSnapshot:
    """Record a data snapshot (idempotent: the id is the content)."""
    return tx.ensure(
        DataSnapshot(
            id=snap.id,
            path=str(snap.path),
            files=snap.files,
            bytes=snap.bytes,
            manifest_path=str(snap.manifest_path),
        )
    )


def record_git(tx: Transaction, git: GitInfo) -> Commit:
    """Record the commit (and dirty patch) code ran from; ``no git`` is recorded too."""
    info: dict[str, Any] = git.to_dict()
    authored = info.get("authored_at")
    return tx.ensure(
        Commit(
            id=commit_id(info.get("commit"), info.get("patch_hash")),
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
