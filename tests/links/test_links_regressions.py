"""A nightly that regresses opens a GitHub issue, a still-red one comments on it, the next good one
closes it. Verdicts come from the real nightly comparison over planted runs; GitHub is the local
fake speaking its REST JSON."""

from __future__ import annotations

import datetime as dt
import shlex
from pathlib import Path

from orchestrator.lineage.diff import diff_records
from orchestrator.lineage.listing import RecordFilter, list_records
from orchestrator.lineage.models import GithubIssue, GithubUpdate, PipelineRun, Relation, utcnow
from orchestrator.lineage.store import LineageStore
from orchestrator.lineage.trace import describe
from orchestrator.links.github import GithubLinker
from orchestrator.links.regressions import _marker_of, regression_marker, report_verdict
from orchestrator.nightly import evaluate_nightly
from tests.flows.test_nightly_library import TOLERANCES, plant_run
from tests.links.links_fakes import TOKEN, FakeGitHub

GOOD, BAD, WORSE, FIXED = "a" * 40, "b" * 40, "c" * 40, "d" * 40


def _nightly(store: LineageStore, sha: str, loss: float, minutes: int, ref: str | None = None) -> PipelineRun:
    """A finished nightly at ``sha`` whose eval loss is ``loss``, judged (and recorded) as the flow does;
    ``ref``: run from the UI on that git ref, as the nightly's form allows."""
    run = plant_run(store, sha, loss, 0.03, minutes=minutes)
    if ref is not None:
        with store.transaction() as tx:
            tx.update(run, params={"prefect": {"git_ref": ref}})
    evaluate_nightly(store, run.id, TOLERANCES)
    return store.require(PipelineRun, run.id)


def _regression_issues(fake: FakeGitHub) -> list[dict]:
    return [i for i in fake.issues_in("lab/exp") if "openlab:regression" in [lb["name"] for lb in i["labels"]]]


def test_a_regression_opens_one_issue_that_the_next_good_nightly_closes(
    fake_github: FakeGitHub, store: LineageStore
) -> None:
    baseline = _nightly(store, GOOD, 2.00, 0)
    assert report_verdict(store, baseline.id).action == "none", "a baseline says nothing"
    bad = _nightly(store, BAD, 2.30, 1)

    opened = report_verdict(store, bad.id)
    assert opened.action == "opened" and opened.issue_id == "lab/exp#8", opened
    (issue,) = _regression_issues(fake_github)
    assert issue["title"] == "Nightly regression: marin-535b-a23b/tiny: eval/loss"
    body = issue["body"]
    assert regression_marker("marin-535b-a23b", "tiny", None, "HEAD") in body
    assert "| `eval/loss` ❌ | 2.0 | 2.3 |" in body
    assert f"{fake_github.web}/lab/exp/compare/{GOOD[:12]}...{BAD[:12]}" in body
    command = f"openlab lineage diff {baseline.id} {bad.id} -m eval/loss"
    assert f"`{command}`" in body
    # what that command compares: the regressed metric, moved, in the stage that reported it
    patterns = shlex.split(command)[6::2]
    sections = diff_records(store, store.find(baseline.id), store.find(bad.id), patterns)
    moved = {(s.name, c.metric): (c.old, c.new) for s in sections for c in s.metrics}
    assert moved == {("eval", "eval/loss"): (2.0, 2.3)}, moved
    assert TOKEN not in body

    assert report_verdict(store, bad.id).action == "already", "the same verdict twice changes nothing"
    worse = _nightly(store, WORSE, 2.40, 2)
    assert report_verdict(store, worse.id).action == "commented"
    assert len(_regression_issues(fake_github)) == 1, "still one issue"
    (still,) = fake_github.comments_on("lab/exp", 8)
    assert still["body"].splitlines()[1].startswith(f"**Still regressed** at commit `{WORSE[:12]}`")
    assert "| `eval/loss` ❌ | 2.0 | 2.4 |" in still["body"], "judged against the last good nightly"

    fixed = _nightly(store, FIXED, 2.01, 3)
    closed = report_verdict(store, fixed.id)
    assert closed.action == "closed" and closed.issue_id == "lab/exp#8"
    (issue,) = _regression_issues(fake_github)
    assert (issue["state"], issue["state_reason"]) == ("closed", "completed")
    assert fake_github.comments_on("lab/exp", 8)[-1]["body"].splitlines()[1].startswith("**Passed again**")
    assert report_verdict(store, _nightly(store, FIXED, 2.0, 4).id).action == "none", "nothing open: nothing said"

    # in lineage: the issue, and each run that reported to it
    recorded = store.require(GithubIssue, "lab/exp#8")
    assert recorded.state == "closed" and recorded.url and recorded.url.endswith("/lab/exp/issues/8")
    linked = store.list(Relation, where=[Relation.object_id == "lab/exp#8", Relation.role == "regression"])
    assert {r.subject_id for r in linked} == {bad.id, worse.id, fixed.id}
    # so `openlab lineage list --issue lab/exp#8` is the history of that regression, red to green
    reported = list_records(store, ["pipeline_run"], RecordFilter.from_options(issue="lab/exp#8")).records
    assert [r.id for r in reported] == [fixed.id, worse.id, bad.id]
    # ... each line saying how its nightly was judged
    judged = [describe(r).rsplit(" ", 2)[1:] for r in reported]
    assert judged == [["nightly", "passed"], ["nightly", "regressed"], ["nightly", "regressed"]], judged

    # the daily digest is for experiment issues: a regression issue has its own comments
    from orchestrator.links.digest import collect_digests, digest_window

    window = digest_window("1000d", until=utcnow() + dt.timedelta(days=1))
    assert "lab/exp#8" not in {d.issue_id for d in collect_digests(store, window)}

    # a new regression after the close is a new issue
    again = report_verdict(store, _nightly(store, BAD, 2.5, 5).id)
    assert again.action == "opened" and again.issue_id == "lab/exp#9"


