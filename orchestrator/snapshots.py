"""Content-addressed data snapshots: what exactly was in a file or folder when a stage used it.

A snapshot is a manifest listing every file under a root (relative POSIX path, size,
BLAKE3 of the content) plus the symlinks that stay inside the root; its id is a hash
over that list, so the same bytes under the same names give the same id on any
machine, whatever order the filesystem lists them in.

Snapshot id (``openlab-snapshot-v1``), precisely:

* Entries are the regular files and symlinks below the root. Directories are not
  entries (like git, an empty sub-folder leaves no trace). When the root is a single
  file, it is one entry whose path is the file's name.
* Paths are relative to the root, ``/``-separated, Unicode NFC.
* ``leaf(file) = BLAKE3(canonical_json(["file", path, size, blake3_hex_of_content]))``
  and ``leaf(link) = BLAKE3(canonical_json(["link", path, target]))`` where ``target``
  is the link's text (``os.readlink``) with ``/`` separators; each leaf is the 32-byte
  raw digest.
* Leaves are sorted by ``path`` (code point order, identical to UTF-8 byte order).
* ``id = hex(BLAKE3(b"openlab-snapshot-v1\\x00" + leaf_1 + leaf_2 + ... + leaf_n))``.
  An empty folder therefore has the id ``hex(BLAKE3(b"openlab-snapshot-v1\\x00"))``.

A one-level hash list is enough for integrity (BLAKE3 is itself a Merkle tree over
its input); proving membership of a single file without the manifest is not a goal.

Symlinks inside the root are recorded as links, not followed: following would count
the target's bytes twice and lose the structure, while the target's content is
already in the snapshot because it must live inside the root. A link that resolves
outside the root, or dangles, is refused, as are fifos, sockets, device files and
unreadable files or folders: each would make the snapshot not mean what it says.

Re-snapshotting unchanged data is cheap: a stat cache per root (one JSON file under
``snapshots_dir/cache/``) maps ``(size, mtime_ns, inode, ctime_ns)`` to the content
hash, so a warm snapshot costs one ``lstat`` per file and reads no data.
:func:`verify_snapshot` does not trust that cache by default: it re-reads every byte.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import stat as _stat
import tempfile
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from orchestrator.errors import NotFoundError, OpenlabError
from orchestrator.hashing import hash_bytes
from orchestrator.settings import Settings, load_settings

MERKLE_SCHEME = "openlab-snapshot-v1"
_ROOT_PREFIX = MERKLE_SCHEME.encode() + b"\x00"
MANIFEST_VERSION = 1
CACHE_VERSION = 2

#: Files at least this big are hashed one at a time with BLAKE3's own multithreading
#: (memory-mapped); smaller ones are spread over a thread pool, one file per task.
BIG_FILE_BYTES = 16 << 20
#: Threads hashing small files in parallel (file reads and BLAKE3 release the GIL).
SMALL_FILE_WORKERS = max(2, min(8, (os.cpu_count() or 2) * 2))
#: A file modified this close to the start of a snapshot is hashed but not cached:
#: a later write within the same timestamp tick would otherwise leave the same stat.
RACY_NS = 20_000_000
_COARSE_RACY_NS = 2_000_000_000

ProgressFn = Callable[[int, int], None]
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class SnapshotError(OpenlabError):
    """The path cannot be snapshotted as asked (missing, unsafe or unreadable)."""


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """One file (``blake3`` set) or in-root symlink (``link`` set) of a snapshot."""

    path: str
    size: int = 0
    blake3: str | None = None
    link: str | None = None

    def leaf(self) -> bytes:
        """The raw 32-byte leaf digest defined in the module docstring."""
        return blake3.blake3(self.leaf_payload()).digest()

    def leaf_payload(self) -> bytes:
        """``canonical_json`` of the leaf list, built directly for speed.

        Paths are already NFC and the other fields are ASCII hex or ints, so this is
        byte-identical to ``canonical_json([...])`` (tests check it) while costing one
        C-level string encode instead of a recursive normalisation per file: on a warm
        snapshot of 10,000 files that difference is most of the run time.
        """
        if self.link is not None:
            return f'["link",{_dumps(self.path)},{_dumps(self.link)}]'.encode()
        return f'["file",{_dumps(self.path)},{self.size},"{self.blake3}"]'.encode()

    def to_dict(self) -> dict[str, Any]:
        if self.link is not None:
            return {"path": self.path, "link": self.link}
        return {"path": self.path, "size": self.size, "blake3": self.blake3}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SnapshotEntry:
        if "link" in data:
            return cls(path=data["path"], link=data["link"])
        return cls(path=data["path"], size=int(data["size"]), blake3=data["blake3"])


@dataclass(frozen=True)
class Snapshot:
    """The result of :func:`snapshot`; ``to_dict()`` is the ``openlab snapshot --json`` object."""

    id: str
    path: Path
    files: int
    bytes: int
    manifest_path: Path
    entries: tuple[SnapshotEntry, ...] = field(repr=False)
    created: str = ""
    #: Files whose hash came from the stat cache (no data read).
    cache_hits: int = 0
    #: Files whose content was read and hashed in this call.
    hashed_files: int = 0
    hashed_bytes: int = 0

    def to_dict(self, *, include_entries: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "path": str(self.path),
            "files": self.files,
            "bytes": self.bytes,
            "manifest_path": str(self.manifest_path),
            "created": self.created,
            "cache_hits": self.cache_hits,
            "hashed_files": self.hashed_files,
            "hashed_bytes": self.hashed_bytes,
        }
        if include_entries:
            out["entries"] = [e.to_dict() for e in self.entries]
        return out


def merkle_root(entries: Iterable[SnapshotEntry]) -> str:
    """Snapshot id of ``entries`` (any order) as defined in the module docstring."""
    hasher = blake3.blake3(_ROOT_PREFIX)
    for entry in sorted(entries, key=lambda e: e.path):
        hasher.update(entry.leaf())
    return hasher.hexdigest()


# --------------------------------------------------------------------------- walking


@dataclass(slots=True)
class _Found:
    rel: str
    abs: str
    st: os.stat_result
    link: str | None = None


def _rel_key(found: _Found) -> str:
    return found.rel


def _nfc(text: str) -> str:
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def _inside(root: str, target: str) -> bool:
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def _walk(root: Path, on_problem: Callable[[str], None] | None = None) -> list[_Found]:
    """List files and symlinks under ``root`` with one ``lstat`` each.

    Unsafe entries raise :class:`SnapshotError`, or are passed to ``on_problem`` and
    skipped when given (verify wants every problem, not the first).
    """

    def problem(msg: str) -> None:
        if on_problem is None:
            raise SnapshotError(msg)
        on_problem(msg)

    root_str = str(root)
    try:
        root_st = os.stat(root_str)
    except FileNotFoundError:
        raise SnapshotError(f"{root}: no such file or folder; check the path") from None
    except OSError as exc:
        raise SnapshotError(f"{root}: cannot stat ({exc.strerror}); check permissions") from None

    if _stat.S_ISREG(root_st.st_mode):
        return [_Found(_nfc(root.name), root_str, root_st)]
    if not _stat.S_ISDIR(root_st.st_mode):
        raise SnapshotError(f"{root}: not a regular file or folder (device, fifo or socket); cannot snapshot")

    found: list[_Found] = []
    stack = [("", root_str)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        try:
            with os.scandir(abs_dir) as it:
                children = list(it)
        except OSError as exc:
            problem(f"{abs_dir}: cannot list folder ({exc.strerror}); fix its permissions or exclude it")
            continue
        for child in children:
            rel = f"{rel_dir}/{child.name}" if rel_dir else child.name
            try:
                child.name.encode("utf-8")
            except UnicodeEncodeError:  # a manifest is JSON text: such a name has no place in it
                shown = os.fsencode(child.path).decode("utf-8", "backslashreplace")
                problem(f"{shown}: a file name that is not UTF-8 cannot be recorded; rename it")
                continue
            try:
                st = child.stat(follow_symlinks=False)
            except OSError as exc:
                problem(f"{child.path}: cannot stat ({exc.strerror})")
                continue
            mode = st.st_mode
            if _stat.S_ISDIR(mode):
                stack.append((rel, child.path))
            elif _stat.S_ISREG(mode):
                found.append(_Found(_nfc(rel), child.path, st))
            elif _stat.S_ISLNK(mode):
                target = os.readlink(child.path)
                resolved = os.path.realpath(child.path)
                if not _inside(root_str, resolved):
                    problem(
                        f"{child.path}: symlink points outside the snapshot root ({target}); "
                        "copy the data in or snapshot the target separately"
                    )
                    continue
                if not os.path.exists(resolved):
                    problem(f"{child.path}: dangling symlink ({target}); remove it or restore its target")
                    continue
                found.append(_Found(_nfc(rel), child.path, st, link=_nfc(target.replace(os.sep, "/"))))
            else:
                kind = "fifo" if _stat.S_ISFIFO(mode) else "socket" if _stat.S_ISSOCK(mode) else "device file"
                problem(f"{child.path}: is a {kind}, which cannot be snapshotted; remove or exclude it")
    # names are recorded in NFC: two that differ only in normalisation (café typed on macOS and on Linux)
    # would be one entry, one file's content standing for both
    first: dict[str, str] = {}
    for f in found:
        other = first.setdefault(f.rel, f.abs)
        if other != f.abs:
            problem(
                f"{other} and {f.abs}: names that differ only in Unicode normalisation are one name here; rename one"
            )
    return found


# --------------------------------------------------------------------------- hashing


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def _hash_small(path: str, st: os.stat_result) -> str:
    """Hash a file read in one go; checks it did not change while being read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except PermissionError:
        raise SnapshotError(f"{path}: unreadable (permission denied); fix its permissions") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot open ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "rb", buffering=0) as fh:
            hasher = blake3.blake3()
            remaining = st.st_size + 1
            while remaining > 0:
                block = fh.read(min(remaining, 8 << 20))
                if not block:
                    break
                hasher.update(block)
                remaining -= len(block)
            after = os.fstat(fh.fileno())
    except OSError as exc:
        raise SnapshotError(f"{path}: read failed ({exc.strerror})") from None
    _check_unchanged(path, st, after)
    return hasher.hexdigest()


