"""Git provenance: which commit, which uncommitted changes, which code.

A stage's result depends on the code as it was on disk, not on the last commit, so
capture works from the *working tree*:

* ``patch`` — one binary-safe patch (``git diff --binary``) from HEAD to the working
  tree, covering staged and unstaged edits **and** untracked files that .gitignore
  does not exclude. It is stored content-addressed at ``settings.blobs_dir/<hash>``;
  ``patch_hash`` is the BLAKE3 of its bytes (``None`` when the tree is clean).
  ``git apply --binary`` of that patch on the recorded commit rebuilds the tree.
  An untracked file over :data:`UNTRACKED_PATCH_LIMIT` is left out of the patch and the tree
  (``untracked_large`` names it, with its size, and a warning says so; the tree is still
  ``dirty``, as ``git status`` would say, with no patch that holds it): a checkpoint or a
  dataset left in the repository made every capture read it whole into memory and store it
  again as a blob, and code is not that big; data belongs in a snapshot. More than
  :data:`UNTRACKED_WARN_FILES` untracked files stay in the patch (they may be code) but are
  warned of, with the folders that hold most of them. The value of a secret-named variable of
  this process (``HF_TOKEN``) found in the patch (a ``.env`` or notes file left untracked) is
  recorded as ``***``, with a warning: the patch is lineage, shown and exported, and a secret
  never reaches lineage; that line then applies as ``***`` (only added lines are masked: the
  context lines ``git apply`` checks are the commit's). Uncommitted changes inside a submodule
  or an embedded clone are in the patch too, under their paths from the top (after ``git
  submodule update``, the patch applies at the top); an embedded repository with no commit yet
  is left out, with a warning. Files flagged assume-unchanged or skip-worktree (present on
  disk) are captured as they are, and ``GIT_DIR``-like variables of the environment are ignored.
* ``tree_hashes`` — for each declared code path, the git object id (tree for a
  folder, blob for a file) of that path in the working tree. It is computed by
  ``git add -A`` into a *temporary index* (a copy of the real one, so unchanged files
  are not re-read) with a *temporary object directory* (so nothing is written into
  the user's repository), then ``git write-tree``. Git ids are content-addressed per
  subtree, so a one-line edit changes the hash of exactly the declared paths that
  contain it, and a clean tree gives the same ids as ``HEAD:<path>``. A path inside a
  submodule is its id there; a path that holds a submodule with changes hashes its own id
  with the submodule's tree, so the edit moves it.

A folder that is not in a git repository (or a machine without git) yields
``GitInfo(available=False, reason=...)`` and a :class:`ProvenanceWarning`; it never
raises. A declared code path that does not exist or is ignored by git does raise: a
stage identity silently missing its code would defeat the cache key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import urllib.parse
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Without this, importing gitpython on a machine with no git executable raises
# ImportError; we want "no git" recorded instead.
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

import git as gitpython  # noqa: E402
from git.exc import (  # noqa: E402
    GitCommandError,
    GitCommandNotFound,
    InvalidGitRepositoryError,
    NoSuchPathError,
)

from orchestrator.errors import OpenlabError, ProvenanceWarning  # noqa: E402
from orchestrator.hashing import hash_bytes, hash_json  # noqa: E402
from orchestrator.settings import Settings, load_settings  # noqa: E402
from orchestrator.snapshots import atomic_write  # noqa: E402

log = logging.getLogger(__name__)

#: The id of git's empty tree: the "HEAD" of a repository with no commits yet.
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


class ProvenanceError(OpenlabError):
    """Provenance cannot be captured as declared (e.g. a code path that does not exist)."""


@dataclass(frozen=True)
class SubmoduleInfo:
    """A submodule's path, the commit checked out in it, and whether it has local edits."""

    path: str
    commit: str | None
    dirty: bool

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "commit": self.commit, "dirty": self.dirty}


