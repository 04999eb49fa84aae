"""Provenance capture against real git repositories built in temp folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from orchestrator.hashing import hash_bytes
from orchestrator.provenance import (
    Provenance,
    ProvenanceError,
    ProvenanceWarning,
    capture,
    capture_environment,
    capture_git,
    commit_exists,
    strip_credentials,
)
from orchestrator.provenance.environment import normalise_dist_name, packages_hash
from orchestrator.settings import Settings, load_settings


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture()
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("OPENLAB_HOME", str(tmp_path / "home"))
    for var in ("GIT_DIR", "GIT_INDEX_FILE", "GIT_WORK_TREE", "GIT_OBJECT_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GIT_AUTHOR_NAME", "t")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "t@example.org")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "t")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "t@example.org")
    return load_settings(cwd=tmp_path)


@pytest.fixture()
def repo(tmp_path: Path, settings: Settings) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    (root / "src").mkdir()
    (root / "src" / "model.py").write_text("x = 1\ny = 2\n")
    (root / "data").mkdir()
    (root / "data" / "prep.py").write_text("print('prep')\n")
    (root / "logo.bin").write_bytes(bytes(range(256)))
    (root / ".gitignore").write_text("*.log\nbuild/\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_clean_repo(repo: Path, settings: Settings) -> None:
    info = capture_git(repo, code_paths=["src", "data/prep.py"], settings=settings)
    assert info.available and info.commit == git(repo, "rev-parse", "HEAD")
    assert info.branch == "main" and info.dirty is False and info.patch_hash is None
    assert info.tree_hashes == {
        "src": git(repo, "rev-parse", "HEAD:src"),
        "data/prep.py": git(repo, "rev-parse", "HEAD:data/prep.py"),
    }
    assert not settings.blobs_dir.exists()
    # capture must not touch the user's index or object store
    assert git(repo, "status", "--porcelain") == ""


def test_dirty_patch_staged_unstaged_untracked_binary(repo: Path, settings: Settings) -> None:
    (repo / "src" / "model.py").write_text("x = 1\ny = 3\n")  # unstaged
    (repo / "data" / "prep.py").write_text("print('prep2')\n")
    git(repo, "add", "data/prep.py")  # staged
    (repo / "logo.bin").write_bytes(bytes(range(255, -1, -1)))  # binary edit
    (repo / "notes.txt").write_text("untracked\n")
    (repo / "run.log").write_text("ignored\n")
    (repo / "build").mkdir()
    (repo / "build" / "out.o").write_bytes(b"\0")
    objects_before = git(repo, "count-objects")

    info = capture_git(repo, settings=settings)
    assert info.dirty is True and info.patch_hash is not None
    blob = settings.blobs_dir / info.patch_hash
    patch = blob.read_bytes()
    assert hash_bytes(patch) == info.patch_hash and info.patch_path == str(blob)
    assert b"y = 3" in patch and b"prep2" in patch and b"notes.txt" in patch
    assert b"GIT binary patch" in patch
    assert b"run.log" not in patch and b"out.o" not in patch
    assert info.untracked == ("notes.txt",)
    assert git(repo, "count-objects") == objects_before

    # the patch rebuilds the working tree from the commit
    clone = repo.parent / "clone"
    git(repo.parent, "clone", "-q", str(repo), str(clone))
    subprocess.run(["git", "-C", str(clone), "apply", "--binary", str(blob)], check=True)
    for rel in ("src/model.py", "data/prep.py", "logo.bin", "notes.txt"):
        assert (clone / rel).read_bytes() == (repo / rel).read_bytes()


def test_a_large_untracked_file_is_named_not_copied_into_the_patch(repo: Path, settings: Settings) -> None:
    """A 300 MB file left untracked in the repository (a checkpoint copied in, a dataset) was read
    whole into memory and stored again as the patch blob on every capture: 34 s and 800 MB of memory
    for `openlab provenance`. It is left out of the patch and the tree, named with its size, and
    said in one warning; the patch still rebuilds the rest of the tree, small untracked files too."""
    from orchestrator.provenance.git import UNTRACKED_PATCH_LIMIT

    (repo / "src" / "model.py").write_text("x = 1\ny = 3\n")
    (repo / "notes.txt").write_text("untracked\n")
    before = capture_git(repo, code_paths=["src"], settings=settings)
    (repo / "src" / "weights.pt").write_bytes(os.urandom(UNTRACKED_PATCH_LIMIT + 1))

    with pytest.warns(ProvenanceWarning, match=r"left out of the recorded working tree.*src/weights.pt \(10 MiB\)"):
        info = capture_git(repo, code_paths=["src"], settings=settings)
    assert info.untracked == ("notes.txt", "src/weights.pt")
    assert info.untracked_large == (("src/weights.pt", UNTRACKED_PATCH_LIMIT + 1),)
    assert info.to_dict()["untracked_large"] == [{"path": "src/weights.pt", "bytes": UNTRACKED_PATCH_LIMIT + 1}]
    patch = (settings.blobs_dir / str(info.patch_hash)).read_bytes()
    assert info.patch_bytes < 10_000 and b"weights.pt" not in patch and b"notes.txt" in patch and b"y = 3" in patch

    (repo / "src" / "weights.pt").write_bytes(os.urandom(UNTRACKED_PATCH_LIMIT + 2))
    with pytest.warns(ProvenanceWarning):
        again = capture_git(repo, code_paths=["src"], settings=settings)
    assert again.patch_hash == info.patch_hash and again.tree_hashes == info.tree_hashes, "not part of the code"
    assert (before.tree_hashes, before.patch_hash) == (info.tree_hashes, info.patch_hash)
    (repo / "src" / "weights.pt").unlink()
    (repo / "src" / "small.bin").write_bytes(os.urandom(UNTRACKED_PATCH_LIMIT))  # at the limit: patched
    kept = capture_git(repo, code_paths=["src"], settings=settings)
    assert kept.untracked_large == () and kept.tree_hashes != info.tree_hashes
    assert b"small.bin" in (settings.blobs_dir / str(kept.patch_hash)).read_bytes()


def test_a_tree_dirty_only_by_what_no_patch_holds_is_recorded_dirty_apart_from_the_clean_one(
    repo: Path, settings: Settings, tmp_path: Path
) -> None:
    """A large untracked file (left out of the patch) or a nested repository with no commit was the only
    difference from HEAD: the tree was recorded clean, though ``git status`` says otherwise, under the
    clean tree's record, which is written once."""
    from orchestrator.lineage import Commit, LineageStore
    from orchestrator.lineage.record import record_git
    from orchestrator.provenance.git import UNTRACKED_PATCH_LIMIT

    clean = capture_git(repo, code_paths=["src"], settings=settings)
    (repo / "weights.pt").write_bytes(os.urandom(UNTRACKED_PATCH_LIMIT + 1))
    with pytest.warns(ProvenanceWarning, match="weights.pt"):
        large = capture_git(repo, code_paths=["src"], settings=settings)
    (repo / "weights.pt").unlink()
    (repo / "scratch").mkdir()
    git(repo / "scratch", "init", "-q")
    with pytest.warns(ProvenanceWarning, match="no commit yet: scratch"):
        nested = capture_git(repo, code_paths=["src"], settings=settings)
    assert (clean.dirty, large.dirty, nested.dirty) == (False, True, True)
    assert large.patch_hash is None and nested.patch_hash is None, "nothing a patch could hold"
    assert large.tree_hashes == clean.tree_hashes, "the code is the same: only the record says more"

    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as store:
        with store.transaction() as tx:
            ids = [record_git(tx, info).id for info in (clean, large, nested)]
        assert ids == [clean.commit, f"{clean.commit}+dirty", f"{clean.commit}+dirty"]
        assert {c.id: c.dirty for c in store.list(Commit)} == {ids[0]: False, ids[1]: True}