def test_a_branchs_nightly_passing_leaves_mains_regression_issue_open(
    fake_github: FakeGitHub, store: LineageStore
) -> None:
    """Baselines are kept per backend and git ref; the regression issue was kept per recipe and replica.
    A nightly run from the UI on a fix branch, passing against its own baseline, commented "passed
    again" on main's issue and closed it while main was still red."""
    _nightly(store, GOOD, 2.0, 0)
    main_run = _nightly(store, BAD, 2.3, 1)
    main_red = report_verdict(store, main_run.id)
    assert main_red.action == "opened" and main_red.issue_id == "lab/exp#8"
    assert report_verdict(store, _nightly(store, FIXED, 2.3, 2, ref="fix-drops").id).action == "none", "its baseline"
    assert report_verdict(store, _nightly(store, FIXED, 2.31, 3, ref="fix-drops").id).action == "none"
    (issue,) = _regression_issues(fake_github)
    assert issue["state"] == "open" and fake_github.comments_on("lab/exp", 8) == []
    branch_run = _nightly(store, WORSE, 2.6, 4, ref="fix-drops")
    branch_red = report_verdict(store, branch_run.id)
    assert branch_red.action == "opened" and branch_red.issue_id == "lab/exp#9", "its own issue, not main's"
    titles = {i["number"]: i["title"] for i in _regression_issues(fake_github)}
    assert titles[9] == "Nightly regression: marin-535b-a23b/tiny (at fix-drops): eval/loss", titles
    # an issue opened before markers named the backend and ref is still main's nightly's, not a branch's
    from types import SimpleNamespace

    from orchestrator.links.regressions import _find_open

    legacy = SimpleNamespace(body=regression_marker("marin-535b-a23b", "tiny"))
    assert _find_open([legacy], main_run) is legacy and _find_open([legacy], branch_run) is None