@dataclass(frozen=True)
class GitInfo:
    """What git says about the code at capture time (see the module docstring)."""

    available: bool
    reason: str | None = None
    root: str | None = None
    remote_url: str | None = None
    branch: str | None = None
    commit: str | None = None
    dirty: bool | None = None
    patch_hash: str | None = None
    patch_path: str | None = None
    patch_bytes: int = 0
    untracked: tuple[str, ...] = ()
    #: Untracked files left out of the patch and the tree for their size: (path, bytes).
    untracked_large: tuple[tuple[str, int], ...] = ()
    tree_hashes: Mapping[str, str] = field(default_factory=dict)
    submodules: tuple[SubmoduleInfo, ...] = ()
    message: str | None = None  # the commit's subject line: what a person reads in an audit
    authored_at: str | None = None  # ISO 8601, with the author's offset

    def to_dict(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "reason": self.reason,
            "root": self.root,
            "remote_url": self.remote_url,
            "branch": self.branch,
            "commit": self.commit,
            "dirty": self.dirty,
            "patch_hash": self.patch_hash,
            "patch_path": self.patch_path,
            "patch_bytes": self.patch_bytes,
            "untracked": list(self.untracked),
            "untracked_large": [{"path": p, "bytes": n} for p, n in self.untracked_large],
            "tree_hashes": dict(self.tree_hashes),
            "submodules": [s.to_dict() for s in self.submodules],
            "message": self.message,
            "authored_at": self.authored_at,
        }


_SCP_LIKE = re.compile(r"^(?P<user>[^@/]+@)?(?P<host>[^:/]+):(?P<path>.*)$")


def strip_credentials(url: str | None) -> str | None:
    """Remove secrets from a remote URL.

    ``https://user:token@host/x`` becomes ``https://host/x`` (for http(s) the user
    part alone can be a token, so all of it goes); other schemes keep a user name but
    lose any password (``ssh://git@host/x`` is not a secret). scp-like
    ``git@host:x`` has no password field and is kept.
    """
    if not url:
        return url
    if "://" not in url:
        return url if _SCP_LIKE.match(url) or "@" not in url else url.split("@", 1)[1]
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    if parts.scheme in ("http", "https", "ftp", "ftps"):
        netloc = host
    else:
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}@{host}" if user else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _unavailable(path: Path, reason: str) -> GitInfo:
    message = f"{path}: {reason}; provenance records no git commit or patch"
    warnings.warn(message, ProvenanceWarning, stacklevel=3)
    log.warning(message)
    return GitInfo(available=False, reason=reason)


#: Variables that point git at another repository's parts. Set in the environment openlab runs in
#: (a git hook, a shell that exported them), they made the capture of one repository read another's
#: index or objects: a patch that deleted its files and added the other's.
_GIT_LOCATION_VARS = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
)


