"""The forked CLI the tests use answers as ``python -m orchestrator.cli.main`` does.

Every CLI test reads exit codes, output and files through :mod:`tests.forked_cli`; if it answered
differently from a fresh interpreter (the environment or working directory of an earlier call, a
module imported with another ``OPENLAB_HOME``), those tests would test the fork, not openlab.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.forked_cli import run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]


def _fresh(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 - our interpreter, the CLI's module
        [sys.executable, "-m", "orchestrator.cli.main", *args], capture_output=True, text=True, env=env, cwd=cwd
    )


def test_a_forked_command_answers_as_a_fresh_interpreter(tmp_path: Path) -> None:
    """Same exit status, stdout and stderr, for a listing, a refusal, a usage error and --help,
    each with its own home, so nothing of one call's environment reaches the next."""
    for i, args in enumerate(
        (
            ["lineage", "list", "--json"],
            ["lineage", "show", "prun_nope"],
            ["run", "--no-such-flag"],
            ["snapshot", str(REPO_ROOT / "recipes")],
            ["lineage", "list", "--kind", "snapshot", "--json"],
            ["--help"],
        )
    ):
        env = {**os.environ, "OPENLAB_HOME": str(tmp_path / f"home-{i % 2}"), "COLUMNS": "100"}
        forked = run_cli(args, env=env, cwd=REPO_ROOT, timeout=120)
        fresh = _fresh(args, env, REPO_ROOT)
        if args[0] == "snapshot":  # the second records the same snapshot again: the same answer, not the same id
            assert forked.returncode == fresh.returncode == 0, (forked.stderr, fresh.stderr)
            continue
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args


def test_a_forked_command_runs_in_the_directory_and_environment_given(tmp_path: Path) -> None:
    """A relative ``OPENLAB_HOME`` is resolved where the command runs, not where the template started."""
    (tmp_path / "work").mkdir()
    env = {**os.environ, "OPENLAB_HOME": "relative-home"}
    done = run_cli(["snapshot", str(REPO_ROOT / "recipes")], env=env, cwd=tmp_path / "work", timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "work" / "relative-home" / "lineage.db").exists()
    assert not (REPO_ROOT / "relative-home").exists()
