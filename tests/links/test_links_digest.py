"""The daily digest on experiment issues, against the fake GitHub API (PyGithub on the client side).

Runs are recorded in a real SQLite store (the conftest's temp OPENLAB_HOME), linked to their
issues as a pipeline start links them; the digest reads them back, renders one comment per
issue and UTC day and posts it through the card's client, queue and marker logic.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli.github import app as github_app
from orchestrator.lineage.models import (
    Attempt,
    GithubDigest,
    GithubUpdate,
    PipelineRun,
    Relation,
    utcnow,
)
from orchestrator.lineage.store import LineageStore
from orchestrator.links.digest import (
    IssueDigest,
    collect_digests,
    digest_marker,
    digest_record_id,
    digest_window,
    post_digests,
    render_digest,
)
from orchestrator.links.github import GithubLinker
from tests.links.digest_runs import DAY, NOW, H, prereg, record_run
from tests.links.links_fakes import TOKEN, FakeGitHub


@pytest.fixture
def day(fake_github: FakeGitHub, store: LineageStore) -> dict[str, PipelineRun]:
    """Two runs on lab/exp#7 and one on lab/exp#8 within the day before NOW, one on #7 days before,
    and lab/exp#9 with no run at all."""
    for n in (8, 9):
        fake_github.add_issue("lab/exp", n, title=f"experiment {n}")
    return {
        "done": record_run(
            store,
            "prun_done",
            "lab/exp#7",
            started=NOW - 20 * H,
            ended=NOW - 18 * H,
            state="COMPLETED",
            metrics={"eval/code/loss": 5.31, "moe/drop_fraction": 0.0213, "train/loss": 4.9},
            preregistration=prereg(5.31, "met"),
            verdict={"status": "passed", "message": "nightly passed: 3 tracked metric(s) within tolerance"},
            gpus=2,
            trigger="schedule",
            user="svc",
        ),
        "failed": record_run(
            store,
            "prun_failed",
            "lab/exp#7",
            started=NOW - 6 * H,
            ended=NOW - 5 * H,
            state="FAILED",
            stages={"pretrain": "FAILED"},
            error="job 4242 exited 3: CUDA out of memory\nTraceback (most recent call last): ...",
            preregistration=prereg(6.1, "missed"),
            params={  # `openlab sweep --grid pretrain.lr=0.01,0.02`'s second run
                "recipe": {"run_set": {"pretrain.lr": 0.02}},
                "sweep": {"id": "swp_" + "5" * 20, "run": 2, "of": 2},
            },
        ),
        "running": record_run(
            store,
            "prun_running",
            "lab/exp#8",
            started=NOW - 2 * H,
            ended=None,
            state="RUNNING",
            stages={"pretrain": "RUNNING"},
        ),
        "old": record_run(store, "prun_old", "lab/exp#7", started=NOW - 72 * H, ended=NOW - 70 * H, state="COMPLETED"),
    }


def _bodies(fake: FakeGitHub, number: int) -> list[str]:
    return [c["body"] for c in fake.comments_on("lab/exp", number)]


