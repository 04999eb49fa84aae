"""Which recorded output holds this file, found by its content rather than by where it lies.

A checkpoint travels: copied to a bucket, renamed for a release, attached to a model card.
``openlab lineage show PATH`` finds an output by the path it was written to; this finds it by
what it holds. A file is hashed (BLAKE3, as snapshot manifests record each file) and looked up
in every manifest openlab wrote, so a copy anywhere leads back to the output folder that had
it, and from there ``lineage trace`` to the stage run, job, commit and data that made it. A
folder is matched whole, by the content hash its snapshot would have.

Manifests are read from the snapshots folder of this openlab home; one written on another
machine is not seen.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlmodel import col

from orchestrator.errors import NotFoundError
from orchestrator.lineage.models import Artifact, DataSnapshot, LineageRecord
from orchestrator.lineage.store import LineageStore
from orchestrator.settings import Settings
from orchestrator.snapshots import content_hash, file_hash

log = logging.getLogger(__name__)


@dataclass
class Holder:
    """A recorded folder that held the content: its content hash, where in it, and its records."""

    content_hash: str
    #: The file's path inside that folder ("" when the folder itself matched).
    entry: str
    #: Artifacts with that content hash (stage outputs, adopted ones) and snapshots with that id.
    records: list[LineageRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "content_hash": self.content_hash,
            "entry": self.entry,
            "records": [{"kind": r.kind, "id": r.id} for r in self.records],  # type: ignore[attr-defined]
        }


def holders(store: LineageStore, settings: Settings, path: Path) -> tuple[str, list[Holder]]:
    """(the content's hash, the recorded folders that hold it), newest record first in each."""
    if not path.exists():
        raise NotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        digest = content_hash(path)
        found = {digest: [""]}
    elif not path.is_file():  # reading a fifo waits for a writer that may never come
        raise NotFoundError(f"{path}: not a regular file or folder (device, fifo or socket): no content to look up")
    else:
        digest = file_hash(path)
        found = _manifests_holding(settings.snapshots_dir, digest)
    out = []
    for manifest_id, entries in found.items():
        newest = col(Artifact.created_at).desc()
        records: list[LineageRecord] = [
            *store.list(Artifact, where=[Artifact.content_hash == manifest_id], order_by=newest),
            *store.list(DataSnapshot, where=[DataSnapshot.id == manifest_id]),
        ]
        if records:
            out += [Holder(manifest_id, entry, records) for entry in entries]
    return digest, out


def _manifests_holding(folder: Path, blake3: str) -> dict[str, list[str]]:
    """Manifest id -> paths of the entries whose content is ``blake3``, over every manifest in ``folder``."""
    found: dict[str, list[str]] = {}
    needle = blake3.encode()
    for manifest in sorted(folder.glob("*.json")):
        try:
            raw = manifest.read_bytes()
            if needle not in raw:  # most manifests do not hold it: a byte search, not a parse, says so
                continue
            data = json.loads(raw)
        except (OSError, ValueError) as exc:  # one unreadable manifest must not hide the others
            log.warning("skipping unreadable snapshot manifest %s: %s", manifest, exc)
            continue
        if not isinstance(data, dict) or "id" not in data:
            continue
        paths = [e["path"] for e in data.get("entries") or () if isinstance(e, dict) and e.get("blake3") == blake3]
        if paths:
            found.setdefault(str(data["id"]), []).extend(paths)
    return found
