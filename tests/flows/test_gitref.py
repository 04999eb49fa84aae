"""git_ref: HEAD runs the working tree; another ref runs a clean, reused worktree of that commit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flows.gitref import checkout_ref
from orchestrator.errors import ConfigError
from orchestrator.settings import load_settings


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_checkout_ref(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "stage.py").write_text("v = 1\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "one")
    main_sha = _git(repo, "rev-parse", "HEAD")
    (repo / "stage.py").write_text("v = 2  # uncommitted\n")
    (repo / "x.toml").write_text("")
    settings = load_settings(environ={"OPENLAB_HOME": str(tmp_path / "home"), "OPENLAB_CONFIG": str(repo / "x.toml")})

    assert checkout_ref(repo, "HEAD", settings) == repo
    tree = checkout_ref(repo, "main", settings)
    assert tree != repo and (tree / "stage.py").read_text() == "v = 1\n"
    assert _git(tree, "rev-parse", "HEAD") == main_sha
    assert checkout_ref(repo, main_sha[:10], settings) == tree  # same commit, same checkout
    with pytest.raises(ConfigError, match="names no commit"):
        checkout_ref(repo, "no-such-branch", settings)


def _commit_with_recipe_key(repo: Path, key_line: str) -> str:
    """A commit object (no branch, no change to the working tree) of HEAD with one line added under
    the tiny replica of the recipe: what a later or earlier ref with another recipe schema looks like."""
    recipe = "recipes/marin-535b-a23b.yaml"
    text = _git(repo, "show", f"HEAD:{recipe}").replace("  tiny:\n", f"  tiny:\n    {key_line}\n", 1)
    blob = subprocess.run(
        ["git", "-C", str(repo), "hash-object", "-w", "--stdin"], input=text, capture_output=True, text=True, check=True
    ).stdout.strip()
    index = repo / ".git" / "openlab-test-index"
    env = {**os.environ, "GIT_INDEX_FILE": str(index)}
    try:
        subprocess.run(["git", "-C", str(repo), "read-tree", "HEAD"], env=env, check=True)
        subprocess.run(
            ["git", "-C", str(repo), "update-index", "--cacheinfo", f"100644,{blob},{recipe}"], env=env, check=True
        )
        tree = subprocess.run(
            ["git", "-C", str(repo), "write-tree"], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    finally:
        index.unlink(missing_ok=True)
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e", "commit-tree", tree, "-p", "HEAD"]
        + ["-m", "a recipe with a key from another schema"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.prefect
def test_a_ref_whose_recipe_this_code_cannot_read_says_so(prefect_server: object, openlab_home: Path) -> None:
    """A run of another ref reads that ref's recipe with the serving code's schema: a key the serving
    code does not know is refused naming the key, the ref and what to do, before anything runs."""
    from prefect import flow

    from flows.pipeline import run_replica
    from orchestrator.pipeline.dag import REPO_ROOT

    sha = _commit_with_recipe_key(REPO_ROOT, "speculative_decoding: true")

    @flow(name="gitref-schema")
    def run() -> None:
        ref = {"git_ref": sha, "force": False, "dry_run": True}
        run_replica(recipe="marin-535b-a23b", replica="tiny", backend="local", issue=None, **ref)

    try:
        state = run(return_state=True)
    finally:  # the ref's checkout is registered in the project's own repository: leave none behind
        worktree = openlab_home / "worktrees" / sha
        if worktree.exists():
            _git(REPO_ROOT, "worktree", "remove", "--force", str(worktree))
    assert state.is_failed()
    with pytest.raises(ConfigError) as err:
        state.result()
    message = str(err.value)
    assert "speculative_decoding" in message and f"git ref {sha}" in message, message
    assert "serve the flows from that ref" in message


def test_the_nightly_tests_main_as_the_remote_has_it_not_as_last_pulled(tmp_path: Path) -> None:
    """The server's checkout of main is as new as its last pull: a nightly of `main` tested the same
    commit every night, every stage reused, a green status on it each morning."""
    import logging

    from flows.gitref import latest_ref

    upstream = tmp_path / "upstream.git"
    _git(tmp_path, "init", "-q", "--bare", "-b", "main", str(upstream))
    dev = tmp_path / "dev"
    _git(tmp_path, "clone", "-q", str(upstream), str(dev))
    ident = ("-c", "user.name=t", "-c", "user.email=t@e")
    (dev / "stage.py").write_text("v = 1\n")
    _git(dev, "add", ".")
    _git(dev, *ident, "commit", "-qm", "one")
    _git(dev, "push", "-q", "origin", "HEAD:main")
    server = tmp_path / "server"
    _git(tmp_path, "clone", "-q", str(upstream), str(server))
    (dev / "stage.py").write_text("v = 2\n")
    _git(dev, *ident, "commit", "-qam", "two")
    _git(dev, "push", "-q", "origin", "HEAD:main")
    pushed = _git(dev, "rev-parse", "HEAD")
    assert _git(server, "rev-parse", "main") != pushed, "the server has not pulled"

    ref = latest_ref(server, "main")
    assert ref == "origin/main" and _git(server, "rev-parse", ref) == pushed
    sha = _git(server, "rev-parse", "main")
    assert latest_ref(server, sha) == sha and latest_ref(server, "HEAD") == "HEAD", "only a tracking branch moves"
    _git(server, "remote", "set-url", "origin", str(tmp_path / "gone.git"))  # the remote down: said, last fetched
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("test-latest-ref")
    log.addHandler(handler)
    assert latest_ref(server, "main", log) == "origin/main"
    assert records and records[0].startswith("could not fetch main from origin"), records


def test_worktrees_no_run_used_since_are_removed_and_one_in_use_is_kept(tmp_path: Path) -> None:
    """Each nightly on a new commit added a whole checkout under $OPENLAB_HOME/worktrees, and a
    worktree entry in the repository, for good: gc removes those no run has used since its cut."""
    import datetime as dt
    import fcntl

    from flows.gitref import prune_worktrees, stale_worktrees

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    ident = ("-c", "user.name=t", "-c", "user.email=t@e")
    shas = []
    for v in (1, 2):
        (repo / "stage.py").write_text(f"v = {v}\n")
        _git(repo, "add", ".")
        _git(repo, *ident, "commit", "-qm", f"v{v}")
        shas.append(_git(repo, "rev-parse", "HEAD"))
    (repo / "x.toml").write_text("")
    settings = load_settings(environ={"OPENLAB_HOME": str(tmp_path / "home"), "OPENLAB_CONFIG": str(repo / "x.toml")})
    old, new = (checkout_ref(repo, sha, settings) for sha in shas)
    week_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=7)
    stamp = (week_ago - dt.timedelta(days=1)).timestamp()
    os.utime(old.parent / f"{old.name}.lock", (stamp, stamp))  # last checked out eight days ago

    assert stale_worktrees(settings, week_ago) == [old]
    assert prune_worktrees(repo, settings, week_ago) == [old]
    assert not old.exists() and new.exists()
    assert str(old) not in _git(repo, "worktree", "list") and str(new) in _git(repo, "worktree", "list")
    assert checkout_ref(repo, shas[0], settings) == old and old.exists(), "made again when a run asks for it"

    os.utime(old.parent / f"{old.name}.lock", (stamp, stamp))
    with (old.parent / f"{old.name}.lock").open("a") as held:  # a run checking it out right now
        fcntl.flock(held, fcntl.LOCK_EX)
        assert prune_worktrees(repo, settings, week_ago) == [] and old.exists()

    # a run still going, started from that checkout eight days ago (a long training): its commit is in use
    from flows.gitref import running_commits
    from orchestrator.lineage import Commit, LineageStore, PipelineRun

    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as store:
        with store.transaction() as tx:
            run = tx.add(PipelineRun(recipe="r", replica="tiny", state="RUNNING"))
            tx.relate("wasAssociatedWith", run, tx.add(Commit(id=shas[0], sha=shas[0])), role="code")
            done = tx.add(PipelineRun(recipe="r", replica="tiny", state="COMPLETED"))
            tx.relate("wasAssociatedWith", done, tx.add(Commit(id=shas[1], sha=shas[1])), role="code")
        in_use = running_commits(store)
    assert in_use == {shas[0]}
    assert stale_worktrees(settings, week_ago, in_use) == [] and prune_worktrees(repo, settings, week_ago, in_use) == []
    assert old.exists()