# -- posting ----------------------------------------------------------------------------------------
def test_one_digest_per_active_issue_with_its_runs_then_edited_the_same_day(
    fake_github: FakeGitHub, store: LineageStore, day: dict[str, PipelineRun]
) -> None:
    report = post_digests(store, until=NOW)
    assert [(d.issue_id, d.outcome) for d in report.digests] == [("lab/exp#7", "created"), ("lab/exp#8", "created")]
    [seven] = _bodies(fake_github, 7)
    [eight] = _bodies(fake_github, 8)
    assert _bodies(fake_github, 9) == [], "an issue without activity gets nothing"
    assert fake_github.count("POST", "/comments$") == 2

    assert seven.startswith(digest_marker(DAY)) and eight.startswith(digest_marker(DAY))
    assert "prun_done" in seven and "prun_failed" in seven and "prun_old" not in seven
    assert "prun_running" in eight and "prun_done" not in eight
    # what each run says: commit and subject, stages, the failure's one-line reason, metrics,
    # predictions met and missed, the verdict, W&B, hours
    assert (
        "[`c0ffee12`](https://github.com/lab/exp/commit/c0ffee1234567890) moe: quantile-balancing bias update" in seven
    )
    assert "**Failed:** `pretrain`: job 4242 exited 3: CUDA out of memory" in seven
    assert "- **Set for this run:** `pretrain.lr=0.02`" in seven  # which of the day's runs was the experiment
    assert seven.count("**Set for this run:**") == 1
    sweep = "swp_" + "5" * 20
    assert f"- **Sweep:** run 2 of 2 of `{sweep}` (`openlab lineage compare --sweep {sweep}`)" in seven, seven
    assert "Traceback" not in seven, "a failure is one line"
    assert "eval/code/loss 5.31 (eval)" in seven and "moe/drop_fraction 0.0213 (eval)" in seven
    assert "train/loss" not in seven, "only the key metrics"
    assert "measured 5.31 (+0.01): met" in seven and "measured 6.1 (+0.8): missed" in seven
    assert "**Nightly verdict:** passed: nightly passed: 3 tracked metric(s)" in seven
    assert "[prun_donew](https://wandb.ai/lab/openlab/runs/prun_donew) (pretrain)" in seven
    assert "2 job(s), 2.00 h wall, 4.00 GPU-hours" in seven  # two 1 h jobs asking 2 GPUs each
    assert "2 pipeline runs from 2026-12-04 07:00 to 2026-12-05 07:00 UTC" in seven
    assert "- **Trigger:** schedule, served by `svc`" in seven, "who: the account serving the flows, not a person"
    assert "**Still running**" in eight and "RUNNING" in eight
    # a running job counts up to the window's end, not the wall clock, so the same window reads the same
    assert "- **Used so far:** 1 job(s), 2.00 h wall" in eight
    recorded = store.require(GithubDigest, digest_record_id("lab/exp#7", DAY))
    assert recorded.pipeline_run_ids == ["prun_done", "prun_failed"] and recorded.comment_id is not None

    # later the same day: the running run finished; the digest is edited, never posted twice
    with store.transaction() as tx:
        tx.update(tx.get(PipelineRun, "prun_running"), state="COMPLETED", ended_at=NOW + H)
        [job] = store.list(Attempt, stage_run_id="prun_running-pretrain")
        tx.update(tx.get(Attempt, job.id), state="COMPLETED", ended_at=NOW + H)
    again = post_digests(store, until=NOW + 2 * H)
    # #7's runs say what they said: its comment is left alone though the window moved on two hours
    assert {d.issue_id: d.outcome for d in again.digests} == {"lab/exp#7": "unchanged", "lab/exp#8": "edited"}
    assert fake_github.count("POST", "/comments$") == 2
    assert fake_github.count("GET", "/issues/8/comments") == 1, "the recorded id is edited; no second marker scan"
    [eight_after] = _bodies(fake_github, 8)
    assert len(_bodies(fake_github, 7)) == 1
    assert "Still running" not in eight_after and "COMPLETED" in eight_after
    assert "- **Used:** 1 job(s), 3.00 h wall" in eight_after

    # nothing changed (a few minutes later, so only the window's own times differ): no API call at all
    patches = fake_github.count("PATCH")
    later = post_digests(store, until=NOW + 2 * H + dt.timedelta(minutes=7))
    assert {d.outcome for d in later.digests} == {"unchanged"}
    assert fake_github.count("PATCH") == patches

    # the next day is a new comment; the day before's stays as it was
    post_digests(store, until=NOW + 24 * H)
    assert len(_bodies(fake_github, 8)) == 2 and _bodies(fake_github, 8)[0] == eight_after
    assert _bodies(fake_github, 7) == [_bodies(fake_github, 7)[0]], "no #7 run ended or ran in that window"


