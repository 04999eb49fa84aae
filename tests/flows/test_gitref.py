"""git_ref: HEAD runs the working tree; another ref runs a clean, reused worktree of that commit."""

from __future__ import annotations

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
    settings = load_settings(environ={"OPENLAB_HOME": str(tmp_path / "home"), "OPENLAB_CONFIG": str(repo / "x.toml")})
    (repo / "x.toml").write_text("")

    assert checkout_ref(repo, "HEAD", settings) == repo
    tree = checkout_ref(repo, "main", settings)
    assert tree != repo and (tree / "stage.py").read_text() == "v = 1\n"
    assert _git(tree, "rev-parse", "HEAD") == main_sha
    assert checkout_ref(repo, main_sha[:10], settings) == tree  # same commit, same checkout
    with pytest.raises(ConfigError, match="names no commit"):
        checkout_ref(repo, "no-such-branch", settings)