def _hash_big(path: str, st: os.stat_result) -> str:
    """Hash a large file with BLAKE3's multithreaded mmap path (all cores on one file)."""
    try:
        with open(path, "rb") as fh:  # refuse unreadable files with our own message
            if hasattr(os, "posix_fadvise"):
                # mmap faults pages in as threads touch them; on a cold page cache,
                # asking for sequential read-ahead of the whole file up front keeps
                # the disk streaming instead of serving scattered faults.
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        hasher.update_mmap(path)
        after = os.stat(path)
    except PermissionError:
        raise SnapshotError(f"{path}: unreadable (permission denied); fix its permissions") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: read failed ({exc.strerror})") from None
    _check_unchanged(path, st, after)
    return hasher.hexdigest()


def _check_unchanged(path: str, before: os.stat_result, after: os.stat_result) -> None:
    if _stat_key(before) != _stat_key(after):
        raise SnapshotError(f"{path}: changed while being snapshotted; retry once writers have finished")


def _hash_file(path: str, st: os.stat_result) -> str:
    """Content hash of one file (the single place data is read; tests count calls here)."""
    return _hash_big(path, st) if st.st_size >= BIG_FILE_BYTES else _hash_small(path, st)


def _same_file(st: os.stat_result) -> tuple[int, int, int, int]:
    """What makes two names one file's (hard links: a checkpoint revision and the ``state.pt`` it was
    saved as), so its bytes are read once."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _hashing_once() -> Callable[[_Found], str]:
    """:func:`_hash_file` that reads a file with several names once for as long as it is kept."""
    read: dict[tuple[int, int, int, int], str] = {}

    def digest(f: _Found) -> str:
        key = _same_file(f.st)
        if key not in read:
            read[key] = _hash_file(f.abs, f.st)
        return read[key]

    return digest


def _hash_many(
    todo: Sequence[_Found], total_bytes: int, done_bytes: int, progress: ProgressFn | None
) -> dict[str, str]:
    """Hash ``todo``: big files one by one (each using every core), small ones in a pool."""
    out: dict[str, str] = {}
    lock = threading.Lock()
    done = [done_bytes]

    def tick(n: int) -> None:
        if progress is not None:
            with lock:
                done[0] += n
                progress(done[0], total_bytes)

    big = [f for f in todo if f.st.st_size >= BIG_FILE_BYTES]
    small = [f for f in todo if f.st.st_size < BIG_FILE_BYTES]
    for f in big:
        out[f.rel] = _hash_file(f.abs, f.st)
        tick(f.st.st_size)
    if len(small) <= 1 or SMALL_FILE_WORKERS <= 1:
        for f in small:
            out[f.rel] = _hash_file(f.abs, f.st)
            tick(f.st.st_size)
        return out

    def work(f: _Found) -> tuple[str, str]:
        digest = _hash_file(f.abs, f.st)
        tick(f.st.st_size)
        return f.rel, digest

    with ThreadPoolExecutor(max_workers=SMALL_FILE_WORKERS, thread_name_prefix="openlab-hash") as pool:
        for rel, digest in pool.map(work, small):
            out[rel] = digest
    return out


# --------------------------------------------------------------------------- stat cache


def _cache_path(settings: Settings, root: Path) -> Path:
    return settings.snapshots_dir / "cache" / f"{hash_bytes(str(root).encode('utf-8'))[:32]}.json"


def _load_cache(path: Path, root: Path) -> tuple[dict[str, list[Any]], dict[str, str], str | None]:
    """Read a root's stat cache: file entries, in-root links, and the id they made.

    Anything unreadable, of another version or for another root is an empty cache:
    the cache is only ever an optimisation.
    """
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}, {}, None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("root") != str(root):
        return {}, {}, None
    entries = data.get("entries")
    links = data.get("links")
    last = data.get("manifest")
    return (
        entries if isinstance(entries, dict) else {},
        links if isinstance(links, dict) else {},
        last if isinstance(last, str) else None,
    )


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a unique temp file and ``os.replace``.

    Two processes writing the same path each replace it whole; readers see one
    complete version or the other, never a mix. For the stat cache the last writer
    wins, which is safe because every entry is re-validated against the file's stat.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _racy(st: os.stat_result, start_ns: int) -> bool:
    newest = max(st.st_mtime_ns, st.st_ctime_ns)
    window = _COARSE_RACY_NS if st.st_mtime_ns % 1_000_000_000 == 0 else RACY_NS
    return newest >= start_ns - window


# --------------------------------------------------------------------------- public API


def _resolve_root(path: Path) -> Path:
    path = Path(path).expanduser()
    if not os.path.lexists(path):
        raise SnapshotError(f"{path}: no such file or folder; check the path")
    return Path(os.path.realpath(path))


def _settings(settings: Settings | None) -> Settings:
    return settings if settings is not None else load_settings()


def snapshot(
    path: Path,
    *,
    settings: Settings | None = None,
    progress: ProgressFn | None = None,
) -> Snapshot:
    """Snapshot a file or folder and write its manifest to ``snapshots_dir/<id>.json``.

    ``progress(done_bytes, total_bytes)`` is called as content is hashed (cache hits
    count as done at once). Raises :class:`SnapshotError` naming the offending path for
    anything that cannot be snapshotted faithfully.
    """
    settings = _settings(settings)
    root = _resolve_root(path)
    start_ns = time.time_ns()
    found = _walk(root)
    found.sort(key=_rel_key)

    cache_file = _cache_path(settings, root)
    cache, links_before, last_manifest = _load_cache(cache_file, root)
    # Cache entry: [size, mtime_ns, inode, ctime_ns, blake3_hex, leaf_hex]. Keeping the
    # leaf saves re-serialising and re-hashing every leaf on a warm run.
    new_cache: dict[str, list[Any]] = {}
    links: dict[str, str] = {}
    todo: list[_Found] = []
    total = 0
    hit_bytes = 0
    cache_get = cache.get
    for f in found:
        if f.link is not None:
            links[f.rel] = f.link
            continue
        st = f.st
        size = st.st_size
        total += size
        c = cache_get(f.rel)
        if (
            c is not None
            and c[0] == size
            and c[1] == st.st_mtime_ns
            and c[2] == st.st_ino
            and c[3] == st.st_ctime_ns
            and len(c) == 6
        ):
            new_cache[f.rel] = c
            hit_bytes += size
        else:
            todo.append(f)
    if progress is not None:
        progress(hit_bytes, total)

    # One read per file, however many names it has here (a checkpoint revision is a hard link to the
    # checkpoint saved at its step): the other names take the first one's hash.
    first_name: dict[tuple[int, int, int, int], str] = {}
    unique: list[_Found] = []
    same_as: dict[str, str] = {}
    for f in todo:
        name = first_name.setdefault(_same_file(f.st), f.rel)
        if name == f.rel:
            unique.append(f)
        else:
            same_as[f.rel] = name
    alias_bytes = sum(f.st.st_size for f in todo if f.rel in same_as)
    hashed = _hash_many(unique, total, hit_bytes + alias_bytes, progress)
    for alias, name in same_as.items():
        hashed[alias] = hashed[name]
    fresh: dict[str, list[Any]] = {}
    for f in todo:
        entry = SnapshotEntry(path=f.rel, size=f.st.st_size, blake3=hashed[f.rel])
        fresh[f.rel] = [*_stat_key(f.st), hashed[f.rel], entry.leaf().hex()]
        if not _racy(f.st, start_ns):
            new_cache[f.rel] = fresh[f.rel]

    entries: list[SnapshotEntry] = []
    leaves: list[bytes] = []
    for f in found:
        if f.link is not None:
            entry = SnapshotEntry(path=f.rel, link=f.link)
            leaves.append(entry.leaf())
        else:
            rec = new_cache.get(f.rel) or fresh[f.rel]
            entry = SnapshotEntry(path=f.rel, size=f.st.st_size, blake3=rec[4])
            leaves.append(bytes.fromhex(rec[5]))
        entries.append(entry)
    manifest_path: Path
    unchanged = not todo and last_manifest is not None and links == links_before and len(new_cache) == len(cache)
    if unchanged:
        # Every file hit, none added or removed: the id is the one this cache was
        # written with, so the leaves need not be re-hashed.
        snap_id = str(last_manifest)
    else:
        snap_id = blake3.blake3(_ROOT_PREFIX + b"".join(leaves)).hexdigest()
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    nfiles = len(found) - len(links)
    manifest_path = settings.snapshots_dir / f"{snap_id}.json"
    # Same root, same id as last time and the manifest is still there: it already says
    # exactly this (content-addressed), so skip re-serialising 10,000 entries.
    if not (last_manifest == snap_id and manifest_path.exists()):
        manifest = {
            "version": MANIFEST_VERSION,
            "scheme": MERKLE_SCHEME,
            "id": snap_id,
            "path": str(root),
            "created": created,
            "files": nfiles,
            "bytes": total,
            "entries": [e.to_dict() for e in entries],
        }
        atomic_write(manifest_path, json.dumps(manifest, separators=(",", ":")).encode())
    if not unchanged or last_manifest != snap_id:
        body = {
            "version": CACHE_VERSION,
            "root": str(root),
            # the id these entries make, only where they are every file of it: a file written too recently
            # to cache (the last a job wrote) and deleted since left the same count of hits, and the id of
            # the folder with it was taken for the folder without it
            "manifest": snap_id if len(new_cache) == nfiles else None,
            "links": links,
            "entries": new_cache,
        }
        atomic_write(cache_file, json.dumps(body, separators=(",", ":")).encode())
    return Snapshot(
        id=snap_id,
        path=root,
        files=nfiles,
        bytes=total,
        manifest_path=manifest_path,
        entries=tuple(entries),
        created=created,
        cache_hits=nfiles - len(todo),
        hashed_files=len(unique),
        hashed_bytes=sum(f.st.st_size for f in unique),
    )


def load_manifest(ref: str | Path, settings: Settings | None = None) -> dict[str, Any]:
    """Read a manifest given its id or its file path; raises :class:`NotFoundError`."""
    settings = _settings(settings)
    ref_str = str(ref)
    candidate = Path(ref_str)
    if not (candidate.suffix == ".json" and candidate.exists()):
        candidate = settings.snapshots_dir / f"{ref_str}.json"
    try:
        data = json.loads(candidate.read_bytes())
    except FileNotFoundError:
        raise NotFoundError(f"snapshot {ref_str}: no manifest at {candidate}; run `openlab snapshot` first") from None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{candidate}: unreadable snapshot manifest ({exc}); re-create the snapshot") from None
    if not isinstance(data, dict) or "entries" not in data or "id" not in data:
        raise SnapshotError(f"{candidate}: not an openlab snapshot manifest")
    return data


def verify_snapshot(
    ref: str | Path,
    settings: Settings | None = None,
    *,
    path: Path | None = None,
    trust_stat_cache: bool = False,
) -> list[str]:
    """Return the problems (drift) between a snapshot and the data now at its path.

    ``ref`` is a snapshot id or a manifest path; ``path`` overrides the data location
    recorded in the manifest. By default every file is re-read and re-hashed, because
    verification must not take a cache's word for it; ``trust_stat_cache=True`` gives a
    fast check that only re-hashes files whose stat changed. Also checks that the
    manifest's entries still hash to its id (an edited manifest is reported). An empty
    list means the data matches.
    """
    settings = _settings(settings)
    manifest = load_manifest(ref, settings)
    snap_id = str(manifest["id"])
    label = f"snapshot {snap_id[:16]}"
    problems: list[str] = []
    try:
        recorded = {e.path: e for e in (SnapshotEntry.from_dict(d) for d in manifest["entries"])}
    except (KeyError, TypeError, ValueError):
        return [f"{label}: manifest entries are malformed"]
    if merkle_root(recorded.values()) != snap_id:
        problems.append(f"{label}: manifest does not hash to its id (edited after it was written)")

    data_path = Path(path) if path is not None else Path(manifest.get("path", ""))
    if not os.path.lexists(data_path):
        return [*problems, f"{label}: data path {data_path} is missing"]
    root = Path(os.path.realpath(data_path))
    try:
        found = _walk(root, on_problem=lambda msg: problems.append(f"{label}: {msg}"))
    except SnapshotError as exc:
        return [*problems, f"{label}: {exc}"]

    cache = _load_cache(_cache_path(settings, root), root)[0] if trust_stat_cache else {}
    digest_of = _hashing_once()  # every byte re-read, a file with several names once
    current = {f.rel: f for f in found}
    for rel in sorted(set(recorded) - set(current)):
        problems.append(f"{label}: {rel} is missing")
    for rel in sorted(set(current) - set(recorded)):
        problems.append(f"{label}: {rel} was added")
    for rel in sorted(set(recorded) & set(current)):
        want, f = recorded[rel], current[rel]
        if want.link is not None or f.link is not None:
            if want.link != f.link:
                problems.append(f"{label}: {rel} link changed ({want.link!r} -> {f.link!r})")
            continue
        if f.st.st_size != want.size:
            problems.append(f"{label}: {rel} changed size ({want.size} -> {f.st.st_size} bytes)")
            continue
        cached = cache.get(rel)
        if cached is not None and len(cached) == 6 and cached[:4] == list(_stat_key(f.st)):
            digest = cached[4]
        else:
            try:
                digest = digest_of(f)
            except SnapshotError as exc:
                problems.append(f"{label}: {exc}")
                continue
        if digest != want.blake3:
            problems.append(f"{label}: {rel} content changed (blake3 {want.blake3[:16]}... -> {digest[:16]}...)")
    return problems


def file_hash(path: Path) -> str:
    """The BLAKE3 digest of one file, as a manifest's entry for it holds it (read in full)."""
    return _hash_file(str(path), os.stat(path))


def content_hash(path: Path) -> str:
    """Content hash of an output file or folder: the id its snapshot would have.

    Unlike :func:`snapshot` this writes no manifest and trusts no stat cache: every
    file is re-read. Artifacts are recorded and verified with it, so an artifact's
    hash and a snapshot of the same data are always the same string.
    """
    return merkle_root(content_entries(path))


def content_entries(path: Path) -> list[SnapshotEntry]:
    """The manifest entries of an output file or folder as it is now, every file re-read (no stat
    cache, no manifest written): what :func:`content_hash` hashes."""
    root = _resolve_root(path)
    digest = _hashing_once()
    return [
        SnapshotEntry(path=f.rel, link=f.link)
        if f.link is not None
        else SnapshotEntry(path=f.rel, size=f.st.st_size, blake3=digest(f))
        for f in _walk(root)
    ]