def test_named_issues_only_and_quiet_ones_said(
    fake_github: FakeGitHub, store: LineageStore, day: dict[str, PipelineRun]
) -> None:
    report = post_digests(store, until=NOW, issues=["#8", "lab/exp#9"])
    assert [d.issue_id for d in report.digests] == ["lab/exp#8"] and report.quiet == ["lab/exp#9"]
    assert _bodies(fake_github, 7) == [] and len(_bodies(fake_github, 8)) == 1
    assert "lab/exp#9: no pipeline run in the window, nothing posted" in report.lines()


def test_crash_between_create_and_record_never_duplicates(
    fake_github: FakeGitHub, store: LineageStore, day: dict[str, PipelineRun], monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("process killed")

    with monkeypatch.context() as m:
        m.setattr(GithubLinker, "_record_digest_comment", crash)
        with pytest.raises(RuntimeError):
            post_digests(store, until=NOW, issues=["lab/exp#7"])
    assert len(_bodies(fake_github, 7)) == 1
    assert store.require(GithubDigest, digest_record_id("lab/exp#7", DAY)).comment_id is None

    with store.transaction() as tx:
        tx.update(tx.get(PipelineRun, "prun_failed"), error="reconciled")
    [d] = post_digests(store, until=NOW + H, issues=["lab/exp#7"]).digests
    [c] = fake_github.comments_on("lab/exp", 7)
    assert d.outcome == "edited" and fake_github.count("POST", "/comments$") == 1
    assert store.require(GithubDigest, digest_record_id("lab/exp#7", DAY)).comment_id == c["id"]


def test_a_busy_day_stays_under_the_limit_and_says_what_was_left_out(store: LineageStore) -> None:
    for i in range(12):
        record_run(
            store,
            f"prun_{i:02d}",
            "lab/exp#7",
            started=NOW - (12 - i) * H,
            ended=None,
            state="FAILED",
            stages={f"s{j}": "FAILED" for j in range(6)},
            error="x" * 400,
        )
    [digest] = collect_digests(store, digest_window("24h", until=NOW))
    body = render_digest(digest, limit=6000)
    assert len(body) <= 6000 and body.startswith(digest_marker(DAY))
    assert 0 < digest.left_out < 12
    kept = 12 - digest.left_out
    assert body.count("#### ") == kept and f"prun_{kept - 1:02d}" in body and f"prun_{kept:02d}" not in body
    assert f"_{digest.left_out} more run(s) left out to stay under GitHub's comment size limit" in body
    whole = IssueDigest(issue_id=digest.issue_id, window=digest.window, runs=digest.runs)
    assert render_digest(whole).count("#### ") == 12 and whole.left_out == 0


# -- offline queue -----------------------------------------------------------------------------------
def test_no_token_queues_then_sync_posts_it_once(
    fake_github: FakeGitHub, store: LineageStore, day: dict[str, PipelineRun], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GITHUB_TOKEN")
    report = post_digests(store, until=NOW)
    assert {d.outcome for d in report.digests} == {"queued"}
    assert "no GitHub token" in (report.digests[0].error or "")
    assert fake_github.requests == []
    queued = sorted((u.id, u.action, u.state) for u in store.list(GithubUpdate))
    assert queued == [
        (f"digest:lab/exp#7:{DAY}", "digest", "pending"),
        (f"digest:lab/exp#8:{DAY}", "digest", "pending"),
    ]
    runner = CliRunner()
    listed = runner.invoke(github_app, ["queue"])
    assert f"digest   lab/exp#7 {DAY} x1" in listed.output

    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    result = runner.invoke(github_app, ["sync"])
    assert result.exit_code == 0, result.output
    assert "2 sent" in result.output
    [seven] = _bodies(fake_github, 7)
    # sent for the window it was made for, though "now" is long after it
    assert seven.startswith(digest_marker(DAY)) and "prun_done" in seven and "prun_failed" in seven
    assert len(_bodies(fake_github, 8)) == 1
    again = runner.invoke(github_app, ["sync"])
    assert again.exit_code == 0 and "0 sent" in again.output
    assert fake_github.count("POST", "/comments$") == 2
    assert {u.state for u in store.list(GithubUpdate)} == {"done"}


def test_a_missing_issue_fails_the_command_in_one_line(
    fake_github: FakeGitHub, store: LineageStore, openlab_env: Path
) -> None:
    record_run(store, "prun_lost", "lab/exp#404", started=utcnow() - H, ended=utcnow(), state="COMPLETED")
    result = CliRunner().invoke(github_app, ["digest"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: digest on lab/exp#404 not posted: issue lab/exp#404 not found (404): check the repository "
        "and number, and that the token in $GITHUB_TOKEN can read lab/exp"
    ]
    assert "lab/exp#404: digest" in result.stdout and "failed" in result.stdout
    [entry] = store.list(GithubUpdate)
    assert entry.state == "failed"


# -- secrets ----------------------------------------------------------------------------------------
def test_token_never_in_digest_logs_or_lineage(
    fake_github: FakeGitHub, openlab_env: Path, store: LineageStore, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    record_run(
        store,
        "prun_leaky",
        "lab/exp#7",
        started=NOW - 3 * H,
        ended=NOW - 2 * H,
        state="FAILED",
        stages={"pretrain": "FAILED"},
        error=f"git push https://x:{TOKEN}@github.com/lab/exp failed",
    )
    runner = CliRunner()
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="github"):
        dry = runner.invoke(github_app, ["digest", "--since", "2026-12-04T07:00", "--dry-run", "--json"])
        monkeypatch.delenv("GITHUB_TOKEN")
        post_digests(store, until=NOW)  # queued
        monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
        post_digests(store, until=NOW)  # posted
    record_run(store, "prun_leaky_b", "lab/exp#7", started=NOW - H, ended=NOW + H / 2, state="COMPLETED")
    with caplog.at_level(logging.INFO):  # PyGithub's DEBUG log would show the body a server echoes
        fake_github.fail("GET", r"/issues/7$", 500, {"message": f"boom {TOKEN}"})
        [failed] = post_digests(store, until=NOW + H).digests
    assert failed.outcome == "queued" and "(500 boom ***)" in (failed.error or "")
    assert fake_github.comments, "the scenario must have posted"
    assert any(r.name.startswith("github") for r in caplog.records), "PyGithub debug logs must be captured"
    assert TOKEN not in caplog.text and TOKEN not in dry.output
    for c in fake_github.comments.values():
        assert TOKEN not in c["body"]
        assert "git push https://x:***@github.com" in c["body"] or "prun_leaky" not in c["body"]
    store.close()
    files = [p for p in (openlab_env.parent / "home").rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert TOKEN.encode() not in path.read_bytes(), path


# -- the command ------------------------------------------------------------------------------------
def test_cli_dry_run_json_prints_bodies_and_sends_nothing(fake_github: FakeGitHub, store: LineageStore) -> None:
    now = utcnow()
    record_run(store, "prun_a", "lab/exp#7", started=now - 3 * H, ended=now - 2 * H, state="COMPLETED")
    record_run(store, "prun_b", "lab/exp#7", started=now - 30 * H, ended=now - 29 * H, state="COMPLETED")
    runner = CliRunner()
    result = runner.invoke(github_app, ["digest", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dry_run"] is True and data["day"] == f"{now:%Y-%m-%d}"
    [digest] = data["digests"]
    assert digest["issue"] == "lab/exp#7" and digest["outcome"] == "dry run"
    assert [r["pipeline_run"] for r in digest["runs"]] == ["prun_a"]
    assert digest["runs"][0]["stages"] == {"pretrain": "COMPLETED", "eval": "COMPLETED"}
    assert digest["body"].startswith(digest_marker(f"{now:%Y-%m-%d}")) and "prun_a" in digest["body"]
    assert fake_github.requests == [] and store.list(GithubDigest) == [], "a dry run sends and records nothing"

    wider = json.loads(runner.invoke(github_app, ["digest", "--dry-run", "--json", "--since", "2d"]).stdout)
    assert [r["pipeline_run"] for r in wider["digests"][0]["runs"]] == ["prun_b", "prun_a"]
    text = runner.invoke(github_app, ["digest", "--dry-run", "--issue", "#7"])
    assert text.exit_code == 0 and text.stdout.startswith("--- lab/exp#7: digest")
    assert digest_marker(f"{now:%Y-%m-%d}") in text.stdout
    assert fake_github.requests == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--since", "yesterday"], "cannot read 'yesterday' as a time"),
        (["--since", "2999-01-01"], "--since '2999-01-01' is not before"),
        (["--issue", "lab/exp"], "malformed issue reference 'lab/exp'"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(fake_github: FakeGitHub, args, needle) -> None:
    """Said as it is even where nothing was recorded yet (no lineage database to open)."""
    result = CliRunner().invoke(github_app, ["digest", *args])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and needle in line
    assert "Traceback" not in result.output
    assert fake_github.requests == []


def test_digest_relates_to_its_issue_in_lineage(
    fake_github: FakeGitHub, store: LineageStore, day: dict[str, PipelineRun]
) -> None:
    post_digests(store, until=NOW, issues=["lab/exp#8"])
    rec = store.require(GithubDigest, digest_record_id("lab/exp#8", DAY))
    [rel] = store.list(Relation, subject_id=rec.id)
    assert (rel.relation, rel.object_id, rel.role) == ("wasDerivedFrom", "lab/exp#8", "digest-on")
    assert store.find(rec.id).url == rec.url and rec.url.endswith(f"#issuecomment-{rec.comment_id}")


# -- through a real pipeline run ----------------------------------------------------------------------
def test_a_real_pipeline_run_is_digested_beside_its_card(
    fake_github: FakeGitHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The toy pipeline (git repo, local jobs) with its issue: the digest finds the run through the link
    the pipeline recorded, with the commit it captured and the jobs it ran, as a second comment."""
    from orchestrator.lineage.store import open_store
    from orchestrator.links.github import marker
    from orchestrator.pipeline import RunOptions, run_pipeline
    from tests.pipeline.toy import make_repo, toy_configs, toy_pipeline

    monkeypatch.setenv("TOY_LEDGER", str(tmp_path / "ledger.txt"))
    repo = make_repo(tmp_path)
    result = run_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(wait_poll=0.05, issue="lab/exp#7"))
    assert result.ok, result.error
    with open_store() as store:
        [digest] = post_digests(store).digests
    card, posted = fake_github.comments_on("lab/exp", 7)
    assert card["body"].startswith(marker(result.pipeline_run.id))
    body = posted["body"]
    assert body.startswith(digest_marker(f"{utcnow():%Y-%m-%d}")) and digest.outcome == "created"
    assert f"`{result.pipeline_run.id}`" in body and "COMPLETED" in body
    assert "**Stages:** gen ✅ · upper ✅ · count ✅" in body
    assert " toy stages" in body, "the commit's subject"
    assert "**Used:** 3 job(s)" in body
    assert "CPU-hours used of the " in body and "the measured jobs asked" in body, "local jobs are measured"


def test_a_window_back_past_year_one_digests_everything_and_an_empty_since_is_refused(
    fake_github: FakeGitHub, store: LineageStore, day: dict[str, PipelineRun]
) -> None:
    """`github digest --since 99999999d` was `OverflowError: date value out of range`; `--since ''`
    was read as the default 24 hours."""
    from orchestrator.errors import ConfigError
    from orchestrator.lineage.listing import EARLIEST, parse_when

    window = digest_window("99999999d", until=NOW)
    assert window.start == EARLIEST
    assert window.since_arg() == "0001-01-01T00:00" and parse_when(window.since_arg()) == EARLIEST
    assert window.text().startswith("0001-01-01 00:00 to ")
    report = post_digests(store, since="99999999d", until=NOW, dry_run=True)
    [seven] = [d for d in report.digests if d.issue_id == "lab/exp#7"]
    assert "prun_old" in seven.body and "prun_done" in seven.body, "the run days before is in the window too"
    assert fake_github.count("POST", "/comments$") == 0
    for empty in ("", " "):
        with pytest.raises(ConfigError, match="no time given"):
            digest_window(empty, until=NOW)
