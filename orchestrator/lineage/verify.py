"""``openlab lineage verify``: prove that recorded lineage is what was recorded.

Four checks, each naming every broken record it finds:

1. the event chain: sequence numbers are contiguous, each event's ``prev_hash`` is the
   hash of the one before, and each hash matches the event's content;
2. the records: every row equals the content of its last event (a row edited in SQL
   behind openlab's back no longer does), every row has events, every record an
   event describes still exists;
3. the data: snapshots and artifacts not marked removed (``openlab gc`` and a forced re-run mark
   what they delete) are re-hashed (not trusted from a stat cache) and compared with what was
   recorded; an output folder that is gone though its artifact root is here was deleted behind
   openlab's back, and one whose root is not on this machine (another machine's storage, not
   mounted here) is noted as not checked, as is a snapshot whose folder (or manifest) is in a
   folder not here;
4. the code: every recorded commit still exists in its repository, and every dirty
   patch is still in the blob store with the recorded hash;
5. anchors, when given: each names an event (``SEQ:HASH``) that was published outside the
   database, and the log must still hold exactly that event.

Why anchors: the chain proves that nothing was changed *piecemeal*, but whoever controls the
database can rewrite the whole log and recompute every hash, and checks 1 and 2 would pass.
An event hash that was published somewhere they do not control (the lineage card on the
experiment issue shows the event that recorded the run's start, its recipe and pre-registered
predictions included) pins everything up to that event: the log cannot be rewritten before it
without the anchor failing. This is what makes a pre-registration worth its name.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import StatementError
from sqlmodel import col, select

from orchestrator.errors import OpenlabError
from orchestrator.hashing import hash_file
from orchestrator.lineage.models import RECORD_TYPES, Artifact, Commit, DataSnapshot, Event, StageRun
from orchestrator.lineage.store import GENESIS_HASH, LineageStore, event_hash, record_payload
from orchestrator.settings import Settings, load_settings

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Problem:
    """One broken record: which (``kind:id`` or ``event:seq``) and what is wrong."""

    record: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.record}: {self.message}"


_ANCHOR = re.compile(r"(?P<seq>[1-9][0-9]*):(?P<hash>[0-9a-f]{64})")


@dataclass(frozen=True)
class Anchor:
    """An event of the log as it was published outside the database: its number and hash, and
    where it was published (a comment URL), for the report."""

    seq: int
    hash: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.seq}:{self.hash}"


def parse_anchor(text: str, where: str = "") -> Anchor:
    """``SEQ:HASH`` (the event number, a colon, its 64 hex digit hash) as an :class:`Anchor`."""
    match = _ANCHOR.fullmatch(text.strip())
    if match is None:
        raise OpenlabError(
            f"invalid anchor {text!r}: give the event number and its hash as SEQ:HASH "
            "(64 lowercase hex digits), as the lineage card prints it"
        )
    return Anchor(int(match["seq"]), match["hash"], where)


def find_anchors(text: str, where: str = "") -> list[Anchor]:
    """Every ``SEQ:HASH`` anchor written in ``text`` in backticks (a card, a comment)."""
    return [Anchor(int(m["seq"]), m["hash"], where) for m in re.finditer(rf"`{_ANCHOR.pattern}`", text)]


def anchor_of(store: LineageStore, record_id: str, *, last: bool = False) -> Anchor | None:
    """The event that created ``record_id`` (``last``: its latest, e.g. a run's end), as an anchor to
    publish (None: no such record)."""
    order = col(Event.seq).desc() if last else col(Event.seq)
    with store.session() as session:
        found = session.exec(select(Event).where(Event.record_id == record_id).order_by(order)).first()
    return Anchor(found.seq, found.hash) if found is not None else None


def head_anchor(store: LineageStore) -> Anchor | None:
    """The log's latest event, as an anchor to publish (None: an empty log). The chain alone cannot
    show that its *latest* events were cut off (a failed run deleted with everything after it verifies
    as intact); an anchor published now makes any later removal of what is in the log now a problem."""
    with store.session() as session:
        found = session.exec(select(Event).order_by(col(Event.seq).desc())).first()
    return Anchor(found.seq, found.hash) if found is not None else None


def check_anchors(store: LineageStore, anchors: Iterable[Anchor]) -> list[Problem]:
    """Each anchor's event must still be in the log with the published hash."""
    problems: list[Problem] = []
    with store.session() as session:
        for anchor in anchors:
            where = f" (published at {anchor.where})" if anchor.where else ""
            event = session.get(Event, anchor.seq)
            if event is None:
                problems.append(
                    Problem(f"anchor:{anchor.seq}", f"the log has no event #{anchor.seq}{where}: it was truncated")
                )
            elif event.hash != anchor.hash:
                problems.append(
                    Problem(
                        f"anchor:{anchor.seq}",
                        f"event #{anchor.seq} has hash {event.hash[:16]}…, not the published {anchor.hash[:16]}…"
                        f"{where}: the log was rewritten after the anchor was published",
                    )
                )
    return problems


#: Rows read at a time; a batch with a row that cannot be read is read again one row at a time.
_BATCH = 500


@dataclass(frozen=True)
class _Unreadable:
    """A row whose stored values cannot be read as its columns' types (a date that is not one, JSON cut
    short): edited outside openlab. Its key and, for an event, the hash column (text, always readable)."""

    key: Any
    error: str
    hash: str | None = None


def _rows(store: LineageStore, model: Any, key: Any) -> Iterator[Any]:
    """Every row of ``model`` in ``key`` order, an unreadable one as :class:`_Unreadable` in its place.
    Loaded whole, one row SQL had set to a date that is not one stopped verify with a traceback, hiding
    every other problem behind it."""
    with store.session() as session:
        keys = list(session.exec(select(key).order_by(key)))
    for start in range(0, len(keys), _BATCH):
        part = keys[start : start + _BATCH]
        with store.session() as session:
            try:
                rows = list(session.exec(select(model).where(key.in_(part)).order_by(key)))
            except (ValueError, TypeError, StatementError):
                rows = None
        if rows is not None:
            yield from rows
            continue
        for one in part:
            with store.session() as session:
                try:
                    yield from session.exec(select(model).where(key == one))
                except (ValueError, TypeError, StatementError) as exc:
                    found = session.exec(select(Event.hash).where(Event.seq == one)).first() if model is Event else None
                    yield _Unreadable(one, " ".join(str(exc).split())[:200], found)


def _readable(store: LineageStore, model: Any) -> Iterator[Any]:
    """The rows of ``model`` that can be read (the records check names the others)."""
    return (row for row in _rows(store, model, col(model.id)) if not isinstance(row, _Unreadable))


def _check_chain(store: LineageStore) -> tuple[list[Problem], dict[tuple[str, str], dict]]:
    problems: list[Problem] = []
    latest: dict[tuple[str, str], dict] = {}
    expected_seq, prev = 1, GENESIS_HASH
    for ev in _rows(store, Event, col(Event.seq)):
        if isinstance(ev, _Unreadable):
            problems.append(Problem(f"event:{ev.key}", f"unreadable, edited outside openlab: {ev.error}"))
            expected_seq, prev = ev.key + 1, ev.hash or ""
            continue
        if ev.seq != expected_seq:
            problems.append(Problem(f"event:{expected_seq}", f"missing (next event is {ev.seq}): events deleted"))
        if ev.prev_hash != prev:
            problems.append(Problem(f"event:{ev.seq}", "prev_hash does not match the previous event's hash"))
        digest = event_hash(ev.seq, ev.at, ev.record_kind, ev.record_id, ev.action, ev.payload, ev.prev_hash)
        if digest != ev.hash:
            problems.append(
                Problem(f"event:{ev.seq}", f"content does not match its hash ({ev.record_kind}:{ev.record_id})")
            )
        latest[(ev.record_kind, ev.record_id)] = ev.payload
        expected_seq, prev = ev.seq + 1, ev.hash
    return problems, latest


def _check_records(store: LineageStore, latest: dict[tuple[str, str], dict]) -> list[Problem]:
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for kind, model in RECORD_TYPES.items():
        for row in _rows(store, model, col(model.id)):
            if isinstance(row, _Unreadable):
                seen.add((kind, row.key))
                problems.append(Problem(f"{kind}:{row.key}", f"unreadable, edited outside openlab: {row.error}"))
                continue
            key = (kind, row.id)  # type: ignore[attr-defined]
            seen.add(key)
            recorded = latest.get(key)
            if recorded is None:
                problems.append(Problem(f"{kind}:{key[1]}", "has no event: written outside openlab"))
                continue
            with warnings.catch_warnings():  # pydantic's word on a value of the wrong type: said below
                warnings.simplefilter("ignore")
                current = record_payload(row)
            # A column added by a later migration is absent from older events; it
            # holds its default (None) until an event records a value for it.
            fields = sorted(
                k
                for k in current.keys() | recorded.keys()
                if (k in recorded or current[k] is not None) and current.get(k) != recorded.get(k)
            )
            if fields:
                problems.append(
                    Problem(f"{kind}:{key[1]}", f"edited outside openlab: {', '.join(fields)} differ from its log")
                )
    for kind, record_id in sorted(latest.keys() - seen):
        problems.append(Problem(f"{kind}:{record_id}", "deleted outside openlab (its events remain)"))
    return problems


def _check_data(
    store: LineageStore, settings: Settings, progress: Progress | None, notes: list[str] | None = None
) -> list[Problem]:
    from orchestrator.snapshots import content_hash, verify_snapshot

    problems: list[Problem] = []
    # snapshots whose data (or manifest) is on storage not mounted here -> not checked: as outputs below,
    # a snapshot taken on the cluster (/lustre/corpus/v3) is no problem on a laptop that audits from
    # the shared store; the folder that held it being gone is what tells "not here" from "deleted"
    unmounted: dict[Path, list[str]] = {}
    for snap in _readable(store, DataSnapshot):
        if snap.removed_at is not None:
            continue  # its folder was replaced by a forced re-run (the record says when and why)
        if progress:
            progress(f"snapshot {snap.id[:16]}")
        manifest = Path(snap.manifest_path)
        if not manifest.exists():
            manifest = settings.snapshots_dir / f"{snap.id}.json"
        if not manifest.exists():
            if not Path(snap.manifest_path).parent.is_dir():
                unmounted.setdefault(Path(snap.manifest_path).parent, []).append(snap.id)
                continue
            problems.append(Problem(f"snapshot:{snap.id}", f"manifest {snap.manifest_path} is missing"))
            continue
        data = Path(snap.path)
        if not os.path.lexists(data) and not data.parent.is_dir():
            unmounted.setdefault(data.parent, []).append(snap.id)
            continue
        try:
            found = verify_snapshot(manifest, settings)
        except OpenlabError as exc:
            found = [str(exc)]
        try:
            manifest_id = json.loads(manifest.read_bytes()).get("id")
        except (OSError, ValueError):
            manifest_id = None
        if manifest_id != snap.id:
            found.append(f"manifest id {manifest_id} is not the recorded id")
        problems.extend(Problem(f"snapshot:{snap.id}", msg) for msg in found)
    away: dict[Path, list[str]] = {}  # artifact root not on this machine -> its artifacts, not checked
    for art in _readable(store, Artifact):
        if art.removed_at is not None:
            continue  # removed by `openlab gc` or replaced by a re-run (new bytes may be there): the record says
        path = Path(art.uri.removeprefix("file://"))
        if not os.path.lexists(path):
            root = artifact_root(path, art.name, settings)
            # another machine's storage, not mounted here: nothing to say of it. Not this openlab's own
            # root beside its own SQLite file, which only this machine wrote to: gone, that root is
            # every output deleted (`rm -rf $OPENLAB_HOME/artifacts` was a note and "verified")
            if not root.is_dir() and not (store.is_sqlite and root == settings.artifacts_dir):
                away.setdefault(root, []).append(art.id)
                continue
            problems.append(Problem(f"artifact:{art.id}", _missing_artifact(store, art, path)))
            continue
        if progress:
            progress(f"artifact {art.name}")
        try:
            digest = content_hash(path)
        except OpenlabError as exc:
            problems.append(Problem(f"artifact:{art.id}", str(exc)))
            continue
        if digest != art.content_hash and not _only_volatile_moved(art.content_hash, path, settings):
            which = _changed_files(art.content_hash, path, settings)
            problems.append(
                Problem(
                    f"artifact:{art.id}",
                    f"{path} content changed (recorded {art.content_hash[:16]}…, now {digest[:16]}…)"
                    + (f": {which}" if which else ""),
                )
            )
    if notes is not None:
        notes.extend(_not_here(root, ids, "snapshot", "folder") for root, ids in sorted(unmounted.items()))
        notes.extend(_not_here(root, ids) for root, ids in sorted(away.items()))
    return problems


def _only_volatile_moved(content_hash: str, path: Path, settings: Settings) -> bool:
    """Whether what changed in an output since it was recorded is only its volatile files (W&B's run
    folder, ``metrics.json``, logs: what no later stage reads), by the manifest recorded with it. A
    successful ``openlab wandb sync`` marks the run folder synced, inside the output, and verify said
    the output had been tampered with."""
    from orchestrator.pipeline.outputs import stable_root
    from orchestrator.snapshots import SnapshotEntry, content_entries, load_manifest

    try:
        recorded = [SnapshotEntry.from_dict(d) for d in load_manifest(content_hash, settings)["entries"]]
        return stable_root(recorded) == stable_root(content_entries(path))
    except (OpenlabError, KeyError, TypeError, ValueError):
        return False  # no manifest to tell by: the change is reported


def _changed_files(content_hash: str, path: Path, settings: Settings, most: int = 5) -> str:
    """Which files of an output changed, from the manifest recorded with it (``checkpoint/state.pt
    content changed``), where that manifest is still here; "" where it is not."""
    from orchestrator.snapshots import SnapshotError, verify_snapshot

    manifest = settings.snapshots_dir / f"{content_hash}.json"
    if not manifest.is_file():
        return ""
    try:
        found = verify_snapshot(manifest, settings, path=path)
    except (SnapshotError, OSError, ValueError):
        return ""
    said = [line.split(": ", 1)[1] if ": " in line else line for line in found]
    more = f"; and {len(said) - most} more" if len(said) > most else ""
    return "; ".join(said[:most]) + more


def artifact_root(path: Path, name: str, settings: Settings) -> Path:
    """The artifact root an output lives under: the configured one (``[artifacts] root``) when the
    path is under it, else the folder above ``<stage>/<identity>`` (outputs of another machine, or of
    a root configured otherwise when they were made), else the folder that holds it."""
    configured = settings.artifacts_dir
    if path.is_relative_to(configured) and path != configured:
        return configured
    stage = name.split("/", 1)[0]
    return path.parent.parent if stage and path.parent.name == stage else path.parent


def _missing_artifact(store: LineageStore, art: Artifact, path: Path) -> str:
    """What a missing output's problem says: which stage run made it, where it was, and why it is a
    problem (a removal openlab made is recorded; this one is not)."""
    made_by = [r for r in store.relations(art.id) if r.relation == "wasGeneratedBy" and r.subject_id == art.id]
    run = store.get(StageRun, made_by[0].object_id) if made_by else None
    stage = run.stage if run is not None else art.name.split("/", 1)[0]
    by = f"stage {stage}, stage run {run.id}" if run is not None else f"stage {stage}"
    what = "output folder" if art.artifact_type in ("folder", "directory") else "output"
    return (
        f"{art.name} ({by}): {what} {path} is missing, and lineage records no removal of it "
        "(`openlab gc` records each removal it makes: a folder deleted by hand looks like this)"
    )


def _not_here(root: Path, ids: list[str], kind: str = "artifact", where: str = "artifact root") -> str:
    shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
    return (
        f"{len(ids)} {kind}{'s' if len(ids) != 1 else ''} not on this machine, not checked "
        f"(their {where} {root} is not here): {shown}"
    )


def _check_commits(store: LineageStore, settings: Settings, notes: list[str] | None = None) -> list[Problem]:
    """Each commit still in the repository it was recorded in, and each dirty patch in the blobs. A
    commit whose repository is not on this machine (a clone elsewhere, moved) is noted, not checked:
    the line that says lineage verified said "commits present" of it all the same."""
    from orchestrator.provenance.git import commit_exists

    problems: list[Problem] = []
    away: dict[Path, list[str]] = {}
    for commit in _readable(store, Commit):
        label = f"commit:{commit.id}"
        if commit.sha and commit.repo_path and not Path(commit.repo_path).exists():
            away.setdefault(Path(commit.repo_path), []).append(commit.id)
        elif commit.sha and commit.repo_path:
            if not commit_exists(Path(commit.repo_path), commit.sha):
                problems.append(Problem(label, f"commit {commit.sha} no longer exists in {commit.repo_path}"))
        if commit.patch_hash:
            blob = settings.blobs_dir / commit.patch_hash
            if not blob.exists():
                problems.append(Problem(label, f"dirty patch {commit.patch_hash[:16]}… is missing from {blob.parent}"))
            elif hash_file(blob) != commit.patch_hash:
                problems.append(Problem(label, f"dirty patch {blob} does not match its recorded hash"))
    if notes is not None:
        notes.extend(_not_here(repo, ids, kind="commit", where="repository") for repo, ids in sorted(away.items()))
    return problems


def verify(
    store: LineageStore,
    settings: Settings | None = None,
    *,
    progress: Progress | None = None,
    anchors: Iterable[Anchor] = (),
    notes: list[str] | None = None,
) -> list[Problem]:
    """Run every check (anchors only when given); an empty list means lineage is intact. What could
    not be checked here (outputs whose artifact root is another machine's storage, not mounted on
    this one, commits whose repository is not here) is appended to ``notes``: no problem, but no
    pass either."""
    settings = settings or load_settings()
    chain_problems, latest = _check_chain(store)
    problems = chain_problems + _check_records(store, latest)
    problems += _check_data(store, settings, progress, notes)
    problems += _check_commits(store, settings, notes)
    problems += check_anchors(store, anchors)
    return problems