def test_a_nightly_that_failed_opens_the_issue_naming_the_failure(fake_github: FakeGitHub, store: LineageStore) -> None:
    from orchestrator.nightly import failed_nightly

    _nightly(store, GOOD, 2.0, 0)
    crashed = plant_run(store, BAD, 2.0, 0.03, minutes=1, state="FAILED")
    failed_nightly(store, crashed.id, "stage pretrain failed: exit code 1: loss is NaN")
    opened = report_verdict(store, crashed.id)
    assert opened.action == "opened", opened
    (issue,) = _regression_issues(fake_github)
    assert issue["title"] == "Nightly regression: marin-535b-a23b/tiny: failed"
    assert "nightly failed before its verdict: stage pretrain failed: exit code 1: loss is NaN" in issue["body"]
    assert report_verdict(store, _nightly(store, FIXED, 2.01, 2).id).action == "closed", "the next good one closes it"


def test_a_regression_issue_that_lost_its_label_is_still_found_not_opened_again(
    fake_github: FakeGitHub, store: LineageStore
) -> None:
    """GitHub drops a new issue's labels when the token may not push; found by its label alone, the
    open issue was missed and another opened every night."""
    _nightly(store, GOOD, 2.0, 0)
    bad = _nightly(store, BAD, 2.3, 1)
    fake_github.add_issue(
        "lab/exp", 8, "Nightly regression: marin-535b-a23b/tiny: eval/loss", labels=[], body=_marker_of(bad)
    )
    report = report_verdict(store, bad.id)
    assert (report.action, report.issue_id) == ("commented", "lab/exp#8"), report
    assert _regression_issues(fake_github) == [], "none opened"


def test_another_replicas_open_issue_is_not_this_ones(fake_github: FakeGitHub, store: LineageStore) -> None:
    fake_github.add_issue(
        "lab/exp", 8, "Nightly regression: x/y", labels=["openlab:regression"], body=regression_marker("x", "y")
    )
    _nightly(store, GOOD, 2.0, 0)
    report = report_verdict(store, _nightly(store, BAD, 2.3, 1).id)
    assert report.action == "opened" and report.issue_id == "lab/exp#9"
    assert fake_github.comments_on("lab/exp", 8) == []


def test_without_a_token_the_report_is_queued_and_sync_sends_it_once(
    fake_github: FakeGitHub, store: LineageStore, monkeypatch
) -> None:
    _nightly(store, GOOD, 2.0, 0)
    bad = _nightly(store, BAD, 2.3, 1)
    monkeypatch.delenv("GITHUB_TOKEN")
    queued = report_verdict(store, bad.id)
    assert queued.action == "queued" and "no GitHub token" in (queued.error or "")
    (entry,) = store.list(GithubUpdate, state="pending")
    assert (entry.action, entry.issue_id, entry.pipeline_run_id) == ("regression", "lab/exp", bad.id)
    assert fake_github.requests == []

    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    linker = GithubLinker(store)
    report = linker.sync()
    assert (report.sent, report.failed, report.pending) == (1, 0, 0), report
    assert len(_regression_issues(fake_github)) == 1
    assert linker.sync().sent == 0 and len(_regression_issues(fake_github)) == 1, "sent once"


def test_turned_off_or_without_a_repository_nothing_is_asked(
    fake_github: FakeGitHub, store: LineageStore, openlab_env: Path
) -> None:
    _nightly(store, GOOD, 2.0, 0)
    bad = _nightly(store, BAD, 2.3, 1)
    openlab_env.write_text(openlab_env.read_text() + "regression_issues = false\n")
    assert report_verdict(store, bad.id).action == "off"
    assert fake_github.requests == [] and _regression_issues(fake_github) == []


def test_a_repository_github_does_not_know_is_one_line_and_not_queued(
    fake_github: FakeGitHub, store: LineageStore
) -> None:
    _nightly(store, GOOD, 2.0, 0)
    bad = _nightly(store, BAD, 2.3, 1)
    fake_github.fail("GET", r"^/repos/lab/exp/issues$", 404, {"message": "Not Found"})
    report = report_verdict(store, bad.id)
    assert report.action == "failed" and report.error is not None
    assert report.error.startswith("repository lab/exp not found (404): check [github] repo"), report.error
    assert store.list(GithubUpdate, state="pending") == [], "retrying cannot help: nothing queued"


