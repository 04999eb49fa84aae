"""Data snapshots: stable ids, stat cache, drift detection and refusal of unsafe paths."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import orchestrator.snapshots as snapshots
from orchestrator.errors import NotFoundError, OpenlabError
from orchestrator.hashing import canonical_json, hash_bytes
from orchestrator.settings import Settings, load_settings
from orchestrator.snapshots import SnapshotEntry, SnapshotError, merkle_root, snapshot, verify_snapshot


@pytest.fixture()
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("OPENLAB_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return load_settings(cwd=tmp_path)


def _settle() -> None:
    """Let freshly written files age past the racy window so the stat cache keeps them."""
    time.sleep(snapshots.RACY_NS / 1e9 + 0.03)


def make_tree(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"alpha\n")
    (root / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10)
    (root / "sub" / "deeper" / "c.txt").write_text("gamma", encoding="utf-8")
    return root


@pytest.fixture()
def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = snapshots._hash_file

    def counting(path: str, st: os.stat_result) -> str:
        calls.append(path)
        return real(path, st)

    monkeypatch.setattr(snapshots, "_hash_file", counting)
    return calls


def test_manifest_and_contract_fields(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    snap = snapshot(root, settings=settings)
    assert snap.files == 3
    assert snap.bytes == 6 + 2560 + 5
    assert snap.manifest_path == settings.snapshots_dir / f"{snap.id}.json"
    manifest = json.loads(snap.manifest_path.read_text())
    assert manifest["id"] == snap.id and manifest["files"] == 3 and manifest["bytes"] == snap.bytes
    assert manifest["path"] == str(root.resolve())
    assert [e["path"] for e in manifest["entries"]] == ["a.txt", "sub/b.bin", "sub/deeper/c.txt"]
    assert manifest["entries"][0]["blake3"] == hash_bytes(b"alpha\n")
    d = snap.to_dict()
    assert {"id", "files", "bytes"} <= set(d)
    json.dumps(d)


def test_merkle_definition_matches_docstring(tmp_path: Path, settings: Settings) -> None:
    import blake3

    snap = snapshot(make_tree(tmp_path / "data"), settings=settings)
    leaves = b"".join(blake3.blake3(canonical_json(["file", e.path, e.size, e.blake3])).digest() for e in snap.entries)
    assert snap.id == blake3.blake3(b"openlab-snapshot-v1\x00" + leaves).hexdigest()
    # fast payload is byte-identical to canonical_json, including non-ASCII paths
    entry = SnapshotEntry(path='ü/日本"q".txt', size=3, blake3="ab" * 32)
    assert entry.leaf_payload() == canonical_json(["file", entry.path, 3, "ab" * 32])
    link = SnapshotEntry(path="é", link="../x")
    assert link.leaf_payload() == canonical_json(["link", "é", "../x"])


def test_id_stable_across_runs_copies_and_walk_order(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = snapshot(make_tree(tmp_path / "one"), settings=settings)
    # same content, created in a different order elsewhere: same id
    other = tmp_path / "two"
    (other / "sub" / "deeper").mkdir(parents=True)
    (other / "sub" / "deeper" / "c.txt").write_text("gamma", encoding="utf-8")
    (other / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10)
    (other / "a.txt").write_bytes(b"alpha\n")
    assert snapshot(other, settings=settings).id == first.id
    # a walk that lists directories in reverse order gives the same id
    real_scandir = os.scandir

    class Reversed:
        def __init__(self, path: str) -> None:
            self._it = real_scandir(path)

        def __enter__(self) -> list[os.DirEntry[str]]:
            return list(reversed(list(self._it.__enter__())))

        def __exit__(self, *exc: object) -> None:
            self._it.__exit__(*exc)

    monkeypatch.setattr(snapshots.os, "scandir", Reversed)
    assert snapshot(tmp_path / "one", settings=settings, progress=None).id == first.id
    assert merkle_root(reversed(first.entries)) == first.id


def test_one_byte_change_changes_id(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    before = snapshot(root, settings=settings).id
    blob = bytearray((root / "sub" / "b.bin").read_bytes())
    blob[100] ^= 1
    (root / "sub" / "b.bin").write_bytes(bytes(blob))
    assert snapshot(root, settings=settings).id != before
    (root / "a.txt").rename(root / "a2.txt")
    assert len({before, snapshot(root, settings=settings).id}) == 2


def test_warm_snapshot_reads_no_data(tmp_path: Path, settings: Settings, count_hashes: list[str]) -> None:
    root = make_tree(tmp_path / "data")
    _settle()
    cold = snapshot(root, settings=settings)
    assert len(count_hashes) == 3 and cold.hashed_files == 3 and cold.cache_hits == 0
    count_hashes.clear()
    warm = snapshot(root, settings=settings)
    assert count_hashes == [] and warm.cache_hits == 3 and warm.hashed_files == 0
    assert warm.id == cold.id and warm.entries == cold.entries
    # one changed file: exactly one re-hash
    (root / "a.txt").write_bytes(b"ALPHA\n")
    _settle()
    changed = snapshot(root, settings=settings)
    assert [Path(p).name for p in count_hashes] == ["a.txt"] and changed.cache_hits == 2
    assert changed.id != cold.id
    cache_files = list((settings.snapshots_dir / "cache").glob("*.json"))
    assert len(cache_files) == 1


def test_a_file_with_two_names_is_read_once_and_hashes_as_a_copy_would(
    tmp_path: Path, settings: Settings, count_hashes: list[str]
) -> None:
    """A checkpoint revision is a hard link to the checkpoint saved at its step: the snapshot reads
    its bytes once, both names get the hash, the progress still reaches the total, and the id is the
    one a folder holding two copies has (content addressing does not see links)."""
    linked = tmp_path / "linked"
    (linked / "revisions").mkdir(parents=True)
    (linked / "state.pt").write_bytes(b"w" * 5000)
    os.link(linked / "state.pt", linked / "revisions" / "step-000006.pt")
    copied = tmp_path / "copied"
    (copied / "revisions").mkdir(parents=True)
    for rel in ("state.pt", "revisions/step-000006.pt"):
        (copied / rel).write_bytes(b"w" * 5000)
    seen: list[tuple[int, int]] = []
    snap = snapshot(linked, settings=settings, progress=lambda done, total: seen.append((done, total)))
    assert len(count_hashes) == 1 and (snap.hashed_files, snap.hashed_bytes) == (1, 5000), count_hashes
    assert len({e.blake3 for e in snap.entries}) == 1 and len(snap.entries) == 2
    assert seen[-1] == (10_000, 10_000) == (snap.bytes, snap.bytes)
    count_hashes.clear()
    assert snapshots.content_hash(linked) == snap.id and len(count_hashes) == 1  # what outputs are recorded with
    assert snapshots.content_hash(copied) == snap.id  # two copies: the same id (no manifest written for it)
    count_hashes.clear()
    assert verify_snapshot(snap.id, settings=settings) == [] and len(count_hashes) == 1  # every byte, once
    (linked / "state.pt").write_bytes(b"W" * 5000)  # rewritten in place: both names changed
    problems = verify_snapshot(snap.id, settings=settings)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "revisions/step-000006.pt content changed",
        "state.pt content changed",
    ], problems


def test_recently_modified_file_is_not_cached(tmp_path: Path, settings: Settings, count_hashes: list[str]) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "x").write_bytes(b"x")
    snapshot(root, settings=settings)  # written just now: racy, hashed but not cached
    count_hashes.clear()
    snapshot(root, settings=settings)
    assert len(count_hashes) == 1


def test_a_file_too_new_to_cache_then_deleted_changes_the_id(tmp_path: Path, settings: Settings) -> None:
    """The last file a job writes is too recent to cache; deleted after the snapshot, every other file
    still hit the cache and the folder kept the id it had with that file, so its outputs still verified."""
    root = tmp_path / "out"
    root.mkdir()
    (root / "a").write_bytes(b"a")
    _settle()
    (root / "b").write_bytes(b"b")
    with_b = snapshot(root, settings=settings)
    (root / "b").unlink()
    without = snapshot(root, settings=settings)
    assert without.id != with_b.id and without.id == snapshots.content_hash(root)


def test_names_a_manifest_cannot_hold_apart_are_refused_naming_them(tmp_path: Path, settings: Settings) -> None:
    """café written in NFC and in NFD was one entry (one file's content stood for both, and a change to
    the other moved nothing); a name that is not UTF-8 stopped the snapshot with a traceback."""
    import unicodedata

    root = tmp_path / "names"
    root.mkdir()
    (root / unicodedata.normalize("NFC", "café")).write_text("one")
    (root / unicodedata.normalize("NFD", "café")).write_text("two")
    with pytest.raises(SnapshotError, match="differ only in Unicode normalisation"):
        snapshot(root, settings=settings)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / os.fsdecode(b"x\xff")).write_text("x")
    with pytest.raises(SnapshotError, match=r"x\\xff: a file name that is not UTF-8 cannot be recorded"):
        snapshot(odd, settings=settings)


def test_corrupt_cache_is_ignored(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    _settle()
    first = snapshot(root, settings=settings)
    for cache in (settings.snapshots_dir / "cache").glob("*.json"):
        cache.write_text("{not json")
    again = snapshot(root, settings=settings)
    assert again.id == first.id and again.hashed_files == 3


def test_progress_reports_bytes(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    seen: list[tuple[int, int]] = []
    snap = snapshot(root, settings=settings, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (snap.bytes, snap.bytes)


def test_big_files_use_parallel_path(tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "BIG_FILE_BYTES", 1024)
    root = make_tree(tmp_path / "data")
    snap = snapshot(root, settings=settings)
    assert {e.path: e.blake3 for e in snap.entries}["sub/b.bin"] == hash_bytes(bytes(range(256)) * 10)


def test_empty_folder_and_single_file(tmp_path: Path, settings: Settings) -> None:
    import blake3

    empty = tmp_path / "empty"
    empty.mkdir()
    snap = snapshot(empty, settings=settings)
    assert snap.files == 0 and snap.bytes == 0
    assert snap.id == blake3.blake3(b"openlab-snapshot-v1\x00").hexdigest()
    single = tmp_path / "one.txt"
    single.write_bytes(b"hello")
    s = snapshot(single, settings=settings)
    assert s.files == 1 and s.bytes == 5 and s.entries[0].path == "one.txt"
    assert verify_snapshot(s.id, settings) == []


def test_missing_path_is_clear_error(tmp_path: Path, settings: Settings) -> None:
    with pytest.raises(OpenlabError, match="nope.*no such file"):
        snapshot(tmp_path / "nope", settings=settings)


def test_symlinks_inside_recorded_outside_refused(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    os.symlink("sub/b.bin", root / "link.bin")
    snap = snapshot(root, settings=settings)
    links = [e for e in snap.entries if e.link is not None]
    assert links == [SnapshotEntry(path="link.bin", link="sub/b.bin")] and snap.files == 3
    outside = tmp_path / "secret.txt"
    outside.write_text("x")
    os.symlink(outside, root / "escape")
    with pytest.raises(SnapshotError, match="escape.*outside the snapshot root"):
        snapshot(root, settings=settings)
    (root / "escape").unlink()
    os.symlink("../data/../secret.txt", root / "sub" / "sneaky")
    with pytest.raises(SnapshotError, match="sneaky"):
        snapshot(root, settings=settings)
    (root / "sub" / "sneaky").unlink()
    os.symlink("missing-target", root / "dangling")
    with pytest.raises(SnapshotError, match="dangling"):
        snapshot(root, settings=settings)


def test_root_given_through_symlink_is_resolved(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    os.symlink(root, tmp_path / "alias")
    assert snapshot(tmp_path / "alias", settings=settings).path == root.resolve()


def test_fifo_refused(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    os.mkfifo(root / "sub" / "pipe")
    with pytest.raises(SnapshotError, match=r"pipe.*fifo"):
        snapshot(root, settings=settings)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read a chmod 000 file; covered by the simulated test")
def test_unreadable_file_refused(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    (root / "a.txt").chmod(0)
    with pytest.raises(SnapshotError, match=r"a\.txt.*unreadable"):
        snapshot(root, settings=settings)


def test_unreadable_file_refused_simulated(tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_tree(tmp_path / "data")
    real_open = os.open

    def deny(path: str, flags: int, *args: object) -> int:
        if str(path).endswith("a.txt"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(snapshots.os, "open", deny)
    with pytest.raises(SnapshotError, match=r"a\.txt: unreadable"):
        snapshot(root, settings=settings)


def test_verify_reports_drift(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    snap = snapshot(root, settings=settings)
    assert verify_snapshot(snap.id, settings) == []
    assert verify_snapshot(snap.manifest_path, settings) == []
    (root / "a.txt").write_bytes(b"alphA\n")  # same size, different bytes
    (root / "sub" / "deeper" / "c.txt").unlink()
    (root / "new.txt").write_text("hi")
    problems = verify_snapshot(snap.id, settings)
    assert len(problems) == 3, problems
    assert any("a.txt content changed" in p for p in problems)
    assert any("sub/deeper/c.txt is missing" in p for p in problems)
    assert any("new.txt was added" in p for p in problems)


def test_verify_rehashes_even_when_stat_is_unchanged(
    tmp_path: Path, settings: Settings, count_hashes: list[str]
) -> None:
    root = make_tree(tmp_path / "data")
    _settle()
    snap = snapshot(root, settings=settings)
    # Sneaky edit that restores size and mtime: the stat cache would be fooled.
    target = root / "a.txt"
    st = target.stat()
    target.write_bytes(b"ALPHA\n")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    count_hashes.clear()
    problems = verify_snapshot(snap.id, settings)
    assert len(count_hashes) == 3
    assert any("a.txt content changed" in p for p in problems)


def test_verify_detects_edited_manifest_and_missing_data(tmp_path: Path, settings: Settings) -> None:
    root = make_tree(tmp_path / "data")
    snap = snapshot(root, settings=settings)
    manifest = json.loads(snap.manifest_path.read_text())
    manifest["entries"][0]["size"] = 7
    snap.manifest_path.write_text(json.dumps(manifest))
    assert any("does not hash to its id" in p for p in verify_snapshot(snap.id, settings))
    with pytest.raises(NotFoundError):
        verify_snapshot("0" * 64, settings)
    other = snapshot(tmp_path / "data" / "sub", settings=settings)
    import shutil

    shutil.rmtree(root / "sub")
    assert any("is missing" in p for p in verify_snapshot(other.id, settings))


def _snap_in_child(root: str, home: str) -> str:
    return snapshot(Path(root), settings=Settings(home=Path(home), db_url="sqlite://")).id


def test_two_processes_snapshot_at_once(tmp_path: Path, settings: Settings) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    root = make_tree(tmp_path / "data")
    _settle()
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        ids = list(pool.map(_snap_in_child, [str(root)] * 6, [str(settings.home)] * 6))
    assert len(set(ids)) == 1
    leftovers = [p.name for p in settings.snapshots_dir.rglob("*.tmp")]
    assert leftovers == []
    for cache in (settings.snapshots_dir / "cache").glob("*.json"):
        json.loads(cache.read_text())
    assert snapshot(root, settings=settings).hashed_files == 0
