"""The GitHub link through a real pipeline run: what a user sees on the experiment issue.

The toy pipeline (tests/pipeline/toy.py: git repo, local launcher, SQLite) runs with an
experiment issue against the fake GitHub API; these tests check the promises that only
hold across a whole run: one card comment edited at every stage transition, never two;
an optional link that fails never stops the run; a required one stops it before any job.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.lineage.models import Attempt, GithubIssue, GithubUpdate, PipelineRun, StageRun
from orchestrator.lineage.store import open_store
from orchestrator.lineage.trace import trace
from orchestrator.links.github import GithubLinkError, marker
from orchestrator.pipeline import RunOptions, run_pipeline
from tests.links.links_fakes import TOKEN, FakeGitHub
from tests.pipeline.toy import make_repo, toy_configs, toy_pipeline

ISSUE = "lab/exp#7"


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("TOY_LEDGER", str(ledger))
    return make_repo(tmp_path), ledger


def _options(**kw: object) -> RunOptions:
    return RunOptions(wait_poll=0.05, lease_ttl=10, **kw)  # type: ignore[arg-type]


def test_one_card_comment_follows_the_whole_run(fake_github: FakeGitHub, toy: tuple[Path, Path]) -> None:
    repo, _ = toy
    result = run_pipeline(toy_pipeline(repo), toy_configs(), options=_options(issue=ISSUE))
    assert result.ok, result.error

    [comment] = fake_github.comments_on("lab/exp", 7)
    body = comment["body"]
    assert body.startswith(marker(result.pipeline_run.id))
    for stage in ("gen", "upper", "count"):
        assert stage in body
    assert "COMPLETED" in body and "RUNNING" not in body
    # created once, then edited as stages moved on: never a second comment for this run
    assert fake_github.count("POST", "/comments$") == 1 and fake_github.count("PATCH") >= 1
    assert "openlab:running" not in fake_github.issues[("lab/exp", 7)]["labels"]
    assert TOKEN not in body

    second = run_pipeline(toy_pipeline(repo), toy_configs(), options=_options(issue=ISSUE))
    assert second.ok
    assert len(fake_github.comments_on("lab/exp", 7)) == 2  # a new run gets its own card
    with open_store() as store:
        issue = store.require(GithubIssue, ISSUE)
        assert issue.resolved and issue.title == "MoE replica: aux-loss-free routing"
        # Everything done for the experiment: both runs, their stages and what the stages made
        reached = {n.id for n in trace(store, ISSUE, direction="down").walk()}
        assert {result.pipeline_run.id, second.pipeline_run.id} <= reached
        count_out = result.results["count"]
        assert count_out.stage_run_id in reached
        stage = store.require(StageRun, count_out.stage_run_id)
        assert stage.outputs["out"]["artifact_id"] in reached


def test_optional_link_that_fails_never_stops_the_run(fake_github: FakeGitHub, toy: tuple[Path, Path]) -> None:
    repo, ledger = toy
    fake_github.token = "rotated-elsewhere"  # our token is now rejected: 401
    result = run_pipeline(toy_pipeline(repo), toy_configs(), options=_options(issue=ISSUE))
    assert result.ok, result.error
    assert len(ledger.read_text().splitlines()) == 3  # every stage ran
    with open_store() as store:
        issue = store.require(GithubIssue, ISSUE)
        assert not issue.resolved and "401" in (issue.last_error or "")
        assert any(u.state == "pending" for u in store.list(GithubUpdate))  # `openlab github sync` flushes later


@pytest.mark.parametrize("how", ["option", "config"])
def test_required_link_that_fails_stops_before_any_job(
    fake_github: FakeGitHub, openlab_env: Path, toy: tuple[Path, Path], how: str
) -> None:
    repo, ledger = toy
    fake_github.token = "rotated-elsewhere"
    if how == "config":
        openlab_env.write_text(openlab_env.read_text() + "required = true\n")
    with pytest.raises(GithubLinkError, match="401"):
        run_pipeline(toy_pipeline(repo), toy_configs(), options=_options(issue=ISSUE, issue_required=how == "option"))
    assert not ledger.exists()  # no stage job started
    with open_store() as store:
        [run] = store.list(PipelineRun)
        assert run.state == "FAILED" and "401" in (run.error or "")  # the failure is on record
        assert store.list(Attempt) == []


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        ("notanissue", "malformed issue reference 'notanissue': use owner/repo#N"),
        ("#7", "issue reference '#7' names no repository and [github] repo is not set"),
    ],
)
def test_a_malformed_issue_reference_is_refused_before_a_run_is_recorded(
    openlab_env: Path, run_cli, ref: str, want: str
) -> None:
    """A typo in --issue is bad input: one line, exit 2, and no FAILED run left to explain in `lineage list`."""
    done = run_cli("run", "marin-535b-a23b", "--replica", "tiny", "--issue", ref, "--until", "data")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {want}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    with open_store() as store:
        assert store.list(PipelineRun) == [] and store.list(Attempt) == []


def test_cli_require_issue_without_token_is_one_line_exit_2(openlab_env: Path, run_cli) -> None:
    done = run_cli("run", "marin-535b-a23b", "--replica", "tiny", "--issue", ISSUE, "--require-issue")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "GITHUB_TOKEN" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    with open_store() as store:
        assert store.list(Attempt) == []
        assert [(r.state, r.params.get("issue_required")) for r in store.list(PipelineRun)] == [("FAILED", True)]
