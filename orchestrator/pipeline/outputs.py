"""A stage's output folder: where it lives, its content hash, whether it still verifies, its record.

Outputs are content-addressed: the folder is a function of the stage identity
(``artifacts_dir/<stage>/<identity[:16]>``), and what a later stage's identity reads of it is
its Merkle hash without volatile files (``metrics.json``, W&B's run folder), so re-logging a
metric does not invalidate everything downstream. :mod:`orchestrator.pipeline.reuse` asks
:func:`verify_outputs` before reusing a folder; :mod:`orchestrator.pipeline.execute` and
:mod:`orchestrator.pipeline.adopt` hash and record one with :func:`hash_output` and
:func:`record_outputs`.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.errors import OpenlabError
from orchestrator.lineage.models import Artifact, StageRun, new_id
from orchestrator.lineage.record import record_snapshot
from orchestrator.lineage.store import Transaction
from orchestrator.pipeline.dag import DEFAULT_VOLATILE, StageSpec
from orchestrator.settings import Settings

log = logging.getLogger("openlab.pipeline")


def output_dir(settings: Settings, stage: str, identity: str) -> Path:
    """Where a stage identity's output lives; a function of the identity, never an input to it."""
    return settings.artifacts_dir / stage / identity[:16]


def _volatile(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def stable_root(entries: Iterable[Any], volatile: Sequence[str] = DEFAULT_VOLATILE) -> str:
    """The Merkle root of an output's entries without its volatile files: what later stages read of it
    (its ``input_hash``), and what must still hold for it to be reused or to verify."""
    from orchestrator.snapshots import merkle_root

    return merkle_root(e for e in entries if not _volatile(e.path, volatile))


def detach_external_links(path: Path, volatile: Sequence[str]) -> list[str]:
    """Remove symlinks under volatile paths that point outside the output folder.

    W&B's offline run folder links ``logs/debug-core.log`` to a file in the user's cache;
    a snapshot rightly refuses links that leave its root, and that debug log is not a
    result. Links outside volatile paths are left alone (the snapshot then names them).
    """
    removed: list[str] = []
    root = os.path.realpath(path)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*filenames, *dirnames]:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                continue
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            target = os.path.realpath(full)
            if _volatile(rel, volatile) and not (target == root or target.startswith(root + os.sep)):
                os.unlink(full)
                removed.append(rel)
    if removed:
        log.info("removed %d volatile link(s) leaving %s: %s", len(removed), path, ", ".join(removed[:3]))
    return removed


def hash_output(path: Path, settings: Settings, volatile: Sequence[str]) -> dict[str, Any]:
    """Snapshot an output folder: full Merkle hash plus the hash without volatile files."""
    from orchestrator.snapshots import snapshot

    detach_external_links(path, volatile)
    snap = snapshot(path, settings=settings)
    return {
        "path": str(snap.path),
        "content_hash": snap.id,
        "input_hash": stable_root(snap.entries, volatile),
        "volatile": list(volatile),
        "files": snap.files,
        "bytes": snap.bytes,
        "manifest_path": str(snap.manifest_path),
        "_snapshot": snap,
    }


def verify_outputs(outputs: Mapping[str, Any], settings: Settings, *, deep: bool = False) -> str | None:
    """None when every recorded output still holds what was recorded, volatile files aside, else what
    is wrong.

    What a later stage reads of an output is its hash without volatile files (``input_hash``), and so
    is what must still hold for it to be reused: with the whole folder's hash, ``openlab wandb sync``
    (which marks W&B's run folder synced) or a metric logged again made the stage run again. The
    default check re-snapshots with the stat cache (one stat per unchanged file), so reuse stays
    cheap; ``deep`` re-reads every byte.
    """
    from orchestrator.snapshots import SnapshotError, content_entries, merkle_root, snapshot, verify_snapshot

    if not outputs:
        return "no outputs recorded"
    for name, out in outputs.items():
        path = Path(out.get("path", ""))
        if not path.exists():
            return f"output {name} is missing at {path}"
        try:
            entries = content_entries(path) if deep else snapshot(path, settings=settings).entries
            if merkle_root(entries) == out.get("content_hash"):
                continue
            if (
                out.get("input_hash")
                and stable_root(entries, out.get("volatile") or DEFAULT_VOLATILE) == out["input_hash"]
            ):
                continue  # only volatile files moved
            if deep:
                problems = verify_snapshot(out["content_hash"], settings, path=path)
                return f"output {name}: {problems[0] if problems else 'changed since it was recorded'}"
            return f"output {name} at {path} changed since it was recorded"
        except (SnapshotError, OpenlabError) as exc:
            return f"output {name}: {exc}"
    return None


def read_metrics(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "metrics.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("unreadable metrics %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {"value": data}


def record_outputs(
    tx: Transaction, spec: StageSpec, run: StageRun, out_dir: Path, hashed: dict[str, Any], snap: Any
) -> dict[str, Any]:
    """Record a completed stage's output folder as an artifact (and, for a data stage, a data
    snapshot) generated by ``run``; returns the stage run's ``outputs``, ids filled in."""
    art = tx.add(
        Artifact(
            id=new_id(Artifact.id_prefix),
            name=f"{spec.name}/out",
            artifact_type="folder",
            uri=str(out_dir),
            content_hash=snap.id,
            size=snap.bytes,
        )
    )
    tx.relate("wasGeneratedBy", art, run)
    hashed["artifact_id"] = art.id
    if spec.snapshot_output:
        data_snap = record_snapshot(tx, snap)
        tx.relate("wasGeneratedBy", data_snap, run)
        hashed["snapshot_id"] = data_snap.id
    return {"out": hashed}