def test_accepting_a_regression_makes_it_the_baseline_and_closes_its_issue(
    fake_github: FakeGitHub, store: LineageStore, run_cli, monkeypatch
) -> None:
    """Routing changed on purpose and moved eval loss: every nightly after it regressed against the old
    numbers until the tolerance was edited. `openlab nightly accept` makes the regressed run the
    baseline, keeps who and why on its verdict, and closes the regression issue as not planned."""
    baseline = _nightly(store, GOOD, 2.00, 0)
    bad = _nightly(store, BAD, 2.30, 1)
    assert report_verdict(store, bad.id).action == "opened"
    worse = _nightly(store, WORSE, 2.31, 2)
    assert report_verdict(store, worse.id).action == "commented"

    def accept(run_id: str, reason: str):
        return run_cli("nightly", "accept", run_id, "--reason", reason)

    for run_id, reason, says in [
        (worse.id, "   ", "--reason is empty"),
        (baseline.id, "new routing", "nothing to accept"),
        ("prun_nosuchrun", "new routing", "prun_nosuchrun"),
    ]:
        refused = accept(run_id, reason)
        assert refused.returncode == 2 and says in refused.stderr, refused
        assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    assert not (store.require(PipelineRun, worse.id).verdict or {}).get("accepted"), "a refusal records nothing"

    monkeypatch.setenv("MY_API_KEY", "s3cr3t-value-42")
    done = accept(worse.id, "aux-loss-free routing lands (lab/exp#7); key s3cr3t-value-42")
    assert done.returncode == 0, done.stderr
    assert f"{worse.id} at commit {WORSE[:12]} is the baseline" in done.stdout, done.stdout
    assert "regression issue lab/exp#8: closed" in done.stdout, done.stdout
    verdict = store.require(PipelineRun, worse.id).verdict
    assert verdict["status"] == "regressed", "the history keeps what the numbers did"
    assert verdict["accepted"]["reason"] == "aux-loss-free routing lands (lab/exp#7); key ***"
    assert "@" in verdict["accepted"]["by"] and verdict["accepted"]["at"]
    assert [e.action for e in store.events(worse.id)][-1] == "update", "written through a logged transaction"
    (issue,) = _regression_issues(fake_github)
    assert (issue["state"], issue["state_reason"]) == ("closed", "not_planned")
    said = fake_github.comments_on("lab/exp", 8)[-1]["body"]
    assert "**Accepted as the new baseline**" in said and "aux-loss-free routing" in said
    assert "s3cr3t-value-42" not in said

    # the next nightly is judged against the accepted run: same numbers pass, no issue to speak on
    nxt = _nightly(store, FIXED, 2.31, 3)
    assert nxt.verdict["status"] == "passed" and nxt.verdict["previous_run_id"] == worse.id, nxt.verdict
    assert report_verdict(store, nxt.id).action == "none"

    again = accept(worse.id, "twice")
    assert again.returncode == 2 and "accepted already" in again.stderr, again
    older = accept(bad.id, "the first red one")
    assert older.returncode == 2 and f"{nxt.id}, is the baseline already" in older.stderr, older

    listed = run_cli("nightly", "baselines")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[:3] == [
        "marin-535b-a23b/tiny on - at HEAD",
        f"  baseline: {nxt.id} {nxt.started_at.isoformat()[:16]} commit {FIXED[:12]} (passed)",
        f"  latest:   {nxt.id} {nxt.started_at.isoformat()[:16]} commit {FIXED[:12]} COMPLETED passed",
    ], listed.stdout
    assert run_cli("lineage", "verify").returncode == 0, "the acceptance is part of the hash chain"