def test_a_secret_in_the_working_tree_is_masked_in_the_recorded_patch(
    repo: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notes file left untracked with `HF_TOKEN=hf_...` in it went verbatim into the patch blob,
    which `lineage show` says to `git apply` and every export names: a secret in lineage. The value
    of this process's secret-named variables is recorded as ***, with a warning naming the file."""
    secret = "hf_secretvalueZZZ999"
    monkeypatch.setenv("HF_TOKEN", secret)
    (repo / "notes.txt").write_text(f"export HF_TOKEN={secret}\n")
    (repo / "src" / "model.py").write_text("x = 1\ny = 3\n")
    with pytest.warns(ProvenanceWarning, match=r"notes.txt held the value of a secret-named environment variable"):
        info = capture_git(repo, code_paths=["src"], settings=settings)
    patch = (settings.blobs_dir / str(info.patch_hash)).read_bytes()
    assert secret.encode() not in patch and b"export HF_TOKEN=***" in patch and b"y = 3" in patch
    assert hash_bytes(patch) == info.patch_hash  # what verify checks the blob against
    clone = repo.parent / "clone"
    git(repo.parent, "clone", "-q", str(repo), str(clone))
    subprocess.run(["git", "-C", str(clone), "apply", "--binary", info.patch_path], check=True)
    assert (clone / "notes.txt").read_text() == "export HF_TOKEN=***\n"
    assert (clone / "src" / "model.py").read_bytes() == (repo / "src" / "model.py").read_bytes()


def test_a_secret_value_that_is_also_in_the_commits_text_leaves_the_patch_applicable(
    repo: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The value was masked on every line of the patch, the context lines git apply checks against
    the commit included: a secret that is also a word of the code ("return") made a patch that no
    longer applied. Only what the patch adds is masked."""
    (repo / "src" / "model.py").write_text("def f():\n    return 1\n\n\ny = 2\n")
    git(repo, "commit", "-qam", "f")
    monkeypatch.setenv("MY_TOKEN", "return")
    (repo / "src" / "model.py").write_text("def f():\n    return 1\n\n\ny = 3  # return\n")
    with pytest.warns(ProvenanceWarning, match="held the value of a secret-named"):
        info = capture_git(repo, code_paths=["src"], settings=settings)
    patch = Path(info.patch_path).read_bytes()
    assert b"+y = 3  # ***" in patch and b" return 1" in patch
    clone = repo.parent / "clone"
    git(repo.parent, "clone", "-q", str(repo), str(clone))
    subprocess.run(["git", "-C", str(clone), "apply", "--binary", info.patch_path], check=True)
    assert (clone / "src" / "model.py").read_text() == "def f():\n    return 1\n\n\ny = 3  # ***\n"


def test_a_folder_of_untracked_files_is_warned_of_and_kept(repo: Path, settings: Settings) -> None:
    """20,000 small untracked files (a run's outputs, a virtualenv .gitignore misses) made every
    capture take 12 s and store a 37 MB patch, silently. Past a thousand, a warning names the
    folders that hold them; they stay in the patch, since they may be code."""
    import warnings

    from orchestrator.provenance.git import UNTRACKED_WARN_FILES

    outputs = repo / "outputs"
    outputs.mkdir()
    for i in range(UNTRACKED_WARN_FILES):
        (outputs / f"{i}.json").write_text(f"{i}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProvenanceWarning)  # a thousand: not yet
        capture_git(repo, code_paths=["src"], settings=settings, keep_patch=False)
    (repo / "notes.txt").write_text("one more\n")
    with pytest.warns(
        ProvenanceWarning,
        match=r"1001 untracked files go into every run's recorded working tree, "
        r"most in outputs/ \(1000\), notes.txt \(1\); add what is not code to .gitignore",
    ):
        info = capture_git(repo, code_paths=["src"], settings=settings)
    assert (
        len(info.untracked) == 1001 and b"outputs/999.json" in (settings.blobs_dir / str(info.patch_hash)).read_bytes()
    )


def test_staged_only_is_dirty(repo: Path, settings: Settings) -> None:
    (repo / "src" / "model.py").write_text("x = 1\n")
    git(repo, "add", "src/model.py")
    info = capture_git(repo, settings=settings)
    assert info.dirty and info.patch_hash


def test_one_line_edit_changes_only_that_code_path(repo: Path, settings: Settings) -> None:
    paths = ["src", "data/prep.py", "."]
    clean = capture_git(repo, code_paths=paths, settings=settings).tree_hashes
    (repo / "src" / "model.py").write_text("x = 1\ny = 22\n")
    edited = capture_git(repo, code_paths=paths, settings=settings).tree_hashes
    assert edited["src"] != clean["src"]
    assert edited["data/prep.py"] == clean["data/prep.py"]
    assert edited["."] != clean["."]
    # an untracked file inside a declared folder changes it too; an ignored one does not
    (repo / "src" / "debug.log").write_text("noise")
    assert capture_git(repo, code_paths=["src"], settings=settings).tree_hashes["src"] == edited["src"]
    (repo / "src" / "extra.py").write_text("z = 0\n")
    assert capture_git(repo, code_paths=["src"], settings=settings).tree_hashes["src"] != edited["src"]


def test_code_paths_relative_to_subfolder_and_missing(repo: Path, settings: Settings) -> None:
    info = capture_git(repo / "src", code_paths=["model.py"], settings=settings)
    assert info.tree_hashes["model.py"] == git(repo, "rev-parse", "HEAD:src/model.py")
    with pytest.raises(ProvenanceError, match="nope.py.*does not exist"):
        capture_git(repo, code_paths=["nope.py"], settings=settings)
    (repo / "x.log").write_text("ignored")
    with pytest.raises(ProvenanceError, match="x.log.*ignored"):
        capture_git(repo, code_paths=["x.log"], settings=settings)
    with pytest.raises(ProvenanceError, match="outside the git repository"):
        capture_git(repo, code_paths=["../elsewhere"], settings=settings)


def test_detached_head(repo: Path, settings: Settings) -> None:
    first = git(repo, "rev-parse", "HEAD")
    (repo / "src" / "model.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "second")
    git(repo, "checkout", "-q", "--detach", first)
    info = capture_git(repo, settings=settings)
    assert info.branch is None and info.commit == first and info.dirty is False


def test_repo_without_commits(tmp_path: Path, settings: Settings) -> None:
    root = tmp_path / "fresh"
    root.mkdir()
    git(root, "init", "-q", "-b", "trunk")
    (root / "a.py").write_text("a = 1\n")
    info = capture_git(root, code_paths=["a.py"], settings=settings)
    assert info.available and info.commit is None and info.branch == "trunk"
    assert info.dirty is True and info.untracked == ("a.py",)
    assert b"a = 1" in (settings.blobs_dir / str(info.patch_hash)).read_bytes()
    assert info.tree_hashes["a.py"] == git(root, "hash-object", "a.py")


def test_not_a_repo_warns_and_records_no_git(tmp_path: Path, settings: Settings) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.warns(ProvenanceWarning, match="no git"):
        prov = capture(plain, ["src"], settings=settings)
    assert isinstance(prov, Provenance)
    assert prov.git.available is False and prov.git.reason == "no git"
    data = json.loads(json.dumps(prov.to_dict()))
    assert data["git"]["commit"] is None and data["git"]["patch_hash"] is None
    assert "dirty" in data["git"] and data["environment"]["packages_hash"]


def test_the_package_list_the_environments_hash_stands_for_is_kept_and_shown(
    repo: Path, settings: Settings, run_cli
) -> None:
    """Only the hash of the installed packages was recorded: two environments could be told apart but
    nobody could say how, or install the one a result came from."""
    from orchestrator.lineage import LineageStore
    from orchestrator.lineage.record import record_environment

    prov = capture(repo, ["src"], settings=settings)
    blob = settings.blobs_dir / prov.environment.packages_hash
    listed = blob.read_text().splitlines()
    assert len(listed) == prov.environment.packages_count and any(line.startswith("pytest==") for line in listed)
    with LineageStore.open(settings) as store, store.transaction() as tx:
        env = record_environment(tx, prov.environment)
    shown = run_cli("lineage", "show", f"environment:{env.id}", env={"COLUMNS": "300"})
    assert shown.returncode == 0, shown.stderr
    assert f"{blob}  (`pip install -r {blob}` installs them)" in shown.stdout, shown.stdout
    doc = json.loads(run_cli("lineage", "show", f"environment:{env.id}", "--json").stdout)
    assert doc["packages"] == {"path": str(blob), "present": True, "apply": f"pip install -r {blob}"}


def test_remote_credentials_stripped(repo: Path, settings: Settings) -> None:
    git(repo, "remote", "add", "origin", "https://alice:ghp_SECRET123@github.com/org/proj.git")
    info = capture_git(repo, settings=settings)
    assert info.remote_url == "https://github.com/org/proj.git"
    assert "SECRET" not in json.dumps(info.to_dict())


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://ghp_token@github.com/o/r.git", "https://github.com/o/r.git"),
        ("https://u:p@host:8443/o/r", "https://host:8443/o/r"),
        ("ssh://git:pw@host/o/r.git", "ssh://git@host/o/r.git"),
        ("ssh://git@host/o/r.git", "ssh://git@host/o/r.git"),
        ("git@github.com:o/r.git", "git@github.com:o/r.git"),
        ("/srv/git/r.git", "/srv/git/r.git"),
        (None, None),
    ],
)
def test_strip_credentials(url: str | None, expected: str | None) -> None:
    assert strip_credentials(url) == expected


def _one_commit_repo(root: Path, name: str, text: str) -> Path:
    """A repository at ``root`` whose one commit holds the file ``name`` with ``text``."""
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    (root / name).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", name)
    return root


def test_submodule_recorded(repo: Path, tmp_path: Path, settings: Settings) -> None:
    lib = _one_commit_repo(tmp_path / "lib", "l.py", "l = 1\n")
    git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "vendor/lib")
    git(repo, "commit", "-q", "-m", "add submodule")
    info = capture_git(repo, code_paths=["vendor/lib"], settings=settings)
    assert info.dirty is False
    assert [s.path for s in info.submodules] == ["vendor/lib"]
    assert info.submodules[0].commit == git(lib, "rev-parse", "HEAD")
    assert info.tree_hashes["vendor/lib"] == git(lib, "rev-parse", "HEAD")
    clean = info
    (repo / "vendor" / "lib" / "l.py").write_text("l = 2\n")
    info = capture_git(repo, code_paths=["vendor/lib", "vendor", "vendor/lib/l.py", "."], settings=settings)
    assert info.dirty is True and info.submodules[0].dirty is True
    # the edit is in the recorded tree: its patch, and the hash of every code path that holds it (the gitlink
    # alone says the submodule's commit, so a stale result of the clean tree was reused)
    assert info.patch_hash is not None and info.patch_hash != clean.patch_hash
    assert info.tree_hashes["vendor/lib"] != clean.tree_hashes["vendor/lib"]
    assert info.tree_hashes["vendor/lib/l.py"] == git(repo / "vendor" / "lib", "hash-object", "l.py")
    again = capture_git(repo, code_paths=["vendor/lib", "vendor", "."], settings=settings)
    assert {k: info.tree_hashes[k] for k in again.tree_hashes} == again.tree_hashes, "the same edit, the same hash"
    # the patch rebuilds the tree: the superproject's clone, its submodule, then the patch at the top
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "-c", "protocol.file.allow=always", "submodule", "update", "-q", "--init")
    subprocess.run(["git", "-C", str(clone), "apply", "--binary", info.patch_path], check=True)
    assert (clone / "vendor" / "lib" / "l.py").read_text() == "l = 2\n"


def test_a_repository_with_no_commit_inside_the_tree_is_left_out_not_the_whole_capture(
    repo: Path, settings: Settings
) -> None:
    """``git add`` refuses an embedded repository with no commit ("adding files failed"): every run from
    the tree was recorded as having no git at all."""
    inner = repo / "scratch"
    inner.mkdir()
    git(inner, "init", "-q")
    (inner / "try.py").write_text("print(1)\n")
    (repo / "src" / "model.py").write_text("x = 1\ny = 5\n")
    with pytest.warns(ProvenanceWarning, match="git repositories with no commit yet: scratch"):
        info = capture_git(repo, code_paths=["src"], settings=settings)
    assert info.available and info.dirty and info.commit == git(repo, "rev-parse", "HEAD")
    assert b"y = 5" in Path(info.patch_path).read_bytes()


def test_files_git_is_told_to_ignore_edits_of_are_still_captured(repo: Path, settings: Settings) -> None:
    """``git update-index --assume-unchanged`` (or ``--skip-worktree``) hides a file's edits from git status
    and ``git add``: the edited file was recorded as its committed content and the tree as clean."""
    clean = capture_git(repo, code_paths=["src/model.py", "data/prep.py"], settings=settings)
    git(repo, "update-index", "--assume-unchanged", "src/model.py")
    git(repo, "update-index", "--skip-worktree", "data/prep.py")
    (repo / "src" / "model.py").write_text("x = 1\ny = 7\n")
    (repo / "data" / "prep.py").write_text("print('prep7')\n")
    info = capture_git(repo, code_paths=["src/model.py", "data/prep.py"], settings=settings)
    assert info.dirty is True
    patch = Path(info.patch_path).read_bytes()
    assert b"y = 7" in patch and b"prep7" in patch
    assert all(info.tree_hashes[k] != clean.tree_hashes[k] for k in clean.tree_hashes)
    assert git(repo, "ls-files", "-v", "src/model.py").startswith("h "), "the user's index keeps its flags"


def test_git_location_variables_of_the_environment_do_not_mix_in_another_repository(
    repo: Path, tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a git hook (or a shell that exported ``GIT_DIR``), the capture of one repository read
    another's index and objects: a patch that deleted its files and added the other's."""
    other = _one_commit_repo(tmp_path / "other", "b.py", "b = 1\n")
    expected = capture_git(repo, code_paths=["src"], settings=settings)
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_INDEX_FILE", str(other / ".git" / "index"))
    info = capture_git(repo, code_paths=["src"], settings=settings)
    assert (info.commit, info.dirty, info.tree_hashes, info.untracked) == (
        expected.commit,
        False,
        expected.tree_hashes,
        (),
    ), info


def test_a_code_path_through_a_link_to_the_repository_is_inside_it(
    repo: Path, tmp_path: Path, settings: Settings
) -> None:
    link = tmp_path / "linked"
    link.symlink_to(repo)
    info = capture_git(link, code_paths=[str(link / "src")], settings=settings)
    assert info.tree_hashes[str(link / "src")] == git(repo, "rev-parse", "HEAD:src")


def test_commit_exists(repo: Path, tmp_path: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    assert commit_exists(repo, head) and commit_exists(repo, head[:10])
    assert not commit_exists(repo, "f" * 40)
    assert not commit_exists(repo, git(repo, "rev-parse", "HEAD:src"))  # a tree, not a commit
    assert not commit_exists(repo, "--help")
    assert not commit_exists(tmp_path, head)


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENLAB_TEST_SECRET", "s3cr3t-value")
    env = capture_environment(refresh=True)
    assert env is capture_environment()  # cached per process
    data = env.to_dict()
    assert data["python_version"].count(".") == 2 and data["packages_count"] > 10
    assert len(data["packages_hash"]) == 64 and len(data["id"]) == 64
    assert "s3cr3t-value" not in json.dumps(data)
    assert normalise_dist_name("Foo_Bar.baz") == "foo-bar-baz"
    assert packages_hash(["b==1", "a==2"]) == packages_hash(["a==2", "b==1", "a==2"])
    assert packages_hash(["a==2"]) != packages_hash(["a==3"])


def test_the_same_software_on_another_machine_is_recorded_as_that_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The record's id left the host and hardware out: a run on a GPU node was linked to the record of
    the first run of the same packages, made on a laptop, and lineage named the laptop."""
    from orchestrator.lineage import LineageStore
    from orchestrator.lineage.record import record_environment
    from orchestrator.provenance import environment

    here = capture_environment(refresh=True)
    monkeypatch.setattr(environment.socket, "gethostname", lambda: "gpu-node-7")
    monkeypatch.setattr(environment, "gpu_models", lambda: ("NVIDIA H100",))
    there = capture_environment(refresh=True)
    assert there.packages_hash == here.packages_hash and there.id != here.id
    with LineageStore(f"sqlite:///{tmp_path / 'l.db'}") as store, store.transaction() as tx:
        first, second = record_environment(tx, here), record_environment(tx, there)
        assert (second.hostname, second.gpu) == ("gpu-node-7", "NVIDIA H100") and first.id != second.id
    monkeypatch.undo()
    capture_environment(refresh=True)


def test_image_digest_from_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = "sha256:" + "ab" * 32
    monkeypatch.setenv("OPENLAB_IMAGE_DIGEST", digest)
    with_digest = capture_environment(refresh=True)
    assert with_digest.container_image_digest == digest and with_digest.in_container
    monkeypatch.setenv("OPENLAB_IMAGE_DIGEST", "not-a-digest-maybe-a-secret")
    without = capture_environment(refresh=True)
    assert without.container_image_digest is None and without.id != with_digest.id
    monkeypatch.delenv("OPENLAB_IMAGE_DIGEST")
    capture_environment(refresh=True)


def test_the_user_is_the_login_account_and_none_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The account as login names it (LOGNAME, then USER, then the passwd entry of the uid); a uid
    with no name at all is recorded as unknown, never as a made-up name."""
    import pwd

    from orchestrator.provenance.invocation import current_user, user_at_host

    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(name, raising=False)
    assert current_user() == pwd.getpwuid(os.getuid()).pw_name
    monkeypatch.setenv("LOGNAME", "ada")
    assert current_user() == "ada" and user_at_host() == f"ada@{socket.gethostname()}"
    monkeypatch.delenv("LOGNAME")

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)  # a container's arbitrary uid
    assert current_user() is None and user_at_host() == f"{os.getuid()}@{socket.gethostname()}"
