"""Run a pipeline at a git ref: a detached worktree per commit, reused across runs.

``git_ref="HEAD"`` runs the working tree as it is (dirty edits included, and recorded
as dirty by provenance capture). Any other ref — ``main`` for the nightly — is resolved
to a commit and checked out into ``$OPENLAB_HOME/worktrees/<sha>``, so the run sees
exactly that commit no matter what the developer has checked out or edited. Identities
hash file content, not paths, so a stage computed in the worktree is reused by a run of
the same code in the working tree, and vice versa.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import re
import shutil
import subprocess
from collections.abc import Collection
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.settings import Settings

#: Longest a nightly waits for ``git fetch`` of the branch it tests (:func:`latest_ref`).
FETCH_TIMEOUT = 120.0


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(  # noqa: S603 - fixed git arguments
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ConfigError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def resolve_ref(repo: Path, ref: str) -> str:
    """The full commit sha ``ref`` names in ``repo``; a clear error when it names none."""
    try:
        return _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except ConfigError:
        raise ConfigError(f"git ref {ref!r} names no commit in {repo}") from None


def latest_ref(repo: Path, ref: str, log: logging.Logger | logging.LoggerAdapter[Any] | None = None) -> str:
    """``ref``'s upstream, fetched first, for a branch that tracks one (``main`` -> ``origin/main``);
    ``ref`` itself for anything else (a tag, a sha, a branch with no upstream, HEAD).

    The nightly tests "the current main": the server's checkout of ``main`` is only as new as the
    last time someone pulled there, and a nightly of it tested the same commit every night, every
    stage reused, green. A fetch that fails (no network, the remote down) is said, and the upstream
    as last fetched is tested."""
    name = (ref or "").strip()
    if not name or name in ("HEAD", "@"):
        return ref
    try:
        upstream = _git(repo, "rev-parse", "--abbrev-ref", "--symbolic-full-name", f"{name}@{{upstream}}")
    except ConfigError:  # not a branch, or one that tracks nothing: what it names here
        return ref
    remote = _git(repo, "config", "--get", f"branch.{name}.remote")
    merge = _git(repo, "config", "--get", f"branch.{name}.merge").removeprefix("refs/heads/")
    try:
        proc = subprocess.run(  # noqa: S603 - fixed git arguments
            ["git", "-C", str(repo), "fetch", "--quiet", remote, merge],
            capture_output=True,
            text=True,
            check=False,
            timeout=FETCH_TIMEOUT,
        )
        failed = proc.stderr.strip() if proc.returncode else ""
    except subprocess.TimeoutExpired:
        failed = f"no answer within {FETCH_TIMEOUT:g} s"
    if failed and log is not None:
        log.warning("could not fetch %s from %s (%s): testing %s as last fetched", merge, remote, failed, upstream)
    return upstream


def checkout_ref(repo: Path, ref: str | None, settings: Settings) -> Path:
    """The tree to run ``ref`` from: ``repo`` itself for HEAD/empty, else a worktree of that commit."""
    if not ref or ref.strip() in ("HEAD", "@"):
        return repo
    sha = resolve_ref(repo, ref.strip())
    root = settings.home / "worktrees"
    root.mkdir(parents=True, exist_ok=True)
    path = root / sha
    with (root / f"{sha}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs of one commit share one checkout
        if path.exists():
            try:
                if _git(path, "rev-parse", "HEAD") == sha:
                    return path
            except ConfigError:
                pass
            _git(repo, "worktree", "remove", "--force", str(path))
        _git(repo, "worktree", "prune")
        _git(repo, "worktree", "add", "--detach", "--force", str(path), sha)
    return path


def running_commits(store: Any) -> set[str]:
    """The commits of pipeline runs not yet ended: a run checks its worktree out once, at its start, so
    a run longer than gc's ``unused_for`` had its checkout removed from under it."""
    from sqlmodel import col

    from orchestrator.lineage.diff import commit_of
    from orchestrator.lineage.models import PipelineRun

    shas: set[str] = set()
    for run in store.list(PipelineRun, where=[col(PipelineRun.state).in_(("PENDING", "RUNNING"))]):
        found = commit_of(store, run)
        if found is not None and found.sha:
            shas.add(found.sha)
    return shas


def stale_worktrees(settings: Settings, unused_since: dt.datetime, in_use: Collection[str] = ()) -> list[Path]:
    """The commit worktrees (``$OPENLAB_HOME/worktrees/<sha>``) no run has checked out since
    ``unused_since``: each run of a ref takes the checkout's lock, whose file's time is its last use;
    those of ``in_use`` commits (:func:`running_commits`) are not stale, however long ago."""
    root = settings.home / "worktrees"
    stale = []
    for path in sorted(root.glob("*")) if root.is_dir() else []:
        if not path.is_dir() or not re.fullmatch(r"[0-9a-f]{40}", path.name) or path.name in in_use:
            continue
        lock = root / f"{path.name}.lock"
        used = (lock if lock.exists() else path).stat().st_mtime
        if dt.datetime.fromtimestamp(used, dt.UTC) < unused_since:
            stale.append(path)
    return stale


def prune_worktrees(
    repo: Path, settings: Settings, unused_since: dt.datetime, in_use: Collection[str] = ()
) -> list[Path]:
    """Remove :func:`stale_worktrees`, each as ``git worktree remove`` does (the repository's list of
    worktrees too): each nightly on a new commit added a whole checkout, for good. One a run holds
    now (its lock taken) is left. Returns those removed."""
    removed = []
    for path in stale_worktrees(settings, unused_since, in_use):
        lock = path.parent / f"{path.name}.lock"
        with lock.open("a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a run checks it out right now
                continue
            try:
                _git(repo, "worktree", "remove", "--force", str(path))
            except ConfigError:  # not one of this repository's: its files alone
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        lock.unlink(missing_ok=True)
    if removed:
        with contextlib.suppress(ConfigError):
            _git(repo, "worktree", "prune")
    return removed


__all__ = ["checkout_ref", "latest_ref", "prune_worktrees", "resolve_ref", "running_commits", "stale_worktrees"]
