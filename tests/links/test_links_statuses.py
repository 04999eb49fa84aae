"""The nightly's verdict as a commit status on the commit it tested: success or failure, one context
per recipe and replica, linked to the regression issue; clean commits only; queued without a token.
Verdicts from the real nightly comparison over planted runs; GitHub is the local fake."""

from __future__ import annotations

from orchestrator.lineage.models import GithubUpdate
from orchestrator.lineage.store import LineageStore
from orchestrator.links.github import GithubLinker
from orchestrator.links.regressions import report_verdict
from orchestrator.links.statuses import report_status
from tests.links.links_fakes import TOKEN, FakeGitHub
from tests.links.test_links_regressions import BAD, FIXED, GOOD, _nightly

CONTEXT = "openlab/nightly (marin-535b-a23b/tiny)"


def test_each_nightly_marks_the_commit_it_tested(fake_github: FakeGitHub, store: LineageStore) -> None:
    baseline = _nightly(store, GOOD, 2.0, 0)
    assert report_status(store, baseline.id).action == "posted"
    bad = _nightly(store, BAD, 2.3, 1)
    issue = report_verdict(store, bad.id)
    posted = report_status(store, bad.id)
    assert (posted.action, posted.state, posted.sha) == ("posted", "failure", BAD)
    assert report_status(store, _nightly(store, FIXED, 2.0, 2).id).state == "success"

    (first,) = fake_github.statuses[GOOD]
    assert (first["state"], first["context"]) == ("success", CONTEXT)
    assert first["description"].startswith("nightly baseline") and first["target_url"] is None
    (regressed,) = fake_github.statuses[BAD]
    assert (regressed["state"], regressed["context"]) == ("failure", CONTEXT)
    assert regressed["description"].startswith("nightly regression in 1 tracked metric(s): eval/loss")
    assert len(regressed["description"]) <= 140 and regressed["target_url"] == issue.url
    assert fake_github.statuses[FIXED][0]["state"] == "success"


def test_a_dirty_or_unknown_commit_gets_none_and_no_token_queues(
    fake_github: FakeGitHub, store: LineageStore, monkeypatch
) -> None:
    dirty = _nightly(store, GOOD + "+0123456789abcdef", 2.0, 0)
    skipped = report_status(store, dirty.id)
    assert skipped.action == "none" and "not a clean commit" in (skipped.error or "")
    assert fake_github.statuses == {}

    fake_github.known_commits = {GOOD}
    unknown = report_status(store, _nightly(store, BAD, 2.0, 1).id)
    assert (
        unknown.action == "failed"
        and unknown.error == f"GitHub does not know commit {BAD[:12]} in lab/exp (was it pushed?)"
    )

    fake_github.known_commits = None
    monkeypatch.delenv("GITHUB_TOKEN")
    later = _nightly(store, FIXED, 2.0, 2)
    assert report_status(store, later.id).action == "queued"
    assert [(u.action, u.pipeline_run_id) for u in store.list(GithubUpdate, state="pending")] == [("status", later.id)]
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    assert GithubLinker(store).sync().sent == 1
    assert [s["state"] for s in fake_github.statuses[FIXED]] == ["success"], "sent once"
