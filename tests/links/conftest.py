"""Fixtures for the links tests: a temp OPENLAB_HOME, the fake GitHub API, a recorded pipeline run."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

# PyGithub sets its logger's level when first imported, which undid a test's earlier
# caplog.at_level(DEBUG, logger="github") when that test was the first to use GitHub in its process.
import github  # noqa: F401
import pytest
from pytest_httpserver import HTTPServer

from orchestrator.lineage.models import Attempt, Commit, DataSnapshot, PipelineRun, StageRun, WandbRun
from orchestrator.lineage.store import LineageStore, open_store
from tests.links.links_fakes import TOKEN, FakeGitHub


@pytest.fixture
def openlab_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp OPENLAB_HOME and config file; no W&B key; returns the config path to extend."""
    home = tmp_path / "home"
    config = tmp_path / "openlab.toml"
    config.write_text("")
    monkeypatch.setenv("OPENLAB_HOME", str(home))
    monkeypatch.setenv("OPENLAB_CONFIG", str(config))
    for name in ("OPENLAB_DB_URL", "WANDB_API_KEY", "GITHUB_TOKEN", "GH_TOKEN_TEST"):
        monkeypatch.delenv(name, raising=False)
    return config


@pytest.fixture
def fake_github(httpserver: HTTPServer, openlab_env: Path, monkeypatch: pytest.MonkeyPatch) -> FakeGitHub:
    """The fake API plus ``[github]`` config pointing at it and ``GITHUB_TOKEN`` set."""
    fake = FakeGitHub(httpserver)
    fake.add_issue("lab/exp", 7, title="MoE replica: aux-loss-free routing", labels=["experiment"])
    openlab_env.write_text(
        "[github]\n"
        f'base_url = "{fake.api}"\n'
        'repo = "lab/exp"\n'
        "seconds_between_requests = 0\n"
        "seconds_between_writes = 0\n"
        "max_wait_s = 5\n"
        "timeout_s = 5\n"
    )
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    return fake


@pytest.fixture
def store(openlab_env: Path) -> Iterator[LineageStore]:
    s = open_store()
    yield s
    s.close()


@pytest.fixture
def pipeline(store: LineageStore) -> PipelineRun:
    """A recorded pipeline run: two stages, a dirty commit, a snapshot, attempts and a W&B run."""
    t0 = dt.datetime(2026, 12, 1, 3, 0, tzinfo=dt.UTC)
    with store.transaction() as tx:
        run = tx.add(
            PipelineRun(
                id="prun_test0001",
                name="nightly moe",
                recipe="moe-replica",
                replica="olmoe",
                backend="slurm",
                trigger="schedule",
                state="RUNNING",
                started_at=t0,
            )
        )
        commit = tx.add(
            Commit(
                id="abc1234def5678+p1",
                sha="abc1234def567890",
                remote_url="git@github.com:lab/exp.git",
                dirty=True,
                patch_hash="9f8e7d6c5b4a39281706",
            )
        )
        snap = tx.add(
            DataSnapshot(id="b3snapshot0123456789abcdef", path="/data/tok", files=3, bytes=100, manifest_path="/m.json")
        )
        tok = tx.add(
            StageRun(
                id="srun_tok",
                pipeline_run_id=run.id,
                stage="tokenize",
                identity="a" * 64,
                state="REUSED",
                reused_from="srun_older",
                started_at=t0,
            )
        )
        train = tx.add(
            StageRun(
                id="srun_train",
                pipeline_run_id=run.id,
                stage="train",
                identity="b" * 64,
                state="RUNNING",
                started_at=t0 + dt.timedelta(minutes=1),
            )
        )
        tx.add(
            Attempt(
                stage_run_id=train.id, number=1, backend="slurm", job_id="4242", state="RUNNING", cluster="marin-west"
            )
        )
        wb = tx.add(
            WandbRun(
                id="/openlab/w1234567",
                run_id="w1234567",
                project="openlab",
                mode="offline",
                local_dir="/runs/wandb/offline-run-x-w1234567",
                summary={"loss": 2.5, "_step": 3},
            )
        )
        tx.relate("wasAssociatedWith", run, commit)
        tx.relate("used", tok, snap)
        tx.relate("wasAssociatedWith", train, commit)
        tx.relate("wasAssociatedWith", train, wb)
    return run