def _open_repo(path: Path, *, search: bool = True) -> gitpython.Repo:
    """The repository at (or, with ``search``, above) ``path``, its git commands pinned to its own
    git dir, work tree, index and objects whatever this process's environment says."""
    repo = gitpython.Repo(path, search_parent_directories=search)
    stray = [name for name in _GIT_LOCATION_VARS if name in os.environ]
    if stray:
        git_dir = Path(repo.git_dir)
        common = Path(getattr(repo, "common_dir", git_dir))
        pinned = {
            "GIT_DIR": str(git_dir),
            "GIT_WORK_TREE": repo.working_tree_dir or "",
            "GIT_INDEX_FILE": str(git_dir / "index"),
            "GIT_OBJECT_DIRECTORY": str(common / "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": "",
            "GIT_COMMON_DIR": str(common),
            "GIT_NAMESPACE": "",
        }
        repo.git.update_environment(**{name: pinned[name] for name in stray if pinned[name] or name in os.environ})
    return repo


def _remote_url(repo: gitpython.Repo) -> str | None:
    remotes = {r.name: r for r in repo.remotes}
    chosen = remotes.get("origin") or (next(iter(remotes.values())) if remotes else None)
    if chosen is None:
        return None
    try:
        urls = list(chosen.urls)
    except GitCommandError:
        return None
    return strip_credentials(urls[0]) if urls else None


class _TempTree:
    """The working tree as git objects, without touching the user's index or objects.

    Inside the context, ``tree`` is the working tree's root tree id (untracked files
    included, ignored ones excluded) and :meth:`run` runs git with the temporary index
    and object directory, so ``diff --cached`` and ``rev-parse`` see that tree.
    """

    def __init__(self, repo: gitpython.Repo, exclude: Sequence[str] = ()) -> None:
        self.repo = repo
        self.exclude = tuple(exclude)
        self.tmp = Path(tempfile.mkdtemp(prefix="openlab-git-"))
        git_dir = Path(repo.git_dir)
        objects = Path(repo.common_dir) / "objects" if hasattr(repo, "common_dir") else git_dir / "objects"
        index = self.tmp / "index"
        real_index = git_dir / "index"
        if real_index.exists():
            # copy2 keeps the index mtime, which git needs to spot "racily clean" entries
            # (edited within the same timestamp tick as the index was written).
            shutil.copy2(real_index, index)  # reuse cached stat info: no re-read of clean files
        (self.tmp / "objects").mkdir()
        self.env = {
            "GIT_INDEX_FILE": str(index),
            "GIT_OBJECT_DIRECTORY": str(self.tmp / "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(objects),
        }
        self.tree = ""

    def run(self, *args: str, binary: bool = False) -> Any:
        return self.repo.git.execute(
            ["git", *args], env=self.env, stdout_as_string=not binary, strip_newline_in_stdout=not binary
        )

    def path_id(self, rel: str) -> str | None:
        """The git id of ``rel`` (relative to the root; "" or "." the root) in this tree, None if absent."""
        spec = self.tree if rel in ("", ".") else f"{self.tree}:{rel}"
        try:
            return self.run("rev-parse", "--verify", "--quiet", spec).strip() or None
        except GitCommandError:
            return None

    def _unhide(self) -> None:
        """Clear, in the temporary index, the flags that hide a file's edits from ``add``: assume-unchanged
        (``git update-index --assume-unchanged``), and skip-worktree where the file is on disk (a sparse
        checkout's absent files keep theirs: they are not deleted). With them, an edited file was recorded
        as its committed content and the tree as clean."""
        root = Path(self.repo.working_tree_dir or ".")
        assumed: list[str] = []
        skipped: list[str] = []
        for entry in self.run("ls-files", "-v", "-z").split("\0"):
            if len(entry) < 3:
                continue
            tag, rel = entry[0], entry[2:]
            if tag.islower():
                assumed.append(rel)
            if tag.upper() == "S" and os.path.lexists(root / rel):
                skipped.append(rel)
        for flag, paths in (("--no-assume-unchanged", assumed), ("--no-skip-worktree", skipped)):
            for start in range(0, len(paths), 1000):
                self.run("update-index", flag, "--", *paths[start : start + 1000])

    def __enter__(self) -> _TempTree:
        try:
            self._unhide()
            self.run("add", "-A", "--", ".", *(f":(exclude,literal){p}" for p in self.exclude))
            self.tree = self.run("write-tree").strip()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The largest untracked file a capture puts in the dirty patch (and the working tree's hashes).
UNTRACKED_PATCH_LIMIT = 10 * 2**20
#: More untracked files than this in the patch are warned of: a folder of outputs or a virtualenv
#: that .gitignore misses (20,000 small files made every capture 12 s and a 37 MB patch blob).
UNTRACKED_WARN_FILES = 1000


def _many_untracked(root: Path, kept: Sequence[str]) -> str | None:
    """The warning for more than :data:`UNTRACKED_WARN_FILES` untracked files in the patch, naming
    the folders that hold the most of them, or None. They stay in it: they may be code."""
    if len(kept) <= UNTRACKED_WARN_FILES:
        return None
    folders = Counter(rel.split("/", 1)[0] + ("/" if "/" in rel else "") for rel in kept)
    listed = ", ".join(f"{name} ({count})" for name, count in folders.most_common(3))
    return (
        f"{root}: {len(kept)} untracked files go into every run's recorded working tree, most in {listed}; "
        "add what is not code to .gitignore"
    )


def _too_large(root: Path, untracked: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """The untracked files over :data:`UNTRACKED_PATCH_LIMIT`, largest first (a link is its own
    size: git records the link, not what it points at)."""
    sizes = []
    for rel in untracked:
        with contextlib.suppress(OSError):
            size = os.lstat(root / rel).st_size
            if size > UNTRACKED_PATCH_LIMIT:
                sizes.append((rel, size))
    return tuple(sorted(sizes, key=lambda item: (-item[1], item[0])))


def _submodules(repo: gitpython.Repo) -> tuple[SubmoduleInfo, ...]:
    try:
        listing = repo.git.ls_files("-s", "-z")
    except GitCommandError:
        return ()
    out: list[SubmoduleInfo] = []
    root = Path(repo.working_tree_dir or ".")
    for record in listing.split("\0"):
        if not record.startswith("160000 "):
            continue
        meta, sub_path = record.split("\t", 1)
        sub_dir = root / sub_path
        commit: str | None = None
        dirty = False
        if (sub_dir / ".git").exists():
            try:
                sub = _open_repo(sub_dir, search=False)
                commit = sub.head.commit.hexsha if sub.head.is_valid() else None
                dirty = sub.is_dirty(untracked_files=True)
            except (InvalidGitRepositoryError, GitCommandError, ValueError):
                commit = meta.split()[1]
        out.append(SubmoduleInfo(path=sub_path, commit=commit, dirty=dirty))
    return tuple(out)


@dataclass(frozen=True)
class _Nested:
    """A repository checked out inside the captured one (a submodule, or an embedded clone git records
    as a gitlink): the commit it is at, its working tree's root tree id, its uncommitted changes as a
    patch whose paths start at the top repository's root, and the ids of declared paths inside it."""

    path: str
    commit: str | None
    tree: str
    patch: bytes
    ids: Mapping[str, str | None]


def _diff_args(base: str, prefix: str = "") -> list[str]:
    """``git diff`` of the temporary index against ``base``: binary-safe, whole ids, submodules shown,
    paths under ``prefix`` (a nested repository's place in the top one)."""
    args = ["diff", "--cached", "--binary", "--no-color", "--no-ext-diff", "--full-index", "--ignore-submodules=none"]
    if prefix:
        args += [f"--src-prefix=a/{prefix}", f"--dst-prefix=b/{prefix}"]
    return [*args, base]


def _nested_trees(work: _TempTree, root: Path, prefix: str, wanted: Sequence[str]) -> list[_Nested]:
    """Every repository checked out inside ``work``'s (depth first), captured as the top one is. Its
    gitlink says only which commit it is at: an edit inside a submodule left the recorded tree, the
    patch and every code path's hash as they were for the clean commit, and a stale result was reused."""
    out: list[_Nested] = []
    for record in work.run("ls-files", "-s", "-z").split("\0"):
        if not record.startswith("160000 "):
            continue
        rel = record.split("\t", 1)[1]
        sub_dir = root / rel
        if not (sub_dir / ".git").exists():
            continue  # not checked out: the gitlink is all there is
        full = f"{prefix}{rel}/"
        sub = _open_repo(sub_dir, search=False)
        try:
            commit = sub.head.commit.hexsha if sub.head.is_valid() else None
            with _TempTree(sub) as inner:
                patch: bytes = inner.run(*_diff_args(commit or EMPTY_TREE, full), binary=True)
                ids = {w: inner.path_id(w[len(full) :]) for w in wanted if w.startswith(full)}
                deeper = _nested_trees(inner, sub_dir, full, wanted)
                out.append(_Nested(full[:-1], commit, inner.tree, patch, ids))
            out.extend(deeper)
        finally:
            sub.close()
    return out


def _code_path_id(work: _TempTree, rel: str, nested: Sequence[_Nested]) -> str | None:
    """The id of declared path ``rel`` in the working tree, nested repositories' edits included: a path
    inside one is looked up in it; a path that holds one with uncommitted changes (the submodule itself,
    a folder above it, the root) is its tree id and theirs hashed together, so an edit in there moves it."""
    for sub in nested:
        if rel.startswith(sub.path + "/") and rel in sub.ids:
            return sub.ids[rel]
    found = work.path_id(rel)
    if found is None:
        return None
    inside = rel in ("", ".")
    dirty = {
        sub.path: sub.tree
        for sub in nested
        if sub.patch and (inside or sub.path == rel or sub.path.startswith(rel + "/"))
    }
    return hash_json({"tree": found, "nested": dirty}) if dirty else found


def _uncommitted_repos(root: Path, untracked: Sequence[str]) -> tuple[str, ...]:
    """Untracked folders that are git repositories with no commit yet: ``git add`` refuses them ("adding
    files failed"), which lost the whole capture; they are left out of the recorded tree instead."""
    out = []
    for rel in untracked:
        folder = root / rel
        if rel.endswith("/") and (folder / ".git").exists():
            try:
                with _open_repo(folder, search=False) as repo:
                    if not repo.head.is_valid():
                        out.append(rel.rstrip("/"))
            except (InvalidGitRepositoryError, GitCommandError, ValueError):
                out.append(rel.rstrip("/"))
    return tuple(out)


def _relative_code_path(declared: str, base: Path, root: Path) -> str:
    candidate = Path(declared)
    absolute = candidate if candidate.is_absolute() else base / candidate
    absolute = Path(os.path.normpath(absolute))
    try:  # a path through a link to the repository (root is resolved) is the same path inside it
        rel = (absolute if absolute.is_relative_to(root) else absolute.parent.resolve() / absolute.name).relative_to(
            root
        )
    except ValueError:
        raise ProvenanceError(
            f"code path {declared}: outside the git repository {root}; declare paths inside it"
        ) from None
    return rel.as_posix()


def _masked_patch(patch: bytes, root: Path) -> bytes:
    """``patch`` with the value of each secret-named variable of this process masked (``***``), and
    a warning naming the files that held one. Bytes, not text: the patch may carry binary files."""
    from orchestrator.secrets import MASK, secret_values

    found = [value.encode() for value in secret_values() if value.encode() in patch]
    if not found:
        return patch
    files = sorted(
        {
            line.split(b" b/", 1)[-1].decode(errors="replace")
            for part in patch.split(b"\ndiff --git ")
            if any(value in part for value in found)
            for line in part.splitlines()[:1]
        }
    )
    # Only on the lines the patch adds: a context or removed line is the commit's own text, which `git
    # apply` checks, and masked there (a secret's value that is also a common word) the patch no longer
    # applied. An added line applies as ***: the tree rebuilt differs there, as the warning says.
    lines = patch.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"+") and not line.startswith(b"+++ "):
            for value in found:
                line = line.replace(value, MASK.encode())
            lines[i] = line
    patch = b"\n".join(lines)
    message = (
        f"{root}: {', '.join(files)} held the value of a secret-named environment variable; the working "
        f"tree's patch records it as {MASK} (move the secret out of the repository, or into .gitignore)"
    )
    warnings.warn(message, ProvenanceWarning, stacklevel=4)
    log.warning(message)
    return patch


def capture_git(
    path: Path = Path("."),
    *,
    code_paths: Sequence[str] = (),
    settings: Settings | None = None,
    keep_patch: bool = True,
) -> GitInfo:
    """Capture git provenance of the repository containing ``path``.

    ``code_paths`` are files or folders, relative to ``path`` (or absolute), whose
    working-tree git hashes go into ``tree_hashes`` keyed by the string given. The
    dirty patch is written to ``settings.blobs_dir`` unless ``keep_patch`` is false (a dry run,
    ``openlab provenance``: what would be recorded, with nothing written; ``patch_path`` is then
    None). Never raises for "no git"; raises :class:`ProvenanceError` for a declared code path
    that git does not have.
    """
    path = Path(path).expanduser().resolve()
    try:
        repo = _open_repo(path)
    except (InvalidGitRepositoryError, NoSuchPathError):
        return _unavailable(path, "no git")
    except GitCommandNotFound:
        return _unavailable(path, "git executable not found")
    if repo.bare or repo.working_tree_dir is None:
        return _unavailable(path, "bare git repository (no working tree)")
    try:
        return _capture(repo, path, code_paths, settings, keep_patch)
    except GitCommandNotFound:
        return _unavailable(path, "git executable not found")
    except GitCommandError as exc:
        # e.g. "dubious ownership" or a corrupt repository: record why, do not crash
        detail = (exc.stderr or str(exc)).strip().splitlines()
        return _unavailable(path, f"git failed: {detail[-1] if detail else exc}")
    finally:
        repo.close()


def _capture(
    repo: gitpython.Repo, path: Path, code_paths: Sequence[str], settings: Settings | None, keep_patch: bool
) -> GitInfo:
    root = Path(repo.working_tree_dir or path).resolve()
    has_commit = repo.head.is_valid()
    commit = repo.head.commit.hexsha if has_commit else None
    subject = str(repo.head.commit.summary) if has_commit else None
    authored = repo.head.commit.authored_datetime.isoformat() if has_commit else None
    try:
        branch = None if repo.head.is_detached else repo.head.reference.name
    except (TypeError, ValueError):
        branch = None
    base = commit or EMPTY_TREE
    untracked_raw = repo.git.ls_files("--others", "--exclude-standard", "-z")
    untracked = tuple(sorted(p for p in untracked_raw.split("\0") if p))
    large = _too_large(root, untracked)
    many = _many_untracked(root, [p for p in untracked if p not in {q for q, _ in large}])
    if many:
        warnings.warn(many, ProvenanceWarning, stacklevel=3)
        log.warning(many)
    if large:
        listed = ", ".join(f"{p} ({n / 2**20:.0f} MiB)" for p, n in large[:3]) + (" ..." if len(large) > 3 else "")
        message = (
            f"{root}: left out of the recorded working tree, untracked and over "
            f"{UNTRACKED_PATCH_LIMIT // 2**20} MiB each: {listed}; add it to .gitignore, or record data "
            "with `openlab snapshot`"
        )
        warnings.warn(message, ProvenanceWarning, stacklevel=3)
        log.warning(message)

    empty_repos = _uncommitted_repos(root, untracked)
    if empty_repos:
        message = (
            f"{root}: left out of the recorded working tree, git repositories with no commit yet: "
            f"{', '.join(empty_repos)}; commit in them, or add them to .gitignore"
        )
        warnings.warn(message, ProvenanceWarning, stacklevel=3)
        log.warning(message)

    with _TempTree(repo, exclude=[*(p for p, _ in large), *empty_repos]) as work:
        patch: bytes = work.run(*_diff_args(base), binary=True)
        wanted = {declared: _relative_code_path(declared, path, root) for declared in code_paths}
        nested = _nested_trees(work, root, "", list(wanted.values()))
        patch += b"".join(sub.patch for sub in nested)
        tree_hashes: dict[str, str] = {}
        for declared, rel in wanted.items():
            found = _code_path_id(work, rel, nested)
            if found is not None:
                tree_hashes[declared] = found
            else:
                ignored = bool(repo.git.check_ignore(rel, with_exceptions=False)) if (root / rel).exists() else False
                why = "is ignored by git" if ignored else "does not exist in the working tree"
                raise ProvenanceError(
                    f"code path {declared} ({root / rel}) {why}; fix the stage's declared code paths"
                ) from None

    patch = _masked_patch(patch, root)
    submodules = _submodules(repo)
    patch_hash: str | None = None
    patch_path: str | None = None
    if patch:
        patch_hash = hash_bytes(patch)
    if patch and keep_patch:
        settings = settings if settings is not None else load_settings()
        blob = settings.blobs_dir / patch_hash
        if not blob.exists():
            atomic_write(blob, patch)
        patch_path = str(blob)
    return GitInfo(
        available=True,
        root=str(root),
        remote_url=_remote_url(repo),
        branch=branch,
        commit=commit,
        # what git status would call dirty: a left-out file or repository too, though no patch holds it
        dirty=bool(patch or large or empty_repos) or any(s.dirty for s in submodules),
        patch_hash=patch_hash,
        patch_path=patch_path,
        patch_bytes=len(patch),
        untracked=untracked,
        untracked_large=large,
        tree_hashes=tree_hashes,
        submodules=submodules,
        message=subject,
        authored_at=authored,
    )


def path_hashes(path: Path, paths: Sequence[str]) -> dict[str, str | None]:
    """The working-tree git ids of ``paths`` (relative to the repository root), None where absent.

    The same ids :func:`capture_git` records in ``tree_hashes``, for paths that need not exist:
    comparing a job image's code label with a run's tree must name what differs, not raise.
    """
    try:
        repo = _open_repo(Path(path).expanduser().resolve())
    except (InvalidGitRepositoryError, NoSuchPathError, GitCommandNotFound):
        raise ProvenanceError(f"{path} is not in a git working tree, so its code has no git ids") from None
    try:
        with _TempTree(repo) as work:
            return {rel: work.path_id(rel) for rel in paths}
    finally:
        repo.close()


@contextlib.contextmanager
def _existing_repo(repo_path: str | Path) -> Iterator[gitpython.Repo | None]:
    """The repository at ``repo_path`` (closed afterwards), or None where there is none (or no git):
    for the questions asked of a recorded commit later, which have no answer then, not an error."""
    try:
        repo = _open_repo(Path(repo_path))
    except (InvalidGitRepositoryError, NoSuchPathError, GitCommandNotFound):
        yield None
        return
    try:
        yield repo
    finally:
        repo.close()


def commit_exists(repo_path: Path, sha: str) -> bool:
    """Whether ``sha`` names a commit in the repository at ``repo_path`` (for verify)."""
    if not sha or not re.fullmatch(r"[0-9a-fA-F]{4,64}", sha):
        return False
    with _existing_repo(repo_path) as repo:
        if repo is None:
            return False
        try:
            repo.git.cat_file("-e", f"{sha}^{{commit}}")
            return True
        except GitCommandError:
            return False


def commits_touching(
    repo_path: str | Path, old_sha: str, new_sha: str, paths: Sequence[str], limit: int = 20
) -> list[tuple[str, str]] | None:
    """``(sha, subject)`` of each commit after ``old_sha`` up to ``new_sha`` that touched one of
    ``paths``, newest first, at most ``limit``: which commits changed the code whose tree hash
    differs between two stage runs. None when the repository or either commit is not here."""
    if not all(re.fullmatch(r"[0-9a-fA-F]{7,64}", s or "") for s in (old_sha, new_sha)):
        return None
    with _existing_repo(repo_path) as repo:
        if repo is None:
            return None
        try:
            found = repo.iter_commits(f"{old_sha}..{new_sha}", paths=list(paths), max_count=limit)
            return [(c.hexsha, str(c.message).strip().splitlines()[0] if c.message else "") for c in found]
        except (GitCommandError, ValueError):
            return None


def uncommitted(repo_path: str | Path, paths: Sequence[str]) -> bool | None:
    """Whether the working tree at ``repo_path`` differs from HEAD under ``paths`` (edited, staged,
    added or deleted files), None when there is no repository there."""
    with _existing_repo(repo_path) as repo:
        if repo is None:
            return None
        try:
            return bool(repo.git.status("--porcelain", "--", *paths).strip())
        except GitCommandError:
            return None
